"""The counted all-to-all bytes of MoE layer calls against a node's network interface counters.

    # on every node of the job (one process per rank; every MoE layer's experts over all ranks):
    torchrun --nnodes 2 --nproc-per-node 2 ... -m benchmarks.a2a_bytes [--calls 6] [--interface eth0]
        [--layers 64 512 512:bmm:1.0] [--tokens 128] [--experts 8] [--top-k 2] [--dispatch hierarchical]
        [--out result.json]

Only MoE layer calls run (forward + backward of one :class:`~moe_dist.moe.layer.MoELayer` at
``ep`` = the world size; no optimizer, no sharded dense weights), so what crosses a node's link is
the layer's traffic: its all-to-alls (which :mod:`moe_dist.moe.dispatch.traffic` counts) and its routing
statistics' all-gather, plus the transport's own bytes. Every node's first rank reads the
interface's ``tx_bytes`` / ``rx_bytes`` / packet counters (``/sys/class/net/IFACE/statistics``)
around windows that all ranks enter and leave together (a barrier, a pause for late
acknowledgements, the read, a barrier):

- ``idle``: no call, only the window's own barriers and reads;
- one window of ``--calls`` calls per ``--layers`` entry ``D_MODEL[:KERNEL[:CAPACITY_FACTOR]]``
  (default kernel ``loop``, the pipelined exchange; default dropless);
- for a dropless entry, one window of its exchange alone: the last call's rows sent out and back
  and their gradients likewise (:func:`exchange_call`), no routing, no statistics (flat dispatch only).

Per node and window, beyond the idle window, the bytes the interface sent are split into the
inter-node bytes its ranks counted, the packets' headers (:data:`HEADER_BYTES` per packet:
Ethernet, IPv4, TCP with timestamps) and the rest (``other``: what the layer sends uncounted,
its routing statistics' all-gather and gloo's message headers; the exchange-only windows show
gloo's share). Rank 0 prints one JSON object
(and writes it to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe_dist.distributed.bootstrap import init_distributed, shutdown
from moe_dist.distributed.roll_call import hosts
from moe_dist.distributed.topology import node_of_ranks
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.dispatch.flat import dispatch
from moe_dist.moe.dispatch.exchange import Exchange, exchange_rows, return_rows
from moe_dist.moe.dispatch.traffic import TrafficMeter
from moe_dist.parallel import apply_expert_parallel

COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with the timestamp option, per packet
SETTLE_S = 0.3  # for delayed TCP acknowledgements of a window's last bytes to go out before the read


def read_link(interface: str) -> dict[str, int]:
    """The interface's byte and packet counters (of this process's network namespace)."""
    base = f"/sys/class/net/{interface}/statistics"
    out = {}
    for name in COUNTERS:
        with open(os.path.join(base, name)) as f:
            out[name] = int(f.read())
    return out


def layer_call(layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> None:
    """One forward and backward of the layer (the all-to-alls both ways)."""
    y = layer(x)
    (y * w).sum().backward()


def exchange_of(layer: MoELayer, x: torch.Tensor, meter: TrafficMeter) -> tuple[torch.Tensor, Exchange]:
    """The rows of ``layer``'s last (dropless) routing of ``x`` in send order, and their exchange."""
    r = layer.last_routing
    rows, plan = dispatch(x.detach(), r.expert_ids, r.gates, None, layer.num_experts, layer.groups.ep)
    plan.exchange.meter = meter
    return rows.requires_grad_(), plan.exchange


def exchange_call(rows: torch.Tensor, ex: Exchange) -> None:
    """The layer's four transfers alone: rows out and back (the experts an identity), then their gradients."""
    received, _ = exchange_rows(rows, ex)
    return_rows(received, ex).sum().backward()


def window(leader: bool, interface: str, calls: int, fn) -> Optional[dict[str, int]]:
    """The counters' change over ``calls`` calls of ``fn`` on every rank (on a node's first rank; else None)."""
    dist.barrier()
    time.sleep(SETTLE_S)
    before = read_link(interface) if leader else None
    dist.barrier()
    for _ in range(calls):
        fn()
    dist.barrier()
    time.sleep(SETTLE_S)
    after = read_link(interface) if leader else None
    return {k: after[k] - before[k] for k in COUNTERS} if leader else None


