"""The GPU check's own logic on the CPU (``--device cpu``): sections run in their own processes, a
failing section is reported while the others run, and the layer parity covers every router."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_dist.moe.routers import ROUTERS


def test_gpu_check_runs_its_sections_on_the_cpu(tmp_path):
    out = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "moe_dist.bench.gpu_check", "--out", out, "--device", "cpu",
                           "--sections", "device,layer_parity"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.load(open(os.path.join(out, "gpu_check.json")))
    assert report["device"]["status"] == "ok" and report["device"]["matmul_tflops"] > 0
    parity = report["layer_parity"]
    assert parity["status"] == "ok" and parity["failed"] == 0 and parity["passed"] == 2 * len(ROUTERS)


def test_a_failing_section_is_reported_and_the_others_run(tmp_path):
    out = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "moe_dist.bench.gpu_check", "--out", out, "--device", "nodevice",
                           "--sections", "device,layer_parity"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0
    report = json.load(open(os.path.join(out, "gpu_check.json")))
    assert report["device"]["status"] == "failed" and "nodevice" in report["device"]["error"]
    assert "layer_parity" in report
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"]).returncode == 0
