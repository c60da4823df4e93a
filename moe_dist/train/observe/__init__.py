"""What a run tells about itself: the metrics row of each step (:mod:`~moe_dist.train.observe.row`:
tokens/s, the time split, MFU, the MoE figures), metrics.jsonl and TensorBoard, W&B, the run's
report and plots, where a step's time goes and the model FLOPs utilisation."""