def layer_spec(text: str) -> tuple[int, str, Optional[float]]:
    """``D_MODEL[:KERNEL[:CAPACITY_FACTOR]]`` -> (d_model, kernel, capacity factor or None)."""
    parts = text.split(":")
    try:
        return int(parts[0]), (parts[1] if len(parts) > 1 else "loop"), (float(parts[2]) if len(parts) > 2 else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: expected D_MODEL[:KERNEL[:CAPACITY_FACTOR]]") from None


def measure(args) -> Optional[dict]:
    rt = init_distributed(lambda names: len(names), args.experts, backend="gloo", device="cpu", dispatch=args.dispatch)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        nodes = node_of_ranks(hosts())
        leader = nodes.index(nodes[rank]) == rank
        idle = window(leader, args.interface, 0, lambda: None)
        results = []
        for d, kernel, cf in args.layers:
            torch.manual_seed(args.seed)
            layer = apply_expert_parallel(MoELayer(d, MoEArgs(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff,
                                                              capacity_factor=cf, expert_kernel=kernel)), rt.groups)
            g = torch.Generator().manual_seed(args.seed * 1000 + rank)
            x = torch.randn(args.tokens, d, generator=g).requires_grad_()
            w = torch.randn(args.tokens, d, generator=g)
            layer_call(layer, x, w)  # warm-up: first-use allocations and connections
            runs = [("layer", layer.traffic, lambda: layer_call(layer, x, w))]
            if cf is None and not layer.hierarchical:  # the same rows' four transfers alone (the last call's routing)
                meter = TrafficMeter(rt.groups.ep_nodes, rt.groups.ep_rank)
                rows, ex = exchange_of(layer, x, meter)
                runs.append(("exchange", meter, lambda: exchange_call(rows, ex)))
            for what, meter, call in runs:
                meter.take()
                link = window(leader, args.interface, args.calls, call)
                traffic = meter.take()
                everyone: list = [None] * world
                dist.all_gather_object(everyone, {"node": nodes[rank], "intra": traffic.intra, "inter": traffic.inter,
                                                  "by_kind": traffic.by_kind, "link": link})
                results.append({"calls_of": what, "d_model": d, "kernel": kernel, "capacity_factor": cf, "ranks": everyone})
        everyone_idle: list = [None] * world
        dist.all_gather_object(everyone_idle, idle)
        if rank:
            return None
        return summarise(args, nodes, everyone_idle, results)
    finally:
        shutdown(rt)


def beyond_idle(link: dict, idle: dict, counted_sent: int, counted_received: Optional[int]) -> dict:
    """One node's window less its idle window: bytes sent and received, their packets' headers, and the
    bytes neither counted nor headers (``other_sent``, ``other_received``)."""
    d = {k: link[k] - idle[k] for k in COUNTERS}
    out = {"sent": d["tx_bytes"], "received": d["rx_bytes"], "tx_packets": d["tx_packets"], "rx_packets": d["rx_packets"],
           "headers_sent": HEADER_BYTES * d["tx_packets"], "headers_received": HEADER_BYTES * d["rx_packets"]}
    out["other_sent"] = out["sent"] - counted_sent - out["headers_sent"]
    if counted_received is not None:
        out["other_received"] = out["received"] - counted_received - out["headers_received"]
    return out


def summarise(args, nodes: Sequence[int], idle: Sequence, results: Sequence[dict]) -> dict:
    """Per window and node: counted inter-node bytes sent (and, with two nodes, received), and the
    link's change beyond the idle window split into counted bytes, headers and the rest."""
    leaders = {n: nodes.index(n) for n in sorted(set(nodes))}
    out = {"calls": args.calls, "tokens_per_rank": args.tokens, "experts": args.experts, "top_k": args.top_k,
           "dispatch": args.dispatch,
           "ranks": len(nodes), "nodes": len(leaders), "interface": args.interface, "header_bytes": HEADER_BYTES,
           "idle": {str(n): idle[r] for n, r in leaders.items()}, "windows": []}
    for res in results:
        ranks = res["ranks"]
        per_node = {}
        for n, lead in leaders.items():
            counted_sent = sum(r["inter"] for r in ranks if r["node"] == n)
            # with two nodes, what the other node's ranks sent across reached this one
            counted_received = sum(r["inter"] for r in ranks if r["node"] != n) if len(leaders) == 2 else None
            link = beyond_idle(ranks[lead]["link"], idle[lead], counted_sent, counted_received)
            per_node[str(n)] = {"counted_sent": counted_sent, "counted_received": counted_received, **link,
                                "sent_over_counted": link["sent"] / max(counted_sent, 1),
                                "other_sent_per_call": link["other_sent"] / max(args.calls, 1)}
        out["windows"].append({"calls_of": res["calls_of"], "d_model": res["d_model"], "kernel": res["kernel"], "capacity_factor": res["capacity_factor"],
                               "counted_intra": sum(r["intra"] for r in ranks),
                               "counted_inter": sum(r["inter"] for r in ranks), "nodes": per_node})
    return out


def parse_args(argv: Optional[Sequence[str]] = None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.a2a_bytes", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=6, help="layer calls (forward + backward) per window")
    p.add_argument("--layers", type=layer_spec, nargs="+", default=[layer_spec(s) for s in ("64", "512", "512:bmm:1.0")],
                   help="one window per D_MODEL[:KERNEL[:CAPACITY_FACTOR]] (kernel default loop, default dropless)")
    p.add_argument("--d-ff", type=int, default=32, help="experts' hidden size")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank and call")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dispatch", choices=("flat", "hierarchical"), default="flat", help="parallel.dispatch")
    p.add_argument("--interface", default="eth0", help="the node's inter-node interface")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here (rank 0)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args)
    if result is not None:
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
