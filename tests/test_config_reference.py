"""docs/configuration.md is what ``python -m moe_dist.config.reference`` prints from the schema and
the router registry: every key and every router option, each with its meaning."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moe_dist.config import describe_schema
from moe_dist.config.reference import GENERATED_BY, render, router_option_rows
from moe_dist.moe import ROUTERS
from moe_dist.moe.routers import router_options

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_page_is_up_to_date():
    """Generated in a fresh process: a router another test registered in this one is not on the page."""
    page = subprocess.run([sys.executable, "-m", "moe_dist.config.reference"], cwd=PAGE.parents[1],
                          capture_output=True, text=True, check=True, timeout=120).stdout
    assert PAGE.read_text(encoding="utf-8") == page, (
        f"docs/configuration.md is out of date with moe_dist/config/schema.py or a router's options; "
        f"regenerate it from the repository root: {GENERATED_BY}")


def test_every_key_and_router_option_is_on_the_page():
    page = render()  # this process's registry: a router registered by another test is checked too
    missing = [key for key, *_ in describe_schema() if f"| `{key}` |" not in page]
    assert not missing, missing
    for name in ROUTERS:
        assert f"### `{name}`" in page
        rows = router_option_rows(name)
        assert [r["option"] for r in rows] == router_options(name)
        undescribed = [r["option"] for r in rows if not r["meaning"]]
        assert not undescribed, (f"router {name!r}: options {undescribed} have no description; describe each in "
                                 "the router class's docstring as `option: what it does`")


def test_presets_show_the_fixed_value():
    rows = {r["option"]: r for r in router_option_rows("sinkhorn")}
    assert rows["p"]["default"] == 1.0 and rows["p"]["preset"]
    rows = {r["option"]: r for r in router_option_rows("noisy_topk")}
    assert rows["noisy"]["default"] is True and rows["noisy"]["preset"]
