"""The typed configuration schema: one dataclass per section, defaults, bounds and help.

Every field is declared with :func:`knob` (default, help text, optional bounds). Types come
from the annotations: ``int``, ``float``, ``bool``, ``str``, ``Optional[...]``,
``Literal[...]`` (the allowed values), ``list[int]``, ``dict`` and nested sections.
Loading and checking live in :mod:`moe_dist.config.load`; cross-field rules are each
section's ``check()`` (they raise :class:`ConfigError` naming the key and what is allowed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from ..checks import check_choice, knob
from ..errors import ConfigError
from ..moe.args import MoEArgs
from .batch import batch_problems
from .layout import AUTO, check_ep, expert_parallel_size

DEFAULT_CORPUS = "/usr/share/doc/python3.11/html/_sources"
# upper bounds of the model's sizes: far above any published model, low enough that a value typed or
# planted by mistake is refused here instead of an allocation failing later
MAX_VOCAB, MAX_WIDTH, MAX_COUNT = 1 << 24, 1 << 20, 1 << 16
MOE_LAYER_PATTERNS = ("every", "every_other")


def section(cls) -> Any:
    return field(default_factory=cls, metadata={"help": cls.__doc__.strip().splitlines()[0]})


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


@dataclass
class RunConfig:
    """Where a run writes and how it reports."""

    dir: str = knob("runs/default", "run directory (config.yaml, metrics.jsonl, checkpoints/, plots/, tb/)")
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "auto = cuda when available, else cpu")
    threads: Optional[int] = knob(None, "torch intra-op threads per process (null = OMP_NUM_THREADS if set, else "
                                  "cores / local processes)", min=1)
    progress: Union[Literal["auto"], bool] = knob("auto", "progress bar on rank 0: true, false or auto (= only on a terminal)")
    log_every: int = knob(1, "steps between metrics.jsonl rows", min=1)
    print_every: int = knob(10, "steps between log lines when there is no progress bar", min=1)
    tensorboard: bool = knob(True, "write TensorBoard events to run.dir/tb")
    plots: bool = knob(True, "write PNG plots to run.dir/plots at the end")
    time_every: int = knob(20, "steps between profiled steps, whose time is split into compute, expert all-to-alls, "
                           "FSDP weight gathers, gradient reductions, other collectives and the optimizer (metrics.jsonl "
                           "time, TensorBoard time/, summary.json; with model FLOPs utilisation); 0 = never", min=0)
    time_traces: int = knob(0, "profiled steps (the first N of the run) whose profile each rank writes as a Chrome "
                            "trace to run.dir/traces/ (chrome://tracing, ui.perfetto.dev); 0 = none", min=0)

    def check(self) -> None:
        if not self.dir:
            _fail("run.dir", "must be a non-empty path")


@dataclass
class _MoEBlocks:
    """The MoE section's first key (a base class, so written configs keep it first)."""

    layers: Union[Literal["every", "every_other"], list[int]] = knob(
        "every", "MoE blocks: every, every_other (blocks 1, 3, 5, ...) or a list of block indices")


