"""Routers with a frozen part and a growing k: HyperRouter (Do et al., 2023) and
SMoE-Dropout (Chen et al., 2023).

SMoE-Dropout routes with a random router that never trains. HyperRouter generates each
layer's router ``[W | b] = H(e)`` from a trainable embedding ``e`` through a frozen random
hypernetwork ``H`` (2-layer ReLU MLP), so the router moves only along directions ``H`` allows.
Both raise k linearly from ``k_min`` to ``k_max`` over ``k_schedule_steps`` optimizer steps
(``ctx.step``), and route at ``eval_k`` (default ``k_max``) experts at inference
(``set_inference_k`` changes it for a whole model, e.g. to evaluate at several k). Whether the
gates are renormalised over the chosen experts is fixed at build time from ``k_max``
(:func:`~moe_dist.moe.routers.base.gate_normalization`), the same at every k of the schedule
and at every inference k.

Frozen tensors are *buffers*: outside every optimizer, weight decay and gradient
reduction, saved in the state dict. They are drawn from the global RNG like the other
weights, then :meth:`FrozenRouter.synchronize_frozen` (or :func:`~moe_dist.moe.routers.synchronize_frozen_routers`
for a whole model) broadcasts them from rank 0 and checks a hash on every rank; the
trainer calls it once after ``apply_expert_parallel`` and after loading a checkpoint.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ...distributed.collectives import all_gather_tensor, group_size
from ..routing.types import Routing, RouterInputs, RoutingContext
from .base import Router, gate_normalization, fp32_linear
from .registry import register_router
from ...errors import ConfigError


def scheduled_k(step: int, k_min: int, k_max: int, total_steps: Optional[int]) -> int:
    """``clip(round((k_max - k_min) * step / total_steps) + k_min, k_min, k_max)`` (half rounds up)."""
    if k_max == k_min or not total_steps:
        return k_max
    frac = min(max(step, 0) / total_steps, 1.0)
    return int(min(max(math.floor((k_max - k_min) * frac + 0.5) + k_min, k_min), k_max))


def _digest(tensors: Iterable[torch.Tensor]) -> int:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


class FrozenRouter(Router):
    """Linear top-k routing with a router that (partly) never trains, and a scheduled k.

    k_min: k at step 0 (default: the layer's top_k). k_max: k from ``k_schedule_steps`` on
        (default: k_min, i.e. a fixed k). k_schedule_steps: length of the linear ramp in
        optimizer steps (the trainer sets it to the run's total steps; required if k_max > k_min).
    eval_k: experts per token at inference (default: k_max, the k training ends with; the
        reference code selects checkpoints on validation at k = E).
    normalize: renormalise the gates over the chosen k (default: yes when k_max > 1), at every
        k of the schedule and every inference k; ``true`` is the reference code's gate (a
        softmax over the chosen logits).
    Subclasses register their frozen tensors with :meth:`register_frozen` and implement
    :meth:`router_weights`.
    """

    supports_expert_bias = supports_fp64 = supports_group_limit = has_inference_k = True

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, k_min: Optional[int] = None,
                 k_max: Optional[int] = None, k_schedule_steps: Optional[int] = None, eval_k: Optional[int] = None,
                 normalize: Optional[bool] = None):
        super().__init__(d_model, num_experts, top_k)
        k_min, k_max = self.k_bounds(top_k, k_min, k_max)
        if not 1 <= k_min <= k_max <= num_experts:
            raise ConfigError(f"model.moe.router_options: need 1 <= k_min <= k_max <= num_experts={num_experts}, "
                             f"got k_min={k_min}, k_max={k_max}")
        if k_max > k_min and (k_schedule_steps is None or int(k_schedule_steps) < 1):
            raise ConfigError("model.moe.router_options.k_schedule_steps must be the number of training steps (>= 1) "
                             f"when k_max > k_min, got {k_schedule_steps!r}")
        self.k_min, self.k_max = k_min, k_max
        self.k_schedule_steps = None if k_schedule_steps is None else int(k_schedule_steps)
        self.set_eval_k(eval_k)
        self.normalize = gate_normalization(self.final_k, normalize)
        self._frozen: list[str] = []

    # ---- k --------------------------------------------------------------------------------
    @staticmethod
    def k_bounds(top_k: int, k_min: Optional[int], k_max: Optional[int]) -> tuple[int, int]:
        """``(k_min, k_max)`` with their defaults: k_min the layer's top_k, k_max k_min."""
        k_min = top_k if k_min is None else int(k_min)
        return k_min, k_min if k_max is None else int(k_max)

    @classmethod
    def largest_k(cls, top_k: int, options: dict) -> int:
        k_max = cls.k_bounds(top_k, options.get("k_min"), options.get("k_max"))[1]
        eval_k = options.get("eval_k")
        return k_max if eval_k is None else max(k_max, int(eval_k))

    @property
    def final_k(self) -> int:
        return self.k_max

    @property
    def k_range(self) -> tuple[int, int]:
        return self.k_min, self.k_max

    @classmethod
    def options_for_run(cls, options: dict, total_steps: int) -> dict:
        """The k schedule spans the whole run (``total_steps``) unless ``k_schedule_steps`` is set."""
        if options.get("k_schedule_steps") is None:
            return {**options, "k_schedule_steps": total_steps}
        return options

    def current_k(self, ctx: RoutingContext) -> int:
        # in eval mode the trained model's k unless told otherwise (not ctx.step: 0 in a fresh eval process)
        return self.routing_k(scheduled_k(ctx.step, self.k_min, self.k_max, self.k_schedule_steps))

    # ---- frozen tensors ---------------------------------------------------------------------
    def register_frozen(self, name: str, tensor: torch.Tensor) -> None:
        self.register_buffer(name, tensor)
        self._frozen.append(name)

    def frozen_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._frozen]

    def frozen_digest(self) -> int:
        """A 64-bit hash of the frozen tensors' bytes."""
        return _digest(self.frozen_tensors())

    @torch.no_grad()
    def synchronize_frozen(self, group: Optional[dist.ProcessGroup] = None, name: str = "") -> bool:
        """Broadcast the frozen tensors from the group's first rank, then verify them.

        group: None = the default (world) group when torch.distributed is initialised.
        Collective: every rank of the group calls it, for every router, in the same order.
        """
        group = _default_group(group)
        if group_size(group) > 1:
            src = dist.get_global_rank(group, 0)
            for t in self.frozen_tensors():
                dist.broadcast(t, src=src, group=group)
        self.frozen_changed()
        self.verify_frozen(group, name)
        return True

    def verify_frozen(self, group: Optional[dist.ProcessGroup] = None, name: str = "") -> None:
        """Raise on every rank if any rank's frozen tensors differ (hash all-gather)."""
        group = _default_group(group)
        device = next((t.device for t in self.frozen_tensors()), torch.device("cpu"))  # where the group communicates
        digest = torch.tensor([self.frozen_digest()], dtype=torch.int64, device=device)
        digests = all_gather_tensor(digest, group).view(-1)
        differ = (digests != digests[0]).nonzero().view(-1).tolist()
        if differ:
            where = f" {name}" if name else ""
            raise RuntimeError(f"frozen router tensors{where} ({', '.join(self._frozen)}) differ between ranks: ranks "
                               f"{differ} do not match rank 0; call synchronize_frozen_routers(model) after building "
                               "the model on every rank")

    # ---- routing ------------------------------------------------------------------------------
    def router_weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        weight, bias = self.router_weights()
        logits = fp32_linear(x, weight, bias, dtype=self.compute_dtype)
        probs = torch.softmax(logits, dim=-1)
        k = self.current_k(ctx)
        expert_ids, gates = self.choose_topk(logits, probs, k, self.normalize)
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits,
                       extras={"k": logits.new_full((), float(k))})


