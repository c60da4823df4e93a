"""Shared pieces of the tests, not tests themselves: a gloo multi-process harness, layer and router
cases, the Megatron CPU shim, Hugging Face fixtures, host-sync and collective counters, checkpoint
payloads and the divergence script. Test modules import them as ``helpers.<module>``."""
