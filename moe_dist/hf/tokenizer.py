"""The tokenizer files that travel with a checkpoint.

A Hugging Face checkpoint carries ``tokenizer.model`` (sentencepiece: Llama-2, Mistral,
Phi-3) and/or ``tokenizer.json`` (the ``tokenizers`` library: Llama-3, Qwen2), plus small
JSON files with special tokens and chat templates. Upcycling and export copy them unchanged
so the MoE model tokenizes exactly as its dense parent.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

from .config import HFFormatError

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")


def copy_tokenizer(src: str, dst: str) -> list[str]:
    """Copy the tokenizer files present in ``src`` to ``dst``; returns their names."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            if os.path.abspath(path) != os.path.abspath(os.path.join(dst, name)):
                shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied


def adopt_tokenizer(src: str, dst: str, data_cfg, log: Callable[[str], None],
                    final_dir: Optional[str] = None) -> list[str]:
    """Copy ``src``'s tokenizer files next to converted weights in ``dst`` (which becomes
    ``final_dir``, default ``dst``) and point ``data_cfg.tokenizer`` at the copy unless the config
    names one; warn when ``src`` has none: evaluating or training the model is then refused until
    ``data.tokenizer`` names its tokenizer (:func:`moe_dist.weights.check_tokenizer_named`).
    Returns the copied file names."""
    copied = copy_tokenizer(src, dst)
    tok = tokenizer_file(dst)
    if tok is not None and data_cfg.tokenizer is None:
        data_cfg.tokenizer = os.path.join(os.path.abspath(final_dir or dst), os.path.basename(tok))
    elif tok is None and data_cfg.tokenizer is None:
        log(f"warning: {src} has no tokenizer.model or tokenizer.json; `moe-dist eval` and `train` refuse this model "
            "until data.tokenizer names the checkpoint's tokenizer (a new one would give ids that mean nothing to the "
            "embedding)")
    return copied


def sentencepiece_model(directory: str) -> Optional[str]:
    """Path of a loadable sentencepiece ``tokenizer.model`` in ``directory``, else None."""
    path = os.path.join(directory, "tokenizer.model")
    if not os.path.isfile(path):
        return None
    import sentencepiece as spm

    try:
        spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise HFFormatError(f"{path}: not a sentencepiece model ({e})") from None
    return path


def tokenizer_file(directory: str) -> Optional[str]:
    """The tokenizer the data pipeline should use: ``tokenizer.model`` (sentencepiece) if the
    checkpoint has one, else ``tokenizer.json``, else None."""
    sp = sentencepiece_model(directory)
    if sp is not None:
        return sp
    path = os.path.join(directory, "tokenizer.json")
    return path if os.path.isfile(path) else None


def tokenizer_vocab_size(directory: str) -> Optional[int]:
    """Entries of the checkpoint's tokenizer (sentencepiece, else tokenizer.json), or None if it has none."""
    sp = sentencepiece_model(directory)
    if sp is not None:
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=sp).get_piece_size()
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the `tokenizers` package comes with the hf extra
        return None
    try:
        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own exception type
        raise HFFormatError(f"{path}: not a readable tokenizer.json ({e})") from None


def check_tokenizer_fits(directory: str, vocab_size: int) -> Optional[int]:
    """The tokenizer must not produce ids beyond the embedding's rows."""
    n = tokenizer_vocab_size(directory)
    if n is not None and n > vocab_size:
        raise HFFormatError(f"{directory}: the tokenizer has {n} entries but config.json vocab_size={vocab_size}; "
                            "token ids past the embedding would be out of range")
    return n
