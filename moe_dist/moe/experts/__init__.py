"""The experts: compute only. :mod:`.grouped`: :class:`GroupedExperts` (one weight tensor per
projection, three kernels); :mod:`.loop_kernel`: the ``loop`` kernel's spans, which the dispatcher's
overlapped exchange (:mod:`moe_dist.moe.dispatch.exchange`) also runs. No exchange happens here."""
from .grouped import ACTIVATIONS, KERNELS, GroupedExperts

__all__ = ["GroupedExperts", "ACTIVATIONS", "KERNELS"]
