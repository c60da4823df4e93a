"""A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) behind the sentencepiece calls of
:class:`moe_dist.data.tokenizer.Tokenizer`, for checkpoints that carry no ``tokenizer.model``
(Qwen2, Llama-3)."""
from __future__ import annotations

from ..errors import InputError, UserError, install_hint

# document separators of base models, in order of preference (Qwen2 / GPT-2, Llama-3, Llama-2 / Mistral)
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class JsonTokenizerBackend:
    """A Hugging Face ``tokenizer.json`` behind the few sentencepiece calls the data pipeline
    makes (``encode``, ``decode``, ``get_piece_size``, ``eos_id``, ``unk_id``), so that
    checkpoints without a ``tokenizer.model`` (Qwen2, Llama-3) train with their own ids.
    No special tokens are added while encoding; documents are separated by the EOS id."""

    def __init__(self, data: bytes):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("a tokenizer.json needs the `tokenizers` package: " + install_hint("hf")) from None
        try:
            self.tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own exception type
            raise InputError(f"not a readable tokenizer.json: {e}") from None
        self._eos = next((i for i in map(self.tok.token_to_id, EOS_TOKENS) if i is not None), -1)

    def encode(self, text):
        if isinstance(text, str):
            return self.tok.encode(text, add_special_tokens=False).ids
        return [e.ids for e in self.tok.encode_batch(list(text), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def get_piece_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def eos_id(self) -> int:
        return self._eos

    def unk_id(self) -> int:
        unk = getattr(self.tok.model, "unk_token", None)
        found = self.tok.token_to_id(unk) if unk else None
        return -1 if found is None else found
