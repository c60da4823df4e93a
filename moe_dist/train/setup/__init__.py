"""Setting a run up: the runtime (process group, device, threads), the model on the meta device and
its weights, the data, the checks before a launch and the run directory's lock."""
