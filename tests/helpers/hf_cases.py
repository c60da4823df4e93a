"""Tiny dense Hugging Face checkpoints built locally from configs (no downloads), for the
HF interop, upcycling and planner tests."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)
FAMILY_EXTRAS = {
    "llama": dict(rope_theta=5000.0, rms_norm_eps=1e-6),
    "mistral": dict(rope_theta=20000.0, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=100000.0),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5),
}


def hf_classes(family: str):
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "phi3": "Phi3", "mixtral": "Mixtral",
             "olmoe": "Olmoe", "qwen2_moe": "Qwen2Moe"}[family]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def build_dense(family: str, directory: str, seed: int = 0, max_shard_size=None, **overrides):
    """A random dense checkpoint of ``family`` saved to ``directory`` (safetensors + config.json);
    every weight, norms and biases included, is perturbed so that no mapping error can hide
    behind a default value. Returns the transformers model (eval mode)."""
    config_cls, model_cls = hf_classes(family)
    cfg = config_cls(**{**TINY, **FAMILY_EXTRAS[family], **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


MOE_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2)
MOE_EXTRAS = {
    "mixtral": dict(num_local_experts=4, rope_theta=50000.0, sliding_window=None),
    "olmoe": dict(num_experts=4, pad_token_id=0, eos_token_id=1),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                      norm_topk_prob=False, rope_theta=20000.0),
}


def build_moe(family: str, directory: str, seed: int = 0, max_shard_size=None, **overrides):
    """A random MoE checkpoint (Mixtral, OLMoE or Qwen2-MoE) saved to ``directory``, built by transformers;
    every weight perturbed and the routers scaled up, so that routing decides the output and no
    mapping error hides behind a default. Returns the transformers model (eval mode)."""
    config_cls, model_cls = hf_classes(family)
    cfg = config_cls(**{**MOE_TINY, **MOE_EXTRAS[family], **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith("gate.weight") else 0.05))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def add_sentencepiece(directory: str, texts: list[str], vocab_size: int) -> str:
    """Train a small sentencepiece tokenizer (no byte fallback, so it fits a tiny vocabulary)
    and store it as the checkpoint's tokenizer.model."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", hard_vocab_limit=False, minloglevel=2, eos_id=1, bos_id=-1)
    path = os.path.join(directory, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def add_tokenizer_json(directory: str, texts: list[str], vocab_size: int) -> str:
    """Train a small byte-level BPE ``tokenizer.json`` (the kind Qwen2 and Llama-3 ship) with an
    ``<|endoftext|>`` document separator."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path
