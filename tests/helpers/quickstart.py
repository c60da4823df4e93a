"""docs/cluster-quickstart.md as tests read it: its bash blocks, the tiny dense Llama that stands in for
the 7B checkpoint, and the replacement of the page's paths (tests/test_cluster_quickstart.py,
tests/test_multinode_quickstart.py)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cluster-quickstart.md"
CORPUS = ROOT / "tests" / "data" / "python-docs"


def page_blocks() -> list[str]:
    """The page's ``bash`` blocks, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert blocks, "no bash blocks in docs/cluster-quickstart.md"
    return blocks


def page_script() -> str:
    """The page's bash blocks, in order, as one script."""
    return "\n".join(page_blocks())


def substitute(text: str, paths: dict[str, str]) -> str:
    """``text`` with every key of ``paths`` replaced by its value, in one pass (a value is not replaced
    again); where keys overlap, the first given wins (``/shared/corpus`` before ``/shared``)."""
    if not paths:
        return text
    return re.sub("|".join(map(re.escape, paths)), lambda m: paths[m.group(0)], text)


def tiny_dense(directory: Path) -> Path:
    """A tiny random dense Llama with a BPE tokenizer trained on the test corpus, in ``directory``."""
    from helpers.hf_cases import add_tokenizer_json, build_dense

    build_dense("llama", str(directory), vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    add_tokenizer_json(str(directory), [p.read_text() for p in sorted(CORPUS.rglob("*"))[:40] if p.is_file()], 512)
    return directory


def page_paths(dense: Path, shared: Path) -> dict[str, str]:
    """The page's paths on this machine: the dense checkpoint, the corpus, and ``/shared``."""
    return {"/shared/models/Llama-2-7b-hf": str(dense), "/shared/corpus": str(CORPUS), "/shared": str(shared)}
