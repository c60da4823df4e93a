"""Human-readable rendering of a plan (``moe-dist plan`` without ``--json``)."""
from __future__ import annotations


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_dispatch(p: dict) -> list[str]:
    """The dispatch table: bytes each GPU sends per step inside / across nodes and the predicted step time,
    per layout, dispatch and node limit."""
    n = p["network"]
    lines = [f"expert dispatch per step (balanced router) and predicted step time: intra-node {n['intra_gbps']:g} "
             f"Gbit/s per GPU, inter-node {n['inter_gbps_per_node']:g} Gbit/s per node, alpha {n['alpha_us']:g} us, "
             f"{n['compute_tflops']:g} TFLOP/s per GPU, FSDP overlap {'on' if n['fsdp_overlap'] else 'off'} "
             "(M: node-limited routing, at most M nodes per token; *: the config's parallel.dispatch and "
             "model.moe.max_groups_per_token):"]
    w = p["workload"]
    mine = (w.get("configured_dispatch", "flat"), w.get("configured_max_groups"))
    lines.append(f"  {'ep':>4} {'dispatch':<13} {'M':>2} {'intra/GPU':>10} {'inter/GPU':>10} {'step s':>8} "
                 f"{'compute':>8} {'a2a exp.':>8} {'sync exp.':>9} {'ckpt':>4}")
    for l in p["layouts"]:
        if not l.get("dispatch"):
            lines.append(f"  {l['ep']:>4} (an expert-parallel group that neither fills whole nodes nor sits in one: "
                         "not modelled)")
        for v in l.get("dispatch", []):
            star = "*" if (v["dispatch"], v["max_groups"]) == mine else " "
            lines.append(f" {star}{l['ep']:>4} {v['dispatch']:<13} {v['max_groups'] or '-':>2} "
                         f"{_bytes(v['intra_bytes_per_gpu_per_step']):>10} {_bytes(v['inter_bytes_per_gpu_per_step']):>10} "
                         f"{v['step_s']:>8.3f} {v['compute_s']:>8.3f} {v['exposed_all_to_all_s']:>8.3f} "
                         f"{v['exposed_sync_s']:>9.3f} {'on' if v['activation_checkpointing'] else 'off':>4}")
    return lines


def _command_lines(p: dict) -> list[str]:
    """The recommended command, the batch settings it changes and why, and the dry run that checks it."""
    cmd = p.get("command")
    if not cmd:
        return []
    lines = []
    if p.get("batch_changes"):
        from .command import describe_batch_changes

        lines.append(f"  batch settings changed: {describe_batch_changes(p['batch_changes'], p['cluster']['world_size'])}")
    if cmd["train"]:
        lines.append(f"  command: {cmd['train']}")
    else:
        lines.append(f"  overrides (for the config that upcycle or import writes): {' '.join(cmd['overrides'])}")
    lines.append(f"  check it (one rank's real step on fake tensors, its peak against the GPU's memory; exit 0 if it "
                 f"fits): {cmd['dry_run']}")
    return lines