@dataclass
class MoEConfig(MoEArgs, _MoEBlocks):
    """Which feed-forward layers are Mixture-of-Experts layers, and how they route.

    The layer's own keys are :class:`~moe_dist.moe.args.MoEArgs` (declared and checked there);
    a block hands this section whole to its layer. The keys' order: ``layers``, the layer's keys,
    ``granularity``."""

    granularity: int = knob(1, "moe-dist upcycle / plan of a dense checkpoint: split each dense FFN into G experts "
                            "(num_experts and top_k given per dense copy are multiplied by G, d_ff = model.d_ff / G); "
                            "the written config holds the expanded values and granularity 1", min=1)

    def check(self, n_layers: int) -> None:
        self.validated()  # the MoE layer's rules, the same it runs when built
        if self.granularity != 1:
            _fail("model.moe.granularity", f"{self.granularity}: read only by `moe-dist upcycle` and `moe-dist plan` of a "
                  "dense checkpoint (a model config gives the expanded num_experts, top_k and d_ff); allowed here: 1")
        if isinstance(self.layers, list):
            if not self.layers:
                _fail("model.moe.layers", "an empty list; allowed: every, every_other or a non-empty list of block indices")
            bad = [i for i in self.layers if not 0 <= i < n_layers]
            if bad:
                _fail("model.moe.layers", f"block indices {bad} out of range; allowed: 0..{n_layers - 1} (model.n_layers={n_layers})")
            if len(set(self.layers)) != len(self.layers):
                _fail("model.moe.layers", f"repeated block indices in {self.layers}")

    def layer_indices(self, n_layers: int) -> list[int]:
        """The blocks whose feed-forward layer is an MoE layer."""
        if self.layers == "every":
            return list(range(n_layers))
        if self.layers == "every_other":
            return list(range(1, n_layers, 2))
        return sorted(self.layers)


ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                     "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")}


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _check_rope_scaling(scaling: dict, head_dim: int) -> None:
    kind = scaling.get("type")
    check_choice("model.rope_scaling.type", kind, ROPE_SCALING_KEYS)
    keys = ROPE_SCALING_KEYS[kind]
    unknown = sorted(set(scaling) - set(keys) - {"type"})
    if unknown:
        _fail("model.rope_scaling", f"unknown key(s) {unknown} for type {kind!r}; allowed: {['type', *keys]}")
    for key in keys:
        value = scaling.get(key)
        if key.endswith("_factor") and kind == "longrope" and key != "attention_factor":
            if not (isinstance(value, list) and len(value) == head_dim // 2 and all(map(_positive, value))):
                _fail(f"model.rope_scaling.{key}", f"allowed: a list of {head_dim // 2} numbers > 0 (head size / 2)")
        elif not _positive(value):
            _fail(f"model.rope_scaling.{key}", f"got {value!r}; allowed: a number > 0 (required for type {kind!r})")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        _fail("model.rope_scaling.high_freq_factor", f"{scaling['high_freq_factor']} must exceed "
              f"low_freq_factor={scaling['low_freq_factor']}")


@dataclass
class ModelConfig:
    """Decoder-only language model."""

    vocab_size: Optional[int] = knob(None, "vocabulary size (null = the tokenizer's)", min=2, max=MAX_VOCAB)
    d_model: int = knob(256, "hidden size", min=1, max=MAX_WIDTH)
    n_layers: int = knob(4, "transformer blocks", min=1, max=MAX_COUNT)
    n_heads: int = knob(8, "query heads", min=1, max=MAX_COUNT)
    n_kv_heads: Optional[int] = knob(None, "key/value heads for grouped-query attention (null = n_heads)", min=1,
                                     max=MAX_COUNT)
    d_ff: int = knob(768, "hidden size of a dense SwiGLU feed-forward layer", min=1, max=MAX_WIDTH)
    rope_theta: float = knob(10000.0, "rotary embedding base", gt=0)
    rope_scaling: Optional[dict] = knob(None, "RoPE frequency scaling of long-context checkpoints: null, {type: linear, "
                                        "factor: F} or {type: llama3, factor, low_freq_factor, high_freq_factor, "
                                        "original_max_position_embeddings} (Llama 3.1+) or {type: longrope, short_factor, "
                                        "long_factor, original_max_position_embeddings, attention_factor} (Phi-3.5)")
    norm_eps: float = knob(1e-5, "RMSNorm epsilon", gt=0)
    tie_embeddings: bool = knob(True, "share the input embedding and the output projection")
    qkv_bias: bool = knob(False, "biases on the query, key and value projections (Qwen2 checkpoints have them)")
    qk_norm: Literal["none", "projection"] = knob("none", "RMSNorm of the queries and keys before RoPE: none, or "
                                                  "projection = over each whole projection, all heads (OLMoE)")
    init_std: float = knob(0.02, "std of the weight initialisation", gt=0)
    moe: MoEConfig = section(MoEConfig)

    def check(self) -> None:
        if self.d_model % self.n_heads:
            _fail("model.n_heads", f"{self.n_heads} must divide model.d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            _fail("model.n_heads", f"head size model.d_model / model.n_heads = {self.d_model // self.n_heads} must be even (rotary embeddings)")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            _fail("model.n_kv_heads", f"{kv} must divide model.n_heads={self.n_heads}")
        if self.rope_scaling:
            _check_rope_scaling(self.rope_scaling, self.d_model // self.n_heads)
        self.moe.check(self.n_layers)


@dataclass
class ParallelConfig:
    """How the model is spread over processes."""

    ep: Union[int, Literal["auto"]] = knob(1, "expert-parallel size: divides the world size and model.moe.num_experts; "
                                           "auto: the largest such size whose expert groups each stay on one node "
                                           "(docs/lost-node.md)", min=1)
    dense: Literal["fsdp", "replicate"] = knob("fsdp", "dense weights: FSDP2 over data-parallel ranks, or replicated")
    reshard_after_forward: bool = knob(True, "FSDP2: free gathered dense weights after forward (ZeRO-3) or keep them (ZeRO-2)")
    expert_shard: Literal["auto", "experts", "within"] = knob(
        "auto", "FSDP2 split of each expert weight over its replicas (edp ranks): experts (on the expert dimension, "
        "whole experts per replica), within (inside every expert, on the first of its dimensions edp divides), auto "
        "(experts when edp divides the local experts, else within; docs/scale.md)")
    grad_sync: Literal["step", "microbatch"] = knob(
        "step", "FSDP2 with train.grad_accum > 1: reduce-scatter the gradients once per step, keeping every unit's "
        "unsharded gradient between micro-batches (less traffic), or after every micro-batch into the sharded "
        "gradient (less memory, grad_accum times the reduce-scatters)")
    backend: Literal["auto", "gloo", "nccl"] = knob("auto", "process-group backend (auto = nccl with CUDA, else gloo)")
    timeout_s: int = knob(600, "collective timeout in seconds", min=1)
    heartbeat_timeout_s: int = knob(30, "end every rank when a rank's heartbeat through the rendezvous store is "
                                        "missing this long, in seconds (0: no heartbeat)", min=0)
    ranks_per_node: Optional[int] = knob(None, "nodes as blocks of this many consecutive ranks (null = the ranks' host "
                                         "names); what node-aware dispatch and its byte counts call a node", min=1)
    dispatch: Literal["flat", "hierarchical"] = knob("flat", "how routed tokens reach the expert-parallel ranks: flat "
                                                     "(one row per token-expert pair), or hierarchical (one row per token "
                                                     "and remote node, fanned out there; docs/dispatch.md)")


@dataclass
class DataConfig:
    """Corpus, tokenizer and token cache, or prepared datasets to blend."""

    paths: Union[str, list[str], None] = knob(None, "prepared datasets to train on instead of data.corpus: directories "
                                              "written by `moe-dist prepare` or Megatron indexed prefixes (PATH.bin + "
                                              "PATH.idx), with weights: '0.7 A 0.3 B' or a list of 'A' / '0.7 A' "
                                              "items (docs/data.md)")
    valid_paths: Union[str, list[str], None] = knob(None, "with data.paths: validation data of the same forms (null = "
                                                    "each dataset's held-out documents)")
    corpus: str = knob(DEFAULT_CORPUS, "a text / JSON-lines file or a directory of them "
                       "(default: Python 3.11 docs sources from Debian's python3.11-doc, PSF licence)")
    format: Literal["auto", "text", "jsonl"] = knob("auto", "auto = by extension (.jsonl/.json lines, else text)")
    pattern: Optional[str] = knob(None, "glob relative to a corpus directory (e.g. **/*.txt; null = every file below "
                                 "it ending in .txt, .rst, .md, .text, .jsonl or .json)")
    jsonl_field: str = knob("text", "field holding the text in JSON-lines records")
    cache_dir: str = knob("data_cache", "tokenizer and token files, keyed by corpus + tokenizer settings")
    tokenizer: Optional[str] = knob(None, "an existing sentencepiece tokenizer.model or Hugging Face tokenizer.json "
                                    "(null = train one)")
    vocab_size: int = knob(4096, "vocabulary size of a trained tokenizer (byte fallback needs > 256)", min=300)
    tokenizer_type: Literal["bpe", "unigram"] = knob("bpe", "sentencepiece model type")
    tokenizer_max_chars: int = knob(4_000_000, "at most this many characters train the tokenizer", min=1000)
    val_fraction: float = knob(0.05, "fraction of documents held out for validation (chosen by a hash of their name; "
                               "for a Megatron prefix in data.paths, of their index)", gt=0, max=0.5)
    prepare_workers: int = knob(0, "tokenizer processes that prepare data.corpus (0 = in this process below 64 MiB of "
                                "corpus, else one per core)", min=0)
    prepare_memory_mb: int = knob(2048, "memory the preparation of data.corpus may use, in MiB (it streams)", min=64)

    def check(self) -> None:
        if not self.corpus:
            _fail("data.corpus", "must be a path to a file or directory")


@dataclass
class TrainConfig:
    """Optimisation."""

    steps: int = knob(100, "optimizer steps", min=1, max=1 << 40)
    global_batch: int = knob(16, "sequences per optimizer step, whatever the number of ranks", min=1, max=1 << 30)
    grad_accum: int = knob(1, "micro-batches per step (global_batch / grad_accum sequences per forward, over all ranks)", min=1)
    seq_len: int = knob(256, "tokens per sequence", min=2, max=1 << 24)
    seed: int = knob(0, "seed of the model initialisation and the data order", min=0)
    lr: float = knob(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = knob(0.1, "final learning rate / peak after the cosine decay", min=0, max=1)
    warmup_steps: int = knob(10, "linear warm-up steps (capped at train.steps)", min=0)
    weight_decay: float = knob(0.1, "AdamW weight decay (matrices only)", min=0)
    beta1: float = knob(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = knob(0.95, "AdamW beta2", min=0, max=1)
    grad_clip: Optional[float] = knob(1.0, "clip the global gradient norm to this (null = no clipping)", gt=0)
    dtype: Literal["fp32", "bf16"] = knob("fp32", "bf16 = autocast matmuls to bfloat16 (fp32 master weights; FSDP2 gathers "
                                                 "bf16 copies and reduces gradients in fp32; router math stays fp32)")
    attention_dtype: Literal["auto", "bf16", "fp32"] = knob("auto", "train.dtype=bf16: the dtype attention's fused "
                                                          "kernel runs in: bf16, fp32 (on fp32 copies of the bf16 "
                                                          "queries, keys and values) or auto (the faster of the two at "
                                                          "a micro-batch's shape, timed on every rank before the first "
                                                          "step; moe_dist/tuning/attention.py)")
    bf16_on_slow_cpu: Literal["fp32", "bf16"] = knob("fp32", "train.dtype=bf16 on a CPU whose bf16 matmuls of the "
                                                     "model's size time 1.5x or more fp32's (moe_dist/tuning/bf16.py): "
                                                     "fp32 runs it as fp32 (said at start-up), bf16 keeps bf16")
    activation_checkpointing: bool = knob(False, "recompute each block in backward (non-reentrant)")
    compile: bool = knob(False, "torch.compile (inductor) each transformer block: a dense block whole; an MoE block's "
                         "norms, attention, router and shared expert, its dispatch / exchange / expert kernel left "
                         "eager (docs/performance.md; off by default: the speed-up is small where GEMMs and attention take most of "
                         "a step, and every cold start compiles first; measured figures in benchmarks/results/compile.md)")
    compile_cache_dir: Optional[str] = knob(None, "train.compile: inductor's cache directory (compiled kernels, FX "
                                            "graph and AOTAutograd caches), reused by restarts and requeues; null = "
                                            "run.dir/compile_cache")
    max_nonfinite_steps: int = knob(5, "the run has diverged after this many bad steps within train.bad_step_window "
                                    "steps (a non-finite loss, gradient norm or router logits, or a loss spike, each "
                                    "skipped: not applied; a gradient-norm spike or a collapse, applied; all marked in "
                                    "metrics.jsonl); see train.on_divergence", min=1)
    bad_step_window: int = knob(20, "the steps over which bad steps add up toward train.max_nonfinite_steps (they "
                                "need not be consecutive); at least train.max_nonfinite_steps", min=1)
    spike_factor: Optional[float] = knob(None, "a step whose finite loss exceeds this factor x the median loss of the "
                                         "last train.spike_window healthy steps is a bad step too: skipped and counted "
                                         "like a non-finite one (null = only non-finite steps are bad)", gt=1)
    spike_window: int = knob(20, "healthy steps whose median loss (and gradient norm) train.spike_factor (and "
                             "train.grad_spike_factor, train.detect_collapse) compare with; the loss spike check starts "
                             "once this many are seen, the others after 3", min=1)
    grad_spike_factor: Optional[float] = knob(10.0, "a step whose gradient norm exceeds this factor x the median of the "
                                              "last train.spike_window healthy steps' is a bad step (its update, "
                                              "clipped to train.grad_clip, is applied; it counts toward a divergence); "
                                              "null = off", gt=1)
    detect_collapse: bool = knob(True, "a step whose loss is back at ln(vocab) (a uniform guess) after the median of "
                                 "the last train.spike_window healthy losses was below 0.9 ln(vocab), and not falling "
                                 "(more than 1% below the step before's), or whose gradient norm is exactly 0 after "
                                 "non-zero ones, is a bad step (applied; counted)")
    on_divergence: Literal["stop", "rollback"] = knob("stop", "after train.max_nonfinite_steps bad steps (within "
                                                      "train.bad_step_window): stop "
                                                      "(exit 1; resume=auto continues from the last checkpoint before "
                                                      "the divergence), or rollback = do that resume in the same job")
    max_rollbacks: int = knob(3, "train.on_divergence=rollback: at most this many rollbacks per run, then stop", min=1)
    skip_divergent_batches: bool = knob(False, "resume=auto after a divergence (either way): skip the batches from the "
                                        "resumed checkpoint's step to the first bad step instead of training on them again")
    engine: Literal["native", "deepspeed"] = knob("native", "who reduces gradients and steps the optimizer: native "
                                                   "(parallel.dense) or deepspeed (ZeRO-1/2, deepspeed.* keys; needs "
                                                   "the deepspeed extra)")

    def check(self) -> None:
        if self.global_batch % self.grad_accum:
            _fail("train.grad_accum", f"{self.grad_accum} must divide train.global_batch={self.global_batch}")
        if self.bad_step_window < self.max_nonfinite_steps:
            _fail("train.bad_step_window", f"{self.bad_step_window} must be at least train.max_nonfinite_steps="
                  f"{self.max_nonfinite_steps}")


@dataclass
class EvalConfig:
    """Validation during and after training."""

    every: int = knob(0, "steps between validations (0 = only at the end)", min=0)
    max_sequences: int = knob(256, "validation sequences (of train.seq_len) evaluated, at most", min=1)
    batch: int = knob(16, "validation sequences per forward, over all ranks", min=1)
    probe_every: int = knob(10, "steps between routing-fluctuation probes (one forward of the first validation "
                            "batch, compared with the previous probe; 0 = at validations only)", min=0)


@dataclass
class CkptConfig:
    """Checkpoints (torch.distributed.checkpoint, experts keyed by global index)."""

    every: int = knob(0, "steps between checkpoints (0 = only at the end)", min=0)
    memory_every: int = knob(1, "steps between in-memory snapshots: every rank's shard kept in its node's host memory "
                             "(/dev/shm) and on a buddy node, so a lost node costs the steps since the last one "
                             "(0 = none; switched off by itself where host memory is full; docs/snapshots.md)", min=0)
    keep: int = knob(0, "complete checkpoints kept in run.dir/checkpoints, newest first (0 = all); older ones are "
                     "deleted only after a newer one is complete", min=0)
    save_final: bool = knob(True, "save a checkpoint after the last step")
    async_save: bool = knob(False, "copy the state to CPU memory and write it in a background thread while training "
                            "continues (one save in flight at a time)")
    verify: bool = knob(True, "check every checkpoint file's SHA-256 against the manifest before loading "
                        "(sizes are always checked)")
    init_from: Optional[str] = knob(None, "start from these model weights: a `moe-dist upcycle` output directory "
                                    "(model.safetensors, experts by global index); null = random initialisation")


@dataclass
class DeepSpeedConfig:
    """DeepSpeed settings, used with train.engine=deepspeed."""

    config: Optional[str] = knob(None, "a DeepSpeed JSON config (ZeRO settings, gradient_clipping, optimizer, ...); "
                                 "batch sizes and accumulation come from train.*")
    zero_stage: Optional[Literal[1, 2]] = knob(None, "ZeRO stage; null = the JSON's zero_optimization.stage, else 2")


@dataclass
class LogConfig:
    """Experiment tracking beside metrics.jsonl and TensorBoard (Weights & Biases; needs the wandb extra)."""

    wandb: bool = knob(False, "log every metrics.jsonl row, the expert load, routing fluctuation, expert bias, the "
                       "config and the end-of-run summary to Weights & Biases from rank 0 (the run id is kept in "
                       "run.dir/wandb_run.json: a resumed or requeued run continues the same W&B run)")
    wandb_project: str = knob("moe_dist", "W&B project")
    wandb_entity: Optional[str] = knob(None, "W&B entity (user or team; null = the account's default)")
    wandb_name: Optional[str] = knob(None, "W&B run name (null = the name of run.dir)")
    wandb_tags: list[str] = knob([], "W&B run tags")
    wandb_mode: Optional[Literal["online", "offline"]] = knob(None, "online, or offline (written under "
                                                              "run.dir/wandb for `wandb sync`); null = the "
                                                              "WANDB_MODE environment variable, else online")

    def check(self) -> None:
        if self.wandb and not self.wandb_project:
            _fail("log.wandb_project", "empty; allowed: a W&B project name")


@dataclass
class Config:
    """A whole moe_dist run."""

    run: RunConfig = section(RunConfig)
    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    data: DataConfig = section(DataConfig)
    train: TrainConfig = section(TrainConfig)
    eval: EvalConfig = section(EvalConfig)
    ckpt: CkptConfig = section(CkptConfig)
    deepspeed: DeepSpeedConfig = section(DeepSpeedConfig)
    log: LogConfig = section(LogConfig)
    resume: str = knob("none", "continue training from a checkpoint: auto (the latest complete one in "
                       "run.dir/checkpoints; step 0 if there is none), a checkpoint directory, a run directory "
                       "(its latest), or none")

    def check(self) -> None:
        """Cross-field rules that do not depend on the number of processes."""
        if not self.resume:
            _fail("resume", "empty; allowed: auto, none, a checkpoint directory or a run directory")
        self.run.check()
        self.model.check()
        self.data.check()
        self.train.check()
        self.log.check()
        if self.parallel.ep != AUTO:
            check_ep(self.parallel.ep, self.model.moe.num_experts)

    def expert_parallel_size(self, hosts: Sequence[str]) -> int:
        """``parallel.ep`` of a job whose rank r runs on host ``hosts[r]`` (moe_dist/config/layout.py)."""
        return expert_parallel_size(self.parallel.ep, self.model.moe.num_experts, hosts)

    def check_world(self, world_size: int) -> None:
        """Rules that depend on the number of processes (checked once it is known)."""
        if self.parallel.ep != AUTO:
            check_ep(self.parallel.ep, self.model.moe.num_experts, world_size)
        rpn = self.parallel.ranks_per_node
        if rpn is not None and (rpn < 1 or world_size % rpn):
            _fail("parallel.ranks_per_node", f"{rpn} must be >= 1 and divide the number of processes ({world_size}), "
                  "or null (nodes by host name)")
        for key, why in batch_problems(self.train.global_batch, self.train.grad_accum, self.eval.batch, world_size):
            _fail(key, why)
