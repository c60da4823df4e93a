"""Do the ranks of a dry-run world agree on every collective? A plan only rank 0 sees as valid is
a hang on a real cluster.

Each rank's dry run logs the collectives of its training steps (:func:`~moe_dist.plan.dry_run.dry_run`
with ``log_collectives``). For every group whose members were all run, the members must start the
same collectives in the same order with the same sizes, and in an all-to-all each rank must
receive from a peer what that peer sends it (rows and row width). Collectives over a group of which
only some members were run are checked for equal sizes among those.

    moe-dist plan --config CONFIG --nodes 8 --check-collectives     # every rank, or --sample
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional


def sample_ranks(world: int, ep: int) -> list[int]:
    """The ranks of the first expert-parallel group and of the first expert-data-parallel group:
    every kind of group the step uses, complete (the data-parallel group is checked on these)."""
    return sorted(set(range(ep)) | set(range(0, world, ep)))


def _per_group(logs: dict[int, list[dict]]) -> dict[tuple, dict[int, list[dict]]]:
    out: dict[tuple, dict[int, list[dict]]] = defaultdict(dict)
    for rank, entries in logs.items():
        for e in entries:
            out[tuple(e["group"])].setdefault(rank, []).append(e)
    return out


def check(logs: dict[int, list[dict]]) -> list[str]:
    """The disagreements between ranks' collective logs (``{rank: [entry, ...]}``), one line each
    (empty: they agree)."""
    problems: list[str] = []
    for group, by_rank in sorted(_per_group(logs).items()):
        members = [r for r in group if r in logs]
        complete = set(group) <= set(logs)
        counts = {r: len(by_rank.get(r, [])) for r in members}
        if len(set(counts.values())) > 1:
            problems.append(f"group {list(group)}: the ranks start different numbers of collectives {counts}")
            continue
        for k in range(next(iter(counts.values()), 0)):
            calls = {r: by_rank[r][k] for r in members}
            problems += _compare(group, k, calls, complete)
    return problems


def _compare(group: tuple, k: int, calls: dict[int, dict], complete: bool) -> list[str]:
    ops = {c["op"] for c in calls.values()}
    where = f"group {list(group)} collective {k}"
    if len(ops) > 1:
        return [f"{where}: different ops {sorted(ops)}"]
    op = ops.pop()
    if op.startswith("alltoall_base") and all(c.get("out_splits") and c.get("in_splits") for c in calls.values()):
        if not complete:
            return []
        out = []
        pos = {r: i for i, r in enumerate(group)}
        for r, c in calls.items():
            for s, d in calls.items():
                got, sent = c["out_splits"][pos[s]], d["in_splits"][pos[r]]
                if got != sent:
                    out.append(f"{where} ({op}): rank {r} expects {got} rows from rank {s}, which sends {sent}")
        if len({c["row"][0] for c in calls.values() if c["row"][0]}) > 1:
            out.append(f"{where} ({op}): the ranks' rows differ in width")
        return out
    sizes = {r: tuple(c["numel"]) for r, c in calls.items()}  # an even all-to-all: equal sizes too
    if len(set(sizes.values())) > 1:
        return [f"{where} ({op}): sizes differ between ranks {sizes}"]
    return []


def check_world(config: str, overrides: Iterable[str] = (), *, nodes: int = 1, gpus_per_node: int = 8,
                ranks: Optional[list[int]] = None, routing="balanced", steps: int = 1,
                micro_batch: Optional[int] = None, log=print) -> dict:
    """Dry-run ``ranks`` (default: :func:`sample_ranks`) and check their collectives; a dict with the
    ranks run, the collectives per rank, the problems and the seconds."""
    import time

    from .dry_run import dry_run

    start = time.perf_counter()
    first = dry_run(config, overrides, nodes=nodes, gpus_per_node=gpus_per_node, rank=0, routing=routing,
                    steps=steps, micro_batch=micro_batch, log_collectives=True)
    world, ep = first["layout"]["world_size"], first["layout"]["ep"]
    ranks = sample_ranks(world, ep) if ranks is None else sorted(set(ranks))
    logs = {0: first["collectives"]} if 0 in ranks else {}
    for r in ranks:
        if r not in logs:
            logs[r] = dry_run(config, overrides, nodes=nodes, gpus_per_node=gpus_per_node, rank=r, routing=routing,
                              steps=steps, micro_batch=micro_batch, log_collectives=True)["collectives"]
            log(f"rank {r}: {len(logs[r])} collectives")
    problems = check(logs)
    return {"world_size": world, "ep": ep, "ranks": ranks, "collectives_per_rank": {r: len(v) for r, v in logs.items()},
            "problems": problems, "seconds": round(time.perf_counter() - start, 1)}
