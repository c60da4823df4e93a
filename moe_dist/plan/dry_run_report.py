"""What ``moe-dist plan --dry-run`` prints and returns: the dry run's memory at the peak beside the
planner's figures for the same layout, and its verdict against the GPU's memory (``--gpu-mem-gib``),
which the command's exit status follows so that a script can gate a submission on it:

- 0: it fits (``fits with X GiB to spare``);
- 3 (:data:`DOES_NOT_FIT`): the peak is above the usable memory (``does not fit by X GiB``);
- 2: bad input (one line naming the option), as every command.

Usable memory is the planner's: ``--gpu-mem-gib`` less the share kept for what neither models (the
CUDA context, NCCL's buffers, the allocator's fragmentation; :data:`~moe_dist.plan.planner.USABLE_FRACTION`)."""
from __future__ import annotations

from typing import Optional

from .memory import GIB

DOES_NOT_FIT = 3  # exit status of `moe-dist plan --dry-run` when the peak is above the usable memory


def verdict(peak_bytes: int, gpu_mem_gib: float) -> dict:
    """``fits``, ``spare_gib`` (negative: short by that much), ``usable_gib`` and the verdict in one line."""
    from .planner import USABLE_FRACTION

    usable = gpu_mem_gib * USABLE_FRACTION
    spare = usable - peak_bytes / GIB
    head = f"fits with {spare:.2f} GiB to spare" if spare >= 0 else f"does not fit by {-spare:.2f} GiB"
    return {"fits": spare >= 0, "spare_gib": round(spare, 3), "usable_gib": round(usable, 3),
            "line": (f"verdict: {head}: peak {peak_bytes / GIB:.2f} GiB of {usable:.2f} usable ({gpu_mem_gib:g} GiB "
                     f"per GPU less the {100 * (1 - USABLE_FRACTION):.0f}% kept for the CUDA context, NCCL's buffers "
                     "and the allocator's fragmentation)")}


def with_planner(result: dict, gpu_mem_gib: float = 80.0) -> dict:
    """``result`` with the planner's memory of the same layout (``result["planner"]``) and the verdict
    against ``gpu_mem_gib`` (``result["verdict"]``: :func:`verdict`)."""
    from .planner import plan

    lay = result["layout"]
    planned = plan(result["config"], lay["nodes"], lay["gpus_per_node"], gpu_mem_gib, result["overrides"],
                   seq_len=lay["seq_len"], micro_batch=lay["micro_batch"])
    same = [l for l in planned["layouts"] if l["ep"] == lay["ep"]]
    memory = same[0]["memory_gib"] if same else None
    if memory is not None and lay["activation_checkpointing"]:
        memory = dict(memory, total=memory["total_with_activation_checkpointing"],
                      activations=memory["activations_checkpointed"],
                      at_peak=memory["at_peak_with_activation_checkpointing"])
    return dict(result, planner={"memory_gib": memory, "recommended_ep": (planned["recommended"] or {}).get("ep")},
                verdict=verdict(result["peak_bytes"], gpu_mem_gib))


def comparison_rows(result: dict) -> list[tuple[str, float, Optional[float]]]:
    """(category, dry run GiB, planner GiB or None) for the report."""
    c = {k: v / GIB for k, v in result["categories_bytes"].items()}
    p = (result.get("planner") or {}).get("memory_gib") or {}

    def planned(key: str) -> Optional[float]:
        return p.get(key)

    def at_peak(key: str) -> Optional[float]:  # the planner's figure at its predicted peak
        return (p.get("at_peak") or {}).get(key)

    rows = [("weights (this rank's shards)", c.get("weights", 0.0), planned("weights")),
            ("gradients", c.get("grads", 0.0), at_peak("grads")),
            ("optimizer state", c.get("optimizer", 0.0), at_peak("optimizer")),
            # the tracker files bf16 autocast copies of weights FSDP2 does not gather as activations
            ("activations", c.get("activations", 0.0), at_peak("activations")),
            ("FSDP2 gathered weights", c.get("gathered_weights", 0.0) + c.get("all_gather", 0.0), at_peak("fsdp_gather")),
            ("FSDP2 reduce-scatter", c.get("reduce_scatter", 0.0), at_peak("fsdp_reduce")),
            ("temporaries", c.get("temporaries", 0.0), at_peak("temporaries")),
            ("peak", result["peak_bytes"] / GIB, planned("total"))]
    return rows


def format_dry_run(result: dict) -> str:
    lay = result["layout"]
    lines = [f"dry run of {result['config']}: rank {lay['rank']} of {lay['world_size']} ({lay['nodes']} node(s) x "
             f"{lay['gpus_per_node']}), ep={lay['ep']} edp={lay['edp']}, {lay['experts_per_rank']} expert(s) per MoE "
             f"layer on this rank, {lay['micro_batch']} x {lay['seq_len']} tokens per micro-batch x {lay['grad_accum']}, "
             f"{lay['dtype']}, dense={lay['dense']}, routing {result['routing']}, {result['steps']} steps "
             f"in {result['seconds']:.1f} s",
             f"{'memory at the peak (GiB)':<32}{'dry run':>10}{'planner':>10}{'ratio':>8}"]
    for name, got, want in comparison_rows(result):
        ratio = f"{want / got:.2f}" if want is not None and got > 0 else ""
        lines.append(f"{name:<32}{got:>10.3f}{'' if want is None else f'{want:10.3f}':>10}{ratio:>8}")
    phase = (((result.get("planner") or {}).get("memory_gib") or {}).get("at_peak") or {}).get("phase")
    if phase:
        lines.append(f"the planner's figures are those at its predicted peak: {phase}")
    sp = result["save_plan"]
    lines.append(f"checkpoint: this rank writes {sp['items']} items, {sp['tensor_bytes'] / GIB:.3f} GiB of tensors")
    if "verdict" in result:
        lines.append(result["verdict"]["line"])
    return "\n".join(lines)
