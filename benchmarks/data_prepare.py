"""``moe-dist prepare`` at scale: throughput and peak memory against the bare tokenizer, and the loader.

    .venv/bin/python -m benchmarks.data_prepare --size-mb 1024 [--memory-limit-mb 2048] [--workers 2]
        [--vocab 32000] [--work /tmp/data-bench] [--bare-mb 64] [--keep]

1. **corpus**: ``WORK/corpus-<size>.jsonl``, records of 20 shuffled paragraphs of the default corpus
   (Debian's python3.11-doc), written once and reused (seeded, so every run reads the same bytes);
2. **tokenizer**: a sentencepiece BPE model of ``--vocab`` pieces trained on the default corpus;
3. **bare tokenizer**: the texts of the corpus's first ``--bare-mb`` MiB, parsed beforehand, encoded
   by ``--workers`` processes (one thread each) and, separately, by sentencepiece's own threads in
   one process; the faster is the baseline (characters of text per second), measured before and
   after the prepare, and the two averaged;
4. **prepare**: ``moe-dist prepare`` on the whole corpus with ``--workers``, in a cgroup (v1) whose
   memory limit is ``--memory-limit-mb`` (needs root; without it the run is unlimited and says so);
   peak RSS = the largest sum of the resident sets of the cgroup's processes, sampled every 0.1 s;
5. **loader**: the training sampler over a blend of the prepared dataset with itself at
   ``--seq-len`` / ``--global-batch`` / ``--grad-accum``, one rank of ``--ranks`` (default: the
   OLMoE-1B-7B preset as ``moe-dist plan`` lays it out on 8 GPUs), the files evicted from the page
   cache first and ``--step-s`` of sleep standing for each step's compute: the data phase per step
   and its share of the step, without and with the read-ahead of the next step's windows
   (``--loader-only``: this alone, over a kept ``--keep`` output).

Prints one JSON object per measurement and a summary; the ratio prepare / bare (target >= 0.8)
compares the same text on the same cores.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time

CORPUS = "/usr/share/doc/python3.11/html/_sources"
CGROUP = "/sys/fs/cgroup/memory"


def generate(path: str, size_mb: int, seed: int = 0) -> None:
    """Records of 20 paragraphs of the default corpus in a seeded shuffle, up to ``size_mb`` MiB."""
    if os.path.isfile(path) and os.path.getsize(path) >= size_mb << 20:
        return
    from moe_dist.data import read_documents

    paras = [p for d in read_documents(CORPUS) for p in d.text.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    written, target = 0, size_mb << 20
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps({"id": written, "text": "\n\n".join(rng.sample(paras, 20))}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    os.replace(path + ".tmp", path)


def tokenizer(path: str, vocab: int) -> str:
    if not os.path.isfile(path):
        from moe_dist.data import read_documents, train_tokenizer

        train_tokenizer(lambda: (d.text for d in read_documents(CORPUS)), vocab).save(path)
    return path


def _encode_part(args) -> int:
    tok_path, texts = args
    from moe_dist.data import Tokenizer

    tok = Tokenizer.load(tok_path)
    n = 0
    for i in range(0, len(texts), 64):
        n += sum(len(x) for x in tok.encode_batch(texts[i:i + 64], threads=1))
    return n


def bare(corpus: str, tok_path: str, mb: int, workers: int) -> dict:
    """The tokenizer alone on the first ``mb`` MiB of the corpus's texts (parsed before the clock starts)."""
    texts, size = [], 0
    with open(corpus, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= mb << 20:
                break
    chars = sum(len(t) for t in texts)
    parts = [texts[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers) as pool:
        pool.map(_encode_part, [(tok_path, ["warm up"])] * workers)
        t0 = time.perf_counter()
        tokens = sum(pool.map(_encode_part, [(tok_path, p) for p in parts]))
        procs = time.perf_counter() - t0
    from moe_dist.data import Tokenizer

    tok = Tokenizer.load(tok_path)
    t0 = time.perf_counter()
    threaded = sum(len(x) for x in tok.encode_batch(texts, threads=workers))
    threads = time.perf_counter() - t0
    assert threaded == tokens
    best = min(procs, threads)
    return {"what": "bare tokenizer", "mib": round(size / 2**20, 1), "characters": chars, "tokens": tokens,
            "processes_s": round(procs, 2), "threads_s": round(threads, 2),
            "chars_per_s": round(chars / best), "tokens_per_s": round(tokens / best)}


def _rss_of(pids) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def prepare(corpus: str, tok_path: str, out: str, workers: int, limit_mb: int) -> dict:
    """``moe-dist prepare`` in a memory cgroup; wall time, peak RSS of its processes, the manifest."""
    cg = os.path.join(CGROUP, f"moe-dist-prepare-{os.getpid()}")
    limited = os.access(CGROUP, os.W_OK)
    cmd = [sys.executable, "-m", "moe_dist.cli", "prepare", corpus, "-o", out, "--tokenizer", tok_path,
           "--workers", str(workers), "--memory-mb", str(limit_mb), "--no-progress"]
    if limited:
        os.makedirs(cg, exist_ok=True)
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_mb << 20))
        cmd = ["bash", "-c", f'echo $$ > {cg}/cgroup.procs; exec "$@"', "prepare", *cmd]
    peak, done = [0], threading.Event()

    def sample(root_pid: int) -> None:
        while not done.is_set():
            if limited:
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
            else:
                pids = [root_pid]
            peak[0] = max(peak[0], _rss_of(pids))
            time.sleep(0.1)

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = threading.Thread(target=sample, args=(proc.pid,), daemon=True)
    watcher.start()
    output = proc.communicate()[0]
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    usage = None
    if limited:
        with open(os.path.join(cg, "memory.max_usage_in_bytes")) as f:
            usage = int(f.read())
        os.rmdir(cg)
    if proc.returncode:
        return {"what": "prepare", "exit": proc.returncode, "output": output[-2000:]}
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    return {"what": "prepare", "exit": 0, "limit_mib": limit_mb if limited else None, "wall_s": round(wall, 1),
            "peak_rss_mib": round(peak[0] / 2**20), "cgroup_max_usage_mib": usage and round(usage / 2**20),
            "mib": round(m["source"]["bytes"] / 2**20, 1), "characters": m["characters"], "tokens": m["token_count"],
            "documents": m["documents"], "shards": len(m["shards"]), "chars_per_s": round(m["characters"] / wall),
            "mib_per_s": round(m["source"]["bytes"] / 2**20 / wall, 2), "summary": output.strip().splitlines()[-1]}


