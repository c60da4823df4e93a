"""moe_dist: expert-parallel Mixture-of-Experts training for PyTorch."""
__version__ = "0.1.0"