def _default_group(group):
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


@register_router("smoe_dropout")
class SMoEDropoutRouter(FrozenRouter):
    """A random linear router ``[E, d] ~ N(0, init_std)`` that never trains."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, init_std: float = 0.02,
                 k_min: Optional[int] = None, k_max: Optional[int] = None, k_schedule_steps: Optional[int] = None,
                 eval_k: Optional[int] = None, normalize: Optional[bool] = None):
        super().__init__(d_model, num_experts, top_k, k_min=k_min, k_max=k_max, k_schedule_steps=k_schedule_steps,
                         eval_k=eval_k, normalize=normalize)
        self.register_frozen("frozen_weight", torch.randn(num_experts, d_model) * init_std)

    def router_weights(self):
        return self.frozen_weight, None


@register_router("hyper")
class HyperRouter(FrozenRouter):
    """``[W | b] = W2 relu(W1 e)`` reshaped to ``[E, d + 1]``; e ``[embed_dim]`` ~ N(0, 1) trains,
    ``W1 [hyper_dim, embed_dim]`` and ``W2 [E (d + 1), hyper_dim]`` ~ N(0, init_std) are frozen
    (the authors' code zeroes the hypernetwork biases, so they are left out).

    In training the router is generated on every call (gradient reaches e through H); in eval
    mode it is generated once and cached until e or H change.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, embed_dim: int = 256, hyper_dim: int = 256,
                 init_std: float = 0.02, k_min: Optional[int] = None, k_max: Optional[int] = None,
                 k_schedule_steps: Optional[int] = None, eval_k: Optional[int] = None,
                 normalize: Optional[bool] = None):
        super().__init__(d_model, num_experts, top_k, k_min=k_min, k_max=k_max, k_schedule_steps=k_schedule_steps,
                         eval_k=eval_k, normalize=normalize)
        if embed_dim < 1 or hyper_dim < 1:
            raise ConfigError(f"model.moe.router_options.embed_dim and hyper_dim must be >= 1, got {embed_dim}, {hyper_dim}")
        self.embedding = nn.Parameter(torch.randn(embed_dim))
        self.register_frozen("hyper_w1", torch.randn(hyper_dim, embed_dim) * init_std)
        self.register_frozen("hyper_w2", torch.randn(num_experts * (d_model + 1), hyper_dim) * init_std)
        self._cache: Optional[tuple] = None

    def generate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The router ``(W [E, d], b [E])`` for the current embedding, in fp32."""
        with torch.autocast(device_type=self.embedding.device.type, enabled=False):
            hidden = torch.relu(self.hyper_w1.float() @ self.embedding.float())
            out = (self.hyper_w2.float() @ hidden).view(self.num_experts, self.d_model + 1)
        return out[:, : self.d_model], out[:, self.d_model]

    def _cache_valid(self) -> bool:
        # the embedding is compared by value (256 numbers): a sharded-parameter wrapper may refill
        # the same storage without a version bump; frozen tensors change only through in-place
        # copies (state dict loads, which bump versions) or synchronize_frozen (which clears)
        if self._cache is None:
            return False
        frozen_key, embedding = self._cache[0], self._cache[1]
        return frozen_key == self._frozen_key() and torch.equal(embedding, self.embedding.detach())

    def _frozen_key(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for t in self.frozen_tensors())

    def router_weights(self):
        if self.training:
            self._cache = None
            return self.generate()
        if not self._cache_valid():
            with torch.no_grad():
                weight, bias = self.generate()
            self._cache = (self._frozen_key(), self.embedding.detach().clone(), weight, bias)
        return self._cache[2], self._cache[3]

    def frozen_changed(self) -> None:
        self._cache = None
