"""The README's "Layout of the code" names only packages and modules that exist: every entry (a
name ending in ``/`` or ``.py`` at the start of a line, nested by indentation) and every module a
description names (``name.py``, inside the entry's package) is checked against the tree."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = re.compile(r"[\w.]+(?:/|\.py)$")
MODULE = re.compile(r"(?<![\w./-])(\w+\.py)\b")


def _layout_block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Layout of the code", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def _named_paths() -> list[str]:
    """Every path the block names, relative to the repository root."""
    paths, parents = [], []  # parents: (indent, directory) of the enclosing entries
    for line in _layout_block():
        indent = len(line) - len(line.lstrip())
        words = line.split()
        entries = []
        for w in words:  # the leading run of entry names
            if not ENTRY.match(w):
                break
            entries.append(w)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        if entries:
            paths += [os.path.join(base, e) for e in entries]
            if len(entries) == 1 and entries[0].endswith("/"):
                parents.append((indent, os.path.join(base, entries[0])))
                base = os.path.join(base, entries[0])
        rest = " ".join(words[len(entries):])
        paths += [os.path.join(base, m) for m in MODULE.findall(rest)]
    return paths


def test_every_named_package_and_module_exists():
    paths = _named_paths()
    assert "moe_dist/moe/routing/stage.py" in paths and "moe_dist/tuning/" in paths and "tests/" in paths
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README 'Layout of the code' names what the tree does not hold: {missing}"


def test_every_package_of_moe_dist_is_drawn():
    drawn = {p.rstrip("/") for p in _named_paths()}
    packages = sorted(f"moe_dist/{d}" for d in os.listdir(os.path.join(ROOT, "moe_dist"))
                      if os.path.isfile(os.path.join(ROOT, "moe_dist", d, "__init__.py")))
    assert not [p for p in packages if p not in drawn], f"packages missing from the README's layout: {packages}"
