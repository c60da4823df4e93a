"""The choices made by timing the machine, one module each, with one timing helper (:mod:`.timing`):
:mod:`.expert_kernel` (``model.moe.expert_kernel: auto``), :mod:`.attention`
(``train.attention_dtype: auto``), :mod:`.bf16` (``train.dtype=bf16`` on a CPU with slow bf16
matmuls). The things they time (experts, attention layers) say what they offer through the small
bases defined here (:class:`~.expert_kernel.TunedExperts`, :class:`~.attention.TimedAttention`), so
this package sits below the model and the MoE layer. Nothing is imported here."""
