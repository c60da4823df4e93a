"""Entropic optimal transport between tokens and experts, in the log domain, with the
column sums reduced over the ranks that hold distinct tokens.

Problem (Selective Sinkhorn, max-cost form): with scores ``L = C / xi`` ``[N, E]`` find the
plan ``P = diag(u) exp(L) diag(v)`` whose rows sum to 1 (every token has mass 1) and whose
columns sum to ``N / E`` (uniform expert marginals), ``N`` the *global* number of tokens.

We keep ``g = log v`` (one value per expert, the "dual vector") and never form ``u``: the
row step is a row-wise softmax, so ``P = softmax(L + g, dim=-1)`` and every exponent is
<= 0 (no overflow at small xi, where a linear-domain kernel overflows). The row step needs
no communication; the column step sums ``E`` floats over the group per iteration. The stop
test reads the *reduced* vector, which an all-reduce hands bit-identical to every rank (gloo
and NCCL compute each reduced element once and broadcast it), so every rank leaves the loop
at the same iteration, and ``max_iters`` bounds it in any case.

The stop test is the solver's only host read, and it runs every ``check_every`` iterations
(default 8), not every one: ``ceil(iterations / check_every)`` reads at most per solve, none at
all when ``max_iters <= check_every``. Between tests the iterations go on, so the solver stops
at the first multiple of ``check_every`` (or ``max_iters``) at which the marginals are within
``tol``, a little more converged than a per-iteration test would leave them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_reduce_sum
from ...errors import ConfigError

_TINY = 1e-30  # a column that underflowed to 0 moves up by at most -log(_TINY) per iteration


@dataclass
class SinkhornResult:
    """dual: ``[E]`` log column scaling ``g`` (the plan is ``softmax(L + g, -1)``);
    iterations: column steps taken (0-d int64 tensor); error: final ``max_j |col_j / (N/E) - 1|``
    over the reduced columns (0-d fp32 tensor); tokens: global token count (0-d fp32)."""

    dual: torch.Tensor
    iterations: torch.Tensor
    error: torch.Tensor
    tokens: torch.Tensor
    host_reads: int = 0


def _column_sums(scores: torch.Tensor, dual: torch.Tensor, row_weight: Optional[torch.Tensor]) -> torch.Tensor:
    plan = torch.softmax(scores + dual, dim=-1)
    if row_weight is not None:
        plan = plan * row_weight[:, None]
    return plan.sum(0)


def _stop(error: torch.Tensor, tokens: torch.Tensor, tol: float) -> bool:
    """The stop test, one host read: converged, or nothing to transport (no tokens in the group)."""
    err, n = torch.stack([error.double(), tokens.double()]).tolist()
    return n == 0 or err < tol


@torch.no_grad()
def sinkhorn_dual(scores: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None, max_iters: int = 100,
                  tol: float = 1e-4, row_weight: Optional[torch.Tensor] = None, check_every: int = 8) -> SinkhornResult:
    """Solve for the expert dual ``g`` of the entropic plan ``softmax(scores + g, -1)``.

    scores: ``[N_local, E]`` = cost / xi (detached, converted to fp32 here).
    group: ranks holding distinct tokens of this call (None: this process alone). Every rank
        of the group must call this function for the same layer call.
    tol: relative tolerance on the column marginals, ``max_j |col_j / (N/E) - 1| < tol``.
    row_weight: ``[N_local]`` 0/1 weights (0 = padding: excluded from N and the columns).
    check_every: test for convergence (a host read) every this many iterations.
    """
    if max_iters < 1:
        raise ConfigError(f"sinkhorn max_iters must be >= 1, got {max_iters}")
    if not tol > 0:
        raise ConfigError(f"sinkhorn tol must be > 0, got {tol}")
    if check_every < 1:
        raise ConfigError(f"sinkhorn check_every must be >= 1, got {check_every}")
    scores = scores.detach().float()
    num_experts = scores.shape[1]
    if row_weight is not None:
        row_weight = row_weight.to(device=scores.device, dtype=torch.float32).reshape(-1)
        local_n = row_weight.sum().view(1)
    else:
        local_n = scores.new_full((1,), float(scores.shape[0]))
    dual = scores.new_zeros(num_experts)
    target = tokens = has_tokens = None
    iterations = reads = 0
    while True:
        col = _column_sums(scores, dual, row_weight)
        if tokens is None:  # the global token count rides on the first reduction
            reduced = all_reduce_sum(torch.cat([col, local_n]), group)
            col, tokens = reduced[:-1], reduced[-1]
            target = tokens / num_experts
            has_tokens = tokens > 0
        else:
            col = all_reduce_sum(col, group)
        iterations += 1
        error = (col / target - 1).abs().max()
        if iterations == max_iters:
            break  # (no update after the last measurement: ``error`` describes the returned dual)
        if iterations % check_every == 0:
            reads += 1
            if _stop(error, tokens, tol):  # same reduced vector everywhere -> same decision
                break
        step = torch.log(target) - torch.log(col.clamp_min(_TINY))
        dual = dual + torch.where(has_tokens, step, torch.zeros_like(step))  # no tokens: the dual stays 0
    # an empty group took no step: report 0 iterations and error 0, as if it had stopped at once
    iters = torch.where(has_tokens, torch.full((), iterations, dtype=torch.int64, device=scores.device), 0)
    error = torch.where(has_tokens, error, torch.zeros_like(error))
    return SinkhornResult(dual=dual, iterations=iters, error=error.detach(), tokens=tokens.detach(), host_reads=reads)


def transport_plan(scores: torch.Tensor, dual: torch.Tensor) -> torch.Tensor:
    """The rows of the plan for these tokens: ``softmax(scores + dual, -1)`` (each row sums to 1)."""
    return torch.softmax(scores.float() + dual, dim=-1)