def format_plan(p: dict) -> str:
    m, c, w, pc = p["model"], p["cluster"], p["workload"], p["params"]
    lines = [f"model: {p['source']} ({p['kind']})",
             f"  parameters: {_b(p['total_params'])} total, {_b(p['active_params'])} active per token "
             f"({p['total_params']:,} / {p['active_params']:,})"]
    if m["moe_layers"]:
        lines.append(f"  MoE: {len(m['moe_layers'])} of {m['n_layers']} blocks x {m['num_experts']} experts "
                     f"(top-{m['top_k']}, router {m['router']}), {_b(pc['per_expert'])} per expert, experts "
                     f"{_b(pc['experts'])}, everything else {_b(pc['dense_params'])}")
    else:
        lines.append(f"  dense: {m['n_layers']} blocks")
    reserve = 1 - c.get("usable_fraction", c["usable_gib"] / c["gpu_mem_gib"])
    lines.append(f"cluster: {c['nodes']} node(s) x {c['gpus_per_node']} GPU(s) = {c['world_size']}, "
                 f"{c['gpu_mem_gib']:g} GiB each ({c['usable_gib']:.1f} usable: {100 * reserve:.0f}% kept for what the "
                 "plan does not model, the CUDA context, NCCL's buffers and the allocator's fragmentation)")
    lines.append(f"workload: {w['micro_batch_per_gpu']} x {w['seq_len']} tokens per GPU per micro-batch, "
                 f"grad_accum {w['grad_accum']}, {w['activation_dtype']} activations, dense weights {w['dense_weights']}")
    lines.append("")
    sharding = ("dense FSDP-sharded over all ranks, experts split over ep and FSDP-sharded over edp"
                if w["dense_weights"] == "fsdp" else "dense replicated, experts split over ep")
    lines.append(f"per-GPU memory (GiB) by expert-parallel size, moe_dist engine (weights+grads+AdamW fp32; {sharding}; "
                 "gather: FSDP2's gathered weights; opt: AdamW's step temporary; total: states + the largest transient):")
    head = f"  {'ep':>4} {'edp':>4} {'weights':>8} {'grads':>8} {'optim':>8} {'gather':>7} {'opt':>6} {'act':>8} " \
           f"{'act(ckpt)':>9} {'total':>8} {'total(ckpt)':>11} {'a2a/GPU/step':>13}"
    lines.append(head)
    for l in p["layouts"]:
        g = l["memory_gib"]
        lines.append(f"  {l['ep']:>4} {l['edp']:>4} {g['weights']:>8.2f} {g['grads']:>8.2f} {g['optimizer']:>8.2f} "
                     f"{g['fsdp_gather']:>7.2f} {g['optimizer_step']:>6.2f} {g['activations']:>8.2f} "
                     f"{g['activations_checkpointed']:>9.2f} "
                     f"{g['total']:>8.2f} {g['total_with_activation_checkpointing']:>11.2f} "
                     f"{_bytes(l['all_to_all']['bytes_per_gpu_per_step']):>13}")
    lines.append("")
    if "network" in p:
        lines += format_dispatch(p) + [""]
    lines.append("ZeRO stages, for comparison (what DeepSpeed's ZeRO-1/2, train.engine=deepspeed, or ZeRO-3 would hold; "
                 "dense sharded over all ranks, experts over their edp replicas; the recommendation below is for the "
                 "moe_dist engine above), total GiB per GPU without / with activation checkpointing:")
    for l in p["layouts"]:
        parts = [f"{k}: {v['total']:.2f} / {v['total_with_activation_checkpointing']:.2f}" for k, v in l["zero_stages_gib"].items()]
        lines.append(f"  ep={l['ep']:<3} " + "  ".join(parts))
    lines.append("")
    r = p["recommended"]
    if r:
        grad_sync = f" parallel.grad_sync={r['grad_sync']}" if r.get("grad_sync", "step") != "step" else ""
        batch = "".join(f" {key}={new}" for key, (_, new) in (p.get("batch_changes") or {}).items())
        lines.append(f"recommended: ep={r['ep']}, edp={r['edp']}, dp={r['dp']}, activation checkpointing "
                     f"{'on' if r['activation_checkpointing'] else 'off'} "
                     f"(parallel.ep={r['ep']} train.activation_checkpointing={str(r['activation_checkpointing']).lower()}"
                     f"{grad_sync}{batch}{'; batch settings changed: see below' if batch else ''})")
        if r.get("expert_split", "none") != "none":  # how FSDP2 splits each layer's experts over their edp replicas
            lines.append(f"  experts over their {r['edp']} replicas: split {r['expert_split']} (parallel.expert_shard)")
        a = r["all_to_all"]
        per_gpu = a["bytes_per_gpu_per_step_checkpointed" if r["activation_checkpointing"] else "bytes_per_gpu_per_step"]
        lines.append(f"  all-to-all per step: {_bytes(per_gpu)} sent per GPU, {_bytes(per_gpu * r['dp'])} over all GPUs, "
                     f"{'within a node' if r['ep_within_node'] else _bytes(a['inter_node_bytes_per_gpu_per_step']) + ' per GPU across nodes'}; "
                     f"weights/grads sync {_bytes(r['weight_and_grad_sync_bytes_per_gpu_per_step'])} per GPU")
    else:
        lines.append("recommended: none")
    lines.append(f"  why: {p['reason']}")
    lines += _command_lines(p)
    for note in p["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
