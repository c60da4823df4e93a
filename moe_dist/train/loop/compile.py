"""``train.compile``: each transformer block through ``torch.compile`` (inductor), the MoE
layer's data-dependent middle left eager.

What is compiled, per block (as torchtitan does it for MoE models: a dense block whole, an MoE
block part by part, so that no compiled region ever sees a size that depends on the routing):

- a dense block: its whole ``forward`` (norms, attention, SwiGLU, residuals) in one graph;
- an MoE block: the attention norm, the attention (projections, RoPE, SDPA), the feed-forward
  norm, the router (scores, softmax, top-k; a router whose ``eager_under_compile`` gives a reason
  stays eager) and the shared expert.

What stays eager (:meth:`MoELayer.forward`'s own code, never traced): the statistics
all-gather and the auxiliary losses built on it, capacity, the dispatch (a host read of the
split sizes), the expert-parallel exchange (all-to-all, overlapped or not), the experts'
loop kernel (its own autograd function over host-sized spans) and the combine. Dropless
token counts therefore never reach a compiled graph: the compiled regions see ``[B, S, d]``
and ``[B*S, d]``, fixed during training; a new batch shape (an evaluation batch) compiles once
more, marked dynamic by dynamo's automatic-dynamic rule, so the count stays bounded
(:func:`compile_report`).

Each compiled ``forward`` is set on the module instance: the module's ``__call__`` (FSDP2's
unshard/reshard hooks, activation checkpointing around the block) stays eager and the
parameter names stay as they are, so checkpoints of compiled and eager runs are the same files.

The inductor cache (compiled kernels, the FX graph and AOTAutograd caches) lives in
``train.compile_cache_dir`` (default ``run.dir/compile_cache``): a restart or a requeue of the
same run finds it there and skips most of the compile time (:func:`use_cache_dir`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

DEFAULT_CACHE_SUBDIR = "compile_cache"


def cache_dir(cfg) -> str:
    """Where inductor keeps its cache for this run: ``train.compile_cache_dir``, else
    ``run.dir/compile_cache``."""
    return cfg.train.compile_cache_dir or os.path.join(cfg.run.dir, DEFAULT_CACHE_SUBDIR)


def use_cache_dir(path: str) -> None:
    """Point inductor's on-disk caches at ``path`` (before anything is compiled): the kernels and
    the FX graph cache (``TORCHINDUCTOR_CACHE_DIR``), the AOTAutograd cache with them."""
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):  # pragma: no cover - older torch without the AOTAutograd cache
        pass


def _compile_forward(module: nn.Module, fullgraph: bool) -> None:
    """Replace ``module.forward`` (on the instance) by its compiled form; hooks stay outside."""
    module.forward = torch.compile(module.forward, backend="inductor", fullgraph=fullgraph)


def moe_layer_parts(layer, prefix: str = "") -> list[tuple[str, nn.Module, bool]]:
    """``(name, module, fullgraph)`` of what is compiled inside an MoE layer: the router (unless its
    ``eager_under_compile`` says why not; graph breaks allowed, at a router's own host reads or
    collectives) and the shared expert."""
    parts = []
    if layer.router.eager_under_compile is None:
        parts.append((f"{prefix}router", layer.router, False))
    if layer.shared_expert is not None:
        parts.append((f"{prefix}shared_expert", layer.shared_expert, True))
    return parts


def compiled_parts(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(name, module, fullgraph)`` of every part :func:`apply_compile` compiles, in block order."""
    parts = []
    for i, block in enumerate(model.blocks):
        if not block.is_moe:
            parts.append((f"blocks.{i}", block, True))
            continue
        parts += [(f"blocks.{i}.attn_norm", block.attn_norm, True), (f"blocks.{i}.attn", block.attn, True),
                  (f"blocks.{i}.ffn_norm", block.ffn_norm, True),
                  *moe_layer_parts(block.ffn, f"blocks.{i}.ffn.")]
    return parts


def configure_dynamo(parts: int) -> None:
    """Dynamo settings for the compiled parts: a host read is a graph break, never a traced
    scalar; room in the cache for every layer's variants (training and evaluation)."""
    torch._dynamo.config.capture_scalar_outputs = False
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 4 * parts)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * parts)


def compile_parts(parts: list[tuple[str, nn.Module, bool]]) -> list[str]:
    """Compile each part's ``forward`` in place (lazily: its first call compiles); their names."""
    configure_dynamo(len(parts))
    for _, module, fullgraph in parts:
        _compile_forward(module, fullgraph)
    return [name for name, _, _ in parts]


def apply_compile(model: nn.Module) -> list[str]:
    """``train.compile``: compile the parts of :func:`compiled_parts` in place; their names."""
    return compile_parts(compiled_parts(model))


def eager_router_reason(model: nn.Module) -> Optional[str]:
    """Why :func:`compiled_parts` leaves the model's router eager, or None where it compiles it."""
    return next((block.ffn.router.eager_under_compile for block in model.blocks
                 if block.is_moe and block.ffn.router.eager_under_compile is not None), None)


class CompileClock:
    """Compile time and the number of compilations since it was made, from dynamo's own counters
    (``said``: the one line about them was printed)."""

    def __init__(self):
        self.graphs0, self.t0 = compilations(), _compile_seconds()
        self.said = False

    def report(self) -> dict:
        """``{"graphs": graphs compiled, "seconds": time spent compiling}`` since the clock was made."""
        return {"graphs": compilations() - self.graphs0, "seconds": round(_compile_seconds() - self.t0, 2)}


def compilations() -> int:
    """Graphs dynamo has compiled in this process (a recompilation counts as one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_seconds() -> float:
    """Seconds spent compiling in this process (dynamo's frame compiles, inductor's backward compiles)."""
    from torch._dynamo.utils import compilation_time_metrics

    total = 0.0
    for key in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"):
        total += sum(compilation_time_metrics.get(key, []))
    return total


def describe_compile(names: list[str], report: dict, cache: str, router: str = "",
                     eager_reason: Optional[str] = None) -> str:
    """The one line the trainer prints after the first step (``router``: the model's router, named
    with ``eager_reason`` (:func:`eager_router_reason`) when it stays eager)."""
    blocks = len({n.split(".")[1] for n in names})
    eager = f"; router {router} left eager: {eager_reason}" if eager_reason else ""
    return (f"compile: {len(names)} part(s) of {blocks} block(s) compiled (torch.compile, inductor) in "
            f"{report['seconds']:.1f}s, {report['graphs']} graph(s); inductor cache {cache}{eager}")
