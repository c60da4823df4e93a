"""Model FLOPs utilisation: the model's training FLOPs per second on a rank over the rate the rank
could reach.

The FLOPs are the model's (:func:`moe_dist.model.params.train_flops_per_token`: forward and
backward of every matmul a token passes, each MoE layer's k experts, causal attention), not the
run's: a recomputed forward is not counted, as torchtitan and Megatron-Core count them. The peak
is, on a GPU, the datasheet's dense bf16 rate of the device (:data:`moe_dist.hardware.DATASHEET_BF16_TFLOPS`,
none for fp32 training or an unknown device) and, on a CPU, a matmul of the training dtype timed on
this rank with its threads, while the other ranks of the machine time theirs (the same
competition for cores and memory as in training), the best rank's rate for all.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ...hardware import datasheet_tflops, matmul_peak
from ...model.params import train_flops_per_token

CPU_PEAK_N = 1024  # the square matmul timed for a CPU peak
CPU_PEAK_S = 1.0  # seconds of repeats; the best one counts, and the best rank's


class Utilisation:
    """MFU of a run: ``model_cfg`` with its vocabulary resolved, ``seq_len`` tokens per sequence,
    ``world_size`` ranks sharing the step's tokens. The peak is found at the first :meth:`of`."""

    def __init__(self, model_cfg, vocab_size: int, seq_len: int, device: torch.device, dtype: str, world_size: int):
        self.flops_per_token = train_flops_per_token(dataclasses.replace(model_cfg, vocab_size=vocab_size), seq_len)
        self.device, self.dtype, self.world_size = device, dtype, world_size
        self._peak: Optional[float] = None
        self.peak_source = ""

    def peak(self) -> Optional[float]:
        """FLOP/s one rank could reach (None: unknown, with :attr:`peak_source` saying why)."""
        if self._peak is None and not self.peak_source:
            self._peak, self.peak_source = self._find_peak()
        return self._peak

    def _find_peak(self) -> tuple[Optional[float], str]:
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            tflops = datasheet_tflops(name) if self.dtype == "bf16" else None
            if tflops is None:
                return None, f"no datasheet {self.dtype} rate for {name}"
            return tflops * 1e12, f"datasheet bf16 of {name}"
        dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        flops = matmul_peak(dtype, None, CPU_PEAK_N, CPU_PEAK_S)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # a rank disturbed while it timed (another process on its cores) must not lower the peak;
            # every rank takes the best rank's, so they all report the same MFU
            best = torch.tensor([flops], dtype=torch.float64)
            dist.all_reduce(best, op=dist.ReduceOp.MAX)
            flops = float(best.item())
        return flops, (f"{self.dtype} {CPU_PEAK_N}^3 matmul measured on {torch.get_num_threads()} thread(s), CPU "
                       f"capability {torch.backends.cpu.get_cpu_capability()}")

    @property
    def peak_known(self) -> bool:
        """Whether the peak has been looked for (:meth:`peak` ran)."""
        return self._peak is not None or bool(self.peak_source)

    def achieved(self, tokens_per_s: float) -> float:
        """Model FLOP/s of one rank at ``tokens_per_s`` tokens per second for the whole job."""
        return tokens_per_s * self.flops_per_token / self.world_size

    def of(self, tokens_per_s: float) -> Optional[float]:
        """MFU at ``tokens_per_s`` (None when the peak is unknown)."""
        peak = self.peak()
        return self.achieved(tokens_per_s) / peak if peak else None