def _evict(sources) -> None:
    """Drop the datasets' files from the page cache (``POSIX_FADV_DONTNEED``): the next reads go to disk."""
    for src in sources:
        for arr, _, _ in src.train.parts:
            fd = os.open(arr.filename, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def loader(out: str, seq_len: int, global_batch: int, grad_accum: int, ranks: int, steps: int, step_s: float) -> list:
    """The data phase of rank 0 of ``ranks`` over a blend of the prepared dataset with itself (weights 0.7 /
    0.3: the blend's bookkeeping is timed too), its files evicted from the page cache first, with ``step_s``
    of sleep standing for each step's compute: without and with the read-ahead of the next step's windows."""
    from moe_dist.data import TrainSampler, open_blend

    rows = []
    for read_ahead in (False, True):
        sources, _ = open_blend(f"0.7 {out} 0.3 {out}")
        s = TrainSampler([x.train for x in sources], seq_len, global_batch, grad_accum, 0, ranks, seed=0,
                         weights=[x.weight for x in sources])
        _evict(sources)
        spent, seqs = 0.0, 0
        for _ in range(steps):
            t0 = time.perf_counter()
            seqs += sum(b.shape[0] for b in s.next_step())
            if read_ahead:
                s.prefetch()
            spent += time.perf_counter() - t0
            time.sleep(step_s)
        rows.append({"what": "loader", "read_ahead": read_ahead, "seq_len": seq_len, "global_batch": global_batch,
                     "grad_accum": grad_accum, "ranks": ranks, "steps": steps, "step_s": step_s,
                     "data_ms_per_step": round(1000 * spent / steps, 3),
                     "share_of_step": round(spent / steps / (step_s + spent / steps), 5),
                     "tokens_per_s_per_rank": round(seqs * seq_len / spent)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--memory-limit-mb", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bare-mb", type=int, default=64)
    p.add_argument("--work", default="/tmp/data-bench")
    # the loader at the OLMoE-1B-7B preset's planned layout on 1 node x 8 GPUs (moe-dist plan): 4 micro-batches
    # of 1 x 4096 tokens per GPU per step
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.37, help="the compute between two steps (the preset's planned step)")
    p.add_argument("--loader-steps", type=int, default=50)
    p.add_argument("--loader-only", action="store_true", help="only the loader, over WORK/prepared-<size> (--keep)")
    p.add_argument("--keep", action="store_true", help="keep the prepared output (the corpus is always kept)")
    args = p.parse_args(argv)
    import shutil

    import torch

    os.makedirs(args.work, exist_ok=True)
    print(json.dumps({"cpu": torch.backends.cpu.get_cpu_capability(), "cores": len(os.sched_getaffinity(0))}), flush=True)
    out = os.path.join(args.work, f"prepared-{args.size_mb}")
    if args.loader_only:
        for row in loader(out, args.seq_len, args.global_batch, args.grad_accum, args.ranks, args.loader_steps, args.step_s):
            print(json.dumps(row), flush=True)
        return 0
    corpus = os.path.join(args.work, f"corpus-{args.size_mb}.jsonl")
    generate(corpus, args.size_mb)
    tok = tokenizer(os.path.join(args.work, f"bpe-{args.vocab}.model"), args.vocab)
    b = bare(corpus, tok, args.bare_mb, args.workers)
    print(json.dumps(b), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    r = prepare(corpus, tok, out, args.workers, args.memory_limit_mb)
    print(json.dumps(r), flush=True)
    if r["exit"]:
        return 1
    after = bare(corpus, tok, args.bare_mb, args.workers)  # again: a shared machine's load moves during a long run
    print(json.dumps(after), flush=True)
    b = {**b, "chars_per_s": (b["chars_per_s"] + after["chars_per_s"]) / 2}
    for row in loader(out, args.seq_len, args.global_batch, args.grad_accum, args.ranks, args.loader_steps, args.step_s):
        print(json.dumps(row), flush=True)
    print(f"prepare / bare tokenizer: {r['chars_per_s'] / b['chars_per_s']:.2f}x (characters per second, bare: the mean "
          f"of before and after, "
          f"{args.workers} workers); peak RSS {r['peak_rss_mib']} MiB under a {args.memory_limit_mb} MiB limit")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
