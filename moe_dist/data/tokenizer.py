"""SentencePiece tokenizer: trained in-process on the corpus, or loaded from a tokenizer.model.

Trained tokenizers keep text exactly (identity normalisation, whitespace kept, newline as
its own piece, byte fallback for characters outside the vocabulary), so decode(encode(t)) == t.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
from typing import Callable, Iterable, Iterator, Optional, Union

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

    @classmethod
    def resolve(cls, path: str) -> "Tokenizer":
        """A tokenizer file (sentencepiece ``tokenizer.model`` or Hugging Face ``tokenizer.json``), or a model
        directory holding one (its ``tokenizer.model`` first, as the model's own loaders prefer)."""
        if os.path.isdir(path):
            for name in ("tokenizer.model", "tokenizer.json"):
                if os.path.isfile(os.path.join(path, name)):
                    return cls.load(os.path.join(path, name))
            raise MissingInputError(f"tokenizer {path!r}: a directory without tokenizer.model or tokenizer.json")
        return cls.load(path)

    @property
    def file_name(self) -> str:
        """The conventional name of this tokenizer's file."""
        return "tokenizer.json" if self.proto.lstrip()[:1] == b"{" else "tokenizer.model"

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

    def encode_batch(self, texts: list[str], threads: Optional[int] = None) -> list[list[int]]:
        """Each text's ids; ``threads`` caps a sentencepiece model's own threads (None: its default, all cores)."""
        if threads is not None and isinstance(self.sp, spm.SentencePieceProcessor):
            return self.sp.encode(texts, num_threads=threads)
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


def train_tokenizer(texts: Union[list[str], Callable[[], Iterable[str]]], vocab_size: int, model_type: str = "bpe",
                    max_chars: int = 4_000_000, threads: int = 2) -> Tokenizer:
    """Train on (a spread-out sample of) ``texts``: a list, or a function that streams them (called
    twice: once to measure the corpus, once to sample it), so a large corpus is never held whole."""
    check_choice("data.tokenizer_type", model_type, ("bpe", "unigram"))
    buf = io.BytesIO()
    stream = texts if callable(texts) else (lambda: iter(texts))
    total = sum(len(t) for t in stream())
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_paragraphs(stream(), max_chars, total), model_writer=buf, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity", remove_extra_whitespaces=False,
            user_defined_symbols=["\n"], byte_fallback=True, allow_whitespace_only_pieces=True, split_digits=True,
            character_coverage=0.9999, max_sentence_length=1 << 16, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
            hard_vocab_limit=True, num_threads=threads, minloglevel=2)
    except RuntimeError as e:
        raise InputError(f"training the tokenizer failed (data.vocab_size={vocab_size} on {total} characters): {e}") from None
    return Tokenizer(buf.getvalue())
