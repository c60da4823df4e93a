"""The pipelined expert-parallel exchange (moe_dist.moe.dispatch.exchange): the loop kernel computes the
rows that stay on a rank while the others travel, forward and backward, and gets what the
plain exchange-then-compute path gets (outputs and row gradients bit for bit)."""
import pytest
import torch

from helpers.dist_harness import run_ranks
from moe_dist.moe.dispatch.exchange import Exchange, exchange_rows, experts_across, return_rows
from moe_dist.moe.experts import GroupedExperts

D_MODEL, D_FF, EXPERTS = 16, 24, 8


def _counts(ep: int, seed: int) -> torch.Tensor:
    """``[source, destination, local expert]`` rows, the same on every rank: uneven, with empty
    segments, an expert nobody sends to, and a source that sends nothing at all."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 9, (ep, ep, EXPERTS // ep), generator=g)
    c[c < 2] = 0
    c[:, 0, 0] = 0  # global expert 0 gets no rows
    c[ep - 1] = 0  # the last rank routes nothing
    return c


def _exchange(counts: torch.Tensor, rank: int, group) -> Exchange:
    return Exchange(group, rank, [int(v) for v in counts[rank].sum(1)], [counts[s, rank].tolist() for s in range(counts.shape[0])])


def _run(rank, world, activation, dtype, autocast, seed):
    import torch.distributed as dist

    counts = _counts(world, seed)
    ex = _exchange(counts, rank, dist.group.WORLD)
    local_counts = counts[:, rank].sum(0).tolist()
    torch.manual_seed(0)
    experts = GroupedExperts(EXPERTS // world, D_MODEL, D_FF, activation=activation, kernel="loop")
    experts.to(dtype)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(sum(ex.send), D_MODEL, generator=g).to(dtype)
    w = torch.randn(sum(ex.send), D_MODEL, generator=g).to(dtype)

    def grads(fn):
        xs = x.clone().requires_grad_(True)
        for p in experts.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(xs)
        (y.float() * w.float()).sum().backward()
        return {"y": y.detach(), "gx": xs.grad, **{n: p.grad.clone() for n, p in experts.named_parameters()}}

    pipelined = grads(lambda xs: experts_across(experts, xs, ex, local_counts))

    def plain(xs):
        rows, segments = exchange_rows(xs, ex)
        return return_rows(experts._loop(rows, local_counts, segments), ex)  # the same spans, one after the other

    return {"pipelined": pipelined, "plain": grads(plain), "local_counts": local_counts}


@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_exchange_equals_exchange_then_compute(world):
    cases = [("swiglu", torch.float32, False), ("gelu", torch.float32, False), ("swiglu", torch.bfloat16, False),
             ("swiglu", torch.float32, True)]
    results = run_ranks(_all, world, args=(cases,))
    for i, case in enumerate(cases):
        for rank, res in enumerate(results):
            got, want = res[i]["pipelined"], res[i]["plain"]
            assert got["y"].dtype == want["y"].dtype
            assert torch.equal(got["y"], want["y"]), (case, rank)
            assert torch.equal(got["gx"], want["gx"]), (case, rank)
            tol = dict(rtol=2e-2, atol=1e-2) if case[1] == torch.bfloat16 or case[2] else dict(rtol=1e-6, atol=1e-7)
            for name in ("w1", "w2") + (("w3",) if case[0] == "swiglu" else ()):
                # the same span products, summed in another order
                torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{case} rank {rank} {name}: {m}")
                idle = [e for e, c in enumerate(res[i]["local_counts"]) if c == 0]
                assert all(not got[name][e].any() for e in idle), (case, rank, name)  # zero, not garbage
        assert results[world - 1][i]["pipelined"]["y"].shape[0] == 0  # the rank that routed nothing took part


def _all(rank, world, cases):
    return [_run(rank, world, *case, seed=world) for case in cases]


def _schedule(rank, world):
    """The order of transfers and span computations in one forward and backward."""
    import torch.distributed as dist
    import moe_dist.moe.dispatch.exchange as exchange

    events = []

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            self.work.wait()

    real_start, real_fwd, real_bwd = exchange._start, exchange.span_forward, exchange.span_backward

    def start(*a, **k):
        events.append("start")
        return Logged(real_start(*a, **k))

    def fwd(x, e, w1, w3, w2, y):
        events.append(("fwd", x.shape[0]))
        return real_fwd(x, e, w1, w3, w2, y)

    def bwd(gy, x, *a, **k):
        events.append(("bwd", x.shape[0]))
        return real_bwd(gy, x, *a, **k)

    exchange._start, exchange.span_forward, exchange.span_backward = start, fwd, bwd
    counts = torch.full((world, world, EXPERTS // world), 6)
    ex = _exchange(counts, rank, dist.group.WORLD)
    experts = GroupedExperts(EXPERTS // world, D_MODEL, D_FF, kernel="loop")
    x = torch.randn(sum(ex.send), D_MODEL, requires_grad=True)
    experts_across(experts, x, ex, counts[:, rank].sum(0).tolist()).sum().backward()
    return events


def test_transfers_overlap_the_rows_that_stay():
    own, remote = 6 * EXPERTS // 2, 6 * EXPERTS // 2  # rows per rank that stay / that arrive (2 ranks)
    for events in run_ranks(_schedule, 2):
        starts = [i for i, e in enumerate(events) if e == "start"]
        assert len(starts) == 4, events  # two transfers forward, two backward
        for phase, part in (("fwd", events[:starts[2]]), ("bwd", events[starts[2]:])):
            marks = [i for i, e in enumerate(part) if e in ("start", "wait")]
            assert [part[i] for i in marks] == ["start", "wait", "start", "wait"], (phase, part)
            assert all(e[0] == phase for e in part if e not in ("start", "wait")), (phase, part)
            rows = [sum(e[1] for e in part[a + 1:b]) for a, b in zip(marks, marks[1:])]
            # while the rows travel out: half of this rank's own rows; then the arrived rows; while the
            # outputs (row gradients) travel back: the other half of the own rows
            assert rows == [own // 2, remote, own // 2], (phase, part)


def _peer_leaves(rank, world):
    """Rank 1 leaves before the exchange; rank 0's pipelined transfer fails in its wait()."""
    import torch.distributed as dist

    from moe_dist.distributed.collective_errors import failed_collective

    if rank == 1:
        dist.destroy_process_group()  # closes its connections, as a killed process would
        return None
    counts = torch.full((world, world, EXPERTS // world), 6)
    ex = _exchange(counts, rank, dist.group.WORLD)
    experts = GroupedExperts(EXPERTS // world, D_MODEL, D_FF, kernel="loop")
    try:
        experts_across(experts, torch.randn(sum(ex.send), D_MODEL), ex, counts[:, rank].sum(0).tolist())
    except RuntimeError as e:
        info = failed_collective(e)
        return None if info is None else {"name": info.name, "caller": info.caller, "ranks": info.ranks,
                                          "lost_or_timed_out": info.peer_lost or info.timed_out}
    return "no error"


def test_a_failed_transfer_is_named_like_a_blocking_collective():
    """An asynchronous all-to-all fails in its wait(), outside torch.distributed's frames: the
    error still names the collective, its group and the caller, so the launcher prints one line
    ("another rank went away") instead of a traceback."""
    info = run_ranks(_peer_leaves, 2, timeout=60)[0]
    assert info is not None and info != "no error"
    assert info["name"] == "all_to_all_single" and info["ranks"] == [0, 1] and info["lost_or_timed_out"]
    assert info["caller"].startswith("moe_dist/moe/dispatch/exchange.py:")
