"""The documentation's shape: every relative link in README.md, docs/, launch/, docker/ and benchmarks/
points at a file that exists (and, with ``#anchor``, at a heading of that page), and every how-to
page and every results page (benchmarks/results/: one page per subject) stays short (at most 300
lines; the generated configuration reference and the router study's reports under docs/router-study/
are exempt)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs", "launch", "docker", "benchmarks")
RESULTS = "benchmarks/results"  # the one results home: an index (README.md) and one page per subject
MAX_LINES = 300
EXEMPT = ("docs/configuration.md", "docs/router-study/")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def markdown_files() -> list[Path]:
    out = []
    for name in PAGES:
        path = ROOT / name
        out += [path] if path.is_file() else sorted(path.rglob("*.md"))
    return out


def _prose(text: str, code_spans: bool = False) -> str:
    """``text`` without fenced code blocks (a ``#`` comment there is not a heading), and without inline
    code spans unless ``code_spans`` (links there are not links; a heading keeps its span's text)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line if code_spans else re.sub(r"`[^`\n]*`", "", line))
    return "\n".join(lines)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered (-1, -2, ...); explicit ``<a id=...>`` / ``<a name=...>`` too."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    for line in _prose(text, code_spans=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links() -> list[str]:
    """``page: link (why)`` for every relative link that does not resolve."""
    bad = []
    for page in markdown_files():
        for m in _LINK.finditer(_prose(page.read_text(encoding="utf-8"))):
            link = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("//"):
                continue  # http:, https:, mailto:, ...
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            rel = page.relative_to(ROOT)
            if not path.exists():
                bad.append(f"{rel}: {link} (no file {target})")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{rel}: {link} (no heading #{anchor} in {path.relative_to(ROOT)})")
    return bad


def missing_mentions() -> list[str]:
    """``file:line: path`` for every ``docs/....md`` or ``*/README.md`` that code, configs, scripts and
    tests name (in comments, help texts, messages) and that does not exist: they are links too."""
    bad, me = [], Path(__file__).resolve()
    files = [p for d in ("moe_dist", "configs", "scripts", "tests", "launch", "docker", "benchmarks")
             for p in sorted((ROOT / d).rglob("*")) if p.is_file() and p.suffix in (".py", ".yaml", ".sh", ".sbatch", "")]
    for path in files:
        if path.resolve() == me or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for ref in re.findall(r"(?<![\w/.-])((?:docs|launch|docker|bench|benchmarks)/[\w./-]*\.md)", line):
                if not (ROOT / ref).exists():
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    return bad


def long_pages() -> list[str]:
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / RESULTS).glob("*.md"))]:
        rel = page.relative_to(ROOT).as_posix()
        if any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in EXEMPT):
            continue
        n = len(page.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            out.append(f"{rel}: {n} lines")
    return out


def test_every_relative_link_resolves():
    bad = broken_links()
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_page_the_code_names_exists():
    bad = missing_mentions()
    assert not bad, "pages named in code, configs, scripts or tests that do not exist:\n" + "\n".join(bad)


def test_how_to_pages_are_short():
    bad = long_pages()
    assert not bad, (f"pages over {MAX_LINES} lines (move measurements and dated figures to the subject's page "
                     f"in {RESULTS}/, split a page that covers two subjects):\n" + "\n".join(bad))


def test_one_results_home_with_an_index_of_its_pages():
    """The results live in benchmarks/results/ only, and its index links every page of it."""
    assert not (ROOT / "bench").exists(), "a second benchmarks home, bench/, is back (benchmarks/ is the one)"
    pages = sorted(p.name for p in (ROOT / RESULTS).glob("*.md") if p.name != "README.md")
    assert len(pages) >= 10, pages
    index = (ROOT / RESULTS / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1) for m in re.finditer(r"\]\(([\w.-]+\.md)\)", index)}
    assert not set(pages) - linked, f"results pages the index does not link: {sorted(set(pages) - linked)}"


def test_the_link_check_catches_a_broken_link(tmp_path, monkeypatch):
    """The check itself: a page with a missing file and a missing anchor is reported twice."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Title\n\n[ok](docs/a.md#a-page) [gone](docs/b.md) [bad](#nothing)\n"
                                        "`[code](docs/c.md)`\n")
    (tmp_path / "docs" / "a.md").write_text("# A page\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    bad = broken_links()
    assert len(bad) == 2 and "docs/b.md" in bad[0] and "#nothing" in bad[1], bad


@pytest.mark.parametrize("heading,slug", [("Node-limited routing (`model.moe.router_groups`)",
                                           "node-limited-routing-modelmoerouter_groups"),
                                          ("Exit codes", "exit-codes")])
def test_anchor_slugs(tmp_path, heading, slug):
    page = tmp_path / "p.md"
    page.write_text(f"## {heading}\n")
    assert slug in anchors(page)
