"""Section ``tests``: the device tests (``tests/test_device_layer.py``: every router's layer against
the CPU) run by pytest on the device, counted from its JUnit report."""
from __future__ import annotations

import os
import sys

from .context import Context, SectionFailed, check_device, child_env, run_command
from .settings import DEVICE_TESTS


def junit_counts(path: str) -> dict:
    """Counts and failed test ids of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('name')}: {message[0][:300] if message else ''}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def section_tests(ctx: Context) -> dict:
    import importlib.util

    check_device(ctx.device)
    xml = ctx.path("tests", "junit.xml")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *DEVICE_TESTS]
    if importlib.util.find_spec("pytest_timeout") is None:  # pytest.ini's --timeout needs it
        cmd[4:4] = ["-o", "addopts=-ra"]
    else:  # a hanging test fails alone (and the report is written) instead of the section's time running out
        cmd.append("--timeout=60")
    rc = run_command(cmd, ctx.left_s() - 3, env=child_env({"MOE_DIST_TEST_DEVICE": ctx.device}))
    if not os.path.exists(xml):
        raise RuntimeError(f"pytest exited with {rc} and wrote no report (collection or start-up failed; see above)")
    figs = dict(junit_counts(xml), files=DEVICE_TESTS, pytest_exit_code=rc)
    if figs["passed"] == 0 or figs["failed"] or rc != 0:
        raise SectionFailed(f"{figs['failed']} failed, {figs['passed']} passed, {figs['skipped']} skipped "
                            f"(pytest exit {rc})", figs)
    return figs
