"""SentencePiece tokenizer: trained in-process on the corpus, or loaded from a tokenizer.model.

Trained tokenizers keep text exactly (identity normalisation, whitespace kept, newline as
its own piece, byte fallback for characters outside the vocabulary), so decode(encode(t)) == t.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
from typing import Iterable, Iterator

import sentencepiece as spm

from ..checks import check_choice
from ..errors import InputError, MissingInputError
from ..safe_io import MIB, UnreadableFile, read_bytes

TOKENIZER_LIMIT = 512 * MIB  # a sentencepiece model is a few MB, a tokenizer.json tens of MB


class Tokenizer:
    """A SentencePiece model with an end-of-document id."""

    def __init__(self, model_proto: bytes):
        self.proto = model_proto
        if model_proto.lstrip()[:1] == b"{":  # a Hugging Face tokenizer.json (Qwen2, Llama-3 checkpoints)
            from .json_tokenizer import JsonTokenizerBackend

            self.sp = JsonTokenizerBackend(model_proto)
        else:
            self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.eos_id = self.sp.eos_id()
        if self.eos_id < 0:  # a foreign model without EOS: documents are separated by unk
            self.eos_id = max(self.sp.unk_id(), 0)

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        if not os.path.exists(path):
            raise MissingInputError(f"data.tokenizer={path!r} does not exist")
        try:
            return cls(read_bytes(path, TOKENIZER_LIMIT))
        except UnreadableFile as e:
            raise InputError(f"data.tokenizer={path!r}: {e.why}") from None
        except RuntimeError as e:
            raise InputError(f"data.tokenizer={path!r} is not a sentencepiece model: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.proto)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.proto).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


def _paragraphs(texts: Iterable[str], max_chars: int, total_chars: int) -> Iterator[str]:
    """Every ``stride``-th paragraph so that about ``max_chars`` characters, spread over the
    whole corpus, train the tokenizer (deterministic)."""
    stride = max(1, math.ceil(total_chars / max_chars))
    n = 0
    for text in texts:
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            if n % stride == 0:
                yield para + "\n"
            n += 1


def train_tokenizer(texts: list[str], vocab_size: int, model_type: str = "bpe", max_chars: int = 4_000_000,
                    threads: int = 2) -> Tokenizer:
    """Train on (a spread-out sample of) ``texts``."""
    check_choice("data.tokenizer_type", model_type, ("bpe", "unigram"))
    buf = io.BytesIO()
    total = sum(len(t) for t in texts)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_paragraphs(texts, max_chars, total), model_writer=buf, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity", remove_extra_whitespaces=False,
            user_defined_symbols=["\n"], byte_fallback=True, allow_whitespace_only_pieces=True, split_digits=True,
            character_coverage=0.9999, max_sentence_length=1 << 16, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
            hard_vocab_limit=True, num_threads=threads, minloglevel=2)
    except RuntimeError as e:
        raise InputError(f"training the tokenizer failed (data.vocab_size={vocab_size} on {total} characters): {e}") from None
    return Tokenizer(buf.getvalue())
