"""Training reads prepared datasets and blends them: weights as asked, the same global batches at
any rank count, the data position in the checkpoint (exact resume, reshard 2 -> 1), epochs of a
small source said, Megatron prefixes (megatron-core's own builder) usable as they are."""
import json
import os
import random

import numpy as np
import pytest
import torch

from helpers.dist_harness import run_ranks
from moe_dist.config import load_config
from moe_dist.data import (IndexedFile, PrepareSettings, TokenStream, Tokenizer, TrainSampler, eval_batches,
                           open_blend, parse_blend, read_documents, run_prepare, train_tokenizer)
from moe_dist.data.datasets import _hash_fraction
from moe_dist.train.checkpoint import step_dir

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "data", "python-docs")
STEPS, AT = 4, 2


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """Two prepared datasets (the corpus's faq and tutorial halves) and their tokenizer."""
    root = tmp_path_factory.mktemp("blend")
    tok = str(root / "tokenizer.model")
    train_tokenizer([d.text for d in read_documents(CORPUS)], 512).save(tok)
    for name in ("faq", "tutorial"):
        run_prepare(PrepareSettings(inputs=[os.path.join(CORPUS, name)], output=str(root / name), tokenizer=tok,
                                    val_fraction=0.2, workers=1, progress=False), log=lambda _: None)
    return root


def test_blend_forms():
    assert parse_blend("0.7 A 0.3 B") == [(0.7, "A"), (0.3, "B")]
    assert parse_blend(["3 A", "B"]) == [(0.75, "A"), (0.25, "B")]
    assert parse_blend("A") == [(1.0, "A")]
    with pytest.raises(ValueError, match=r"'x' is not a weight"):
        parse_blend("x A 0.3 B")
    with pytest.raises(ValueError, match=r"weight -1 of B; allowed: a number > 0"):
        parse_blend("1 A -1 B")


def streams(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [TokenStream.of(rng.integers(0, 500, n).astype(np.uint16)) for n in sizes]


def test_blend_proportions_and_epochs():
    a, b = streams([40_000, 3_000])
    s = TrainSampler([a, b], 16, 100, 1, 0, 1, seed=1, weights=[0.7, 0.3], names=["A", "B"])
    rows = np.concatenate([s.next_step()[0] for _ in range(100)])  # 10,000 windows
    assert abs(s.counts[0] / 10_000 - 0.7) < 0.01 and abs(s.counts[1] / 10_000 - 0.3) < 0.01
    assert abs(s.counts[0] - 7000) <= 1  # the greedy schedule is exact to one window
    # each row is a window of the source the schedule chose
    a_arr, b_arr = a.array(), b.array()
    chosen = TrainSampler([a, b], 16, 100, 1, 0, 1, seed=1, weights=[0.7, 0.3])._assign(200)
    for row, (d, _) in zip(rows[:200], chosen):
        arr = a_arr if d == 0 else b_arr
        start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(arr, 17)[::16] == row, axis=1))[0]) * 16
        assert np.array_equal(arr[start:start + 17], row)
    # B (187 windows) repeats 16 times, A (2,499) twice: counted, and said at epochs 2, 3, 5, 9, 17
    notes = s.pop_notes()
    assert [n.split(" of its")[0] for n in notes if n.startswith("data: B")] == [
        f"data: B repeats: epoch {e}" for e in (2, 3, 5, 9, 17)]
    assert [n.split(" of its")[0] for n in notes if n.startswith("data: A")] == [
        f"data: A repeats: epoch {e}" for e in (2, 3)]
    assert notes[0] == "data: B repeats: epoch 2 of its 187 windows begins at window 625" and s.pop_notes() == []
    assert s.epochs()[1] == pytest.approx(3000 / 187) and s.epoch == s.epochs()[1]


def test_blend_is_layout_independent_and_resumes_across_rank_counts():
    srcs = streams([5_000, 2_000, 900])
    w = [0.5, 0.3, 0.2]

    def run(ranks, steps, start=None):
        samplers = [TrainSampler(srcs, 8, 12, 3, r, ranks, seed=4, weights=w) for r in range(ranks)]
        if start is not None:
            for smp in samplers:
                smp.load_state_dict(json.loads(json.dumps(start)))
        out = []
        for _ in range(steps):
            per = [smp.next_step() for smp in samplers]
            out.append([np.concatenate([per[r][m] for r in range(ranks)]) for m in range(3)])
        return out, samplers[0].state_dict()

    one, _ = run(1, 10)
    for ranks in (2, 3, 4):
        other, _ = run(ranks, 10)
        for x, y in zip(one, other):
            for p, q in zip(x, y):
                np.testing.assert_array_equal(p, q)
    # the state after 4 steps at 2 ranks continues at 1 rank with the uninterrupted run's windows
    _, state = run(2, 4)
    assert state["blend"][0]["consumed"] + state["blend"][1]["consumed"] + state["blend"][2]["consumed"] == 48
    rest, _ = run(1, 6, start=state)
    for x, y in zip(one[4:], rest):
        for p, q in zip(x, y):
            np.testing.assert_array_equal(p, q)
    with pytest.raises(ValueError, match="data.paths changed"):
        TrainSampler(srcs, 8, 12, 3, 0, 1, seed=4, weights=[0.6, 0.2, 0.2]).load_state_dict(state)


def test_megatron_builder_dataset_and_validation_split(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 500, rng.integers(5, 300)).astype(np.int32) for _ in range(400)]
    prefix = str(tmp_path / "mega_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:  # two sequences per document, as a sentence-split preprocess writes them
        half = len(d) // 2
        builder.add_item(torch.from_numpy(d[:half].astype(np.int64)))
        builder.add_item(torch.from_numpy(d[half:].astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    f = IndexedFile(prefix)
    assert f.num_documents == 400 and f.dtype == np.uint16
    sources, val = open_blend(prefix, val_fraction=0.1)
    train_stream, val_stream = sources[0].train, val[0][1]
    whole = np.concatenate(docs)
    held = _hash_fraction(400, 0) < 0.1  # by document index: the same documents everywhere
    assert 25 < held.sum() < 55
    np.testing.assert_array_equal(val_stream.array(), np.concatenate([d for d, h in zip(docs, held) if h]))
    np.testing.assert_array_equal(train_stream.array(), np.concatenate([d for d, h in zip(docs, held) if not h]))
    # a window read across the runs equals the same tokens of the stream made whole
    flat = np.concatenate([p[0][p[1]:p[2]] for p in train_stream.parts]).astype(np.int64)
    for start in rng.integers(0, train_stream.count - 65, 50):
        np.testing.assert_array_equal(train_stream.windows(np.array([start]), 65)[0], flat[start:start + 65])
    # a separate validation prefix: every document trains
    sources, val = open_blend(prefix, valid_spec=prefix, val_fraction=0.1)
    assert sources[0].train.count == len(whole) and val[0][1].count == len(whole)
    # evaluation reads each source's first windows in proportion to its weight
    batches = eval_batches([(0.75, train_stream), (0.25, val_stream)], 16, 16, 8, 0, 1)
    assert [b.shape for b in batches] == [(8, 17), (8, 17)]
    np.testing.assert_array_equal(batches[1][4], val_stream.windows(np.array([0]), 17)[0])


# ---- end to end: moe-dist train on a blend -------------------------------------------------------------
def config(root, name, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={root}/{name}", f"data.paths=0.3 {root}/faq 0.7 {root}/tutorial", "run.tensorboard=false",
        "run.plots=false", "run.progress=false", "ckpt.save_final=false", f"train.steps={STEPS}", f"ckpt.every={AT}",
        "eval.every=100", *extra])


def losses(root, name):
    with open(os.path.join(root, name, "metrics.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _ranks(rank, world, root):
    from moe_dist.train.loop.trainer import train

    train(config(root, f"w{world}", f"parallel.ep={world}"))


def _in_this_process(root, name, *extra):
    from moe_dist.train.loop.trainer import train

    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        train(config(root, name, "parallel.ep=1", *extra))
    random.setstate(states[0])
    np.random.set_state(states[1])


@pytest.mark.slow
def test_blend_trains_the_same_at_1_2_4_ranks_and_resumes_across_a_reshard(blend):
    root = str(blend)
    _in_this_process(root, "w1")
    ref = losses(root, "w1")
    assert sorted(ref) == list(range(1, STEPS + 1))
    for world in (2, 4):
        run_ranks(_ranks, world, args=(root,), timeout=300)
        got = losses(root, f"w{world}")
        torch.testing.assert_close(torch.tensor([got[s] for s in ref]), torch.tensor(list(ref.values())), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{world} ranks: {m}")
    # the 2-rank run's step-2 checkpoint, resumed by one process: the uninterrupted steps 3-4
    _in_this_process(root, "reshard", f"resume={step_dir(os.path.join(root, 'w2'), AT)}")
    got = losses(root, "reshard")
    assert sorted(got) == [3, 4]
    torch.testing.assert_close(torch.tensor([got[3], got[4]]), torch.tensor([ref[3], ref[4]]), rtol=1e-5, atol=0)
    # the same layout: bitwise
    _in_this_process(root, "same", f"resume={step_dir(os.path.join(root, 'w1'), AT)}")
    same = losses(root, "same")
    assert [same[3], same[4]] == [ref[3], ref[4]]
    meta = json.load(open(os.path.join(step_dir(os.path.join(root, "w2"), AT), "meta.json")))
    assert [b["consumed"] for b in meta["sampler"]["blend"]] == [5, 11]  # 16 windows, 0.3 / 0.7


def test_megatron_builder_dataset_trains(tmp_path, blend):
    """A dataset written by megatron-core's IndexedDatasetBuilder trains with moe-dist train as it is."""
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = Tokenizer.load(str(blend / "tokenizer.model"))
    prefix = str(tmp_path / "docs_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in read_documents(CORPUS):
        builder.add_item(torch.tensor(tok.encode(d.text) + [tok.eos_id]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    from moe_dist.train.loop.trainer import train

    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        out = train(load_config(os.path.join(ROOT, "configs/test.yaml"), [
            f"run.dir={tmp_path}/run", f"data.paths={prefix}", f"data.tokenizer={blend / 'tokenizer.model'}",
            "parallel.ep=1", "train.steps=3", "run.tensorboard=false", "run.plots=false", "run.progress=false",
            "ckpt.save_final=false"]))
    random.setstate(states[0])
    np.random.set_state(states[1])
    assert np.isfinite(out["val_loss"]) and out["val_loss"] < np.log(512)


def test_read_ahead_leaves_the_position_alone(blend):
    """The trainer announces the next step's windows to the kernel after each step: the batches, the
    blend's counts and the epoch notes are those of a sampler that never does."""
    sources, _ = open_blend(f"0.3 {blend}/faq 0.7 {blend}/tutorial")
    streams_, w = [s.train for s in sources], [s.weight for s in sources]
    plain = TrainSampler(streams_, 64, 24, 2, 1, 3, seed=2, weights=w, names=["faq", "tutorial"])
    ahead = TrainSampler(streams_, 64, 24, 2, 1, 3, seed=2, weights=w, names=["faq", "tutorial"])
    for _ in range(300):  # past the end of an epoch of each
        for x, y in zip(plain.next_step(), ahead.next_step()):
            np.testing.assert_array_equal(x, y)
        ahead.prefetch()
        assert ahead.counts == plain.counts and ahead.state_dict() == plain.state_dict()
        assert ahead.pop_notes() == plain.pop_notes()
    assert plain.epochs()[0] > 1 and plain.epochs()[1] > 1
    assert isinstance(streams_[0].parts[0][0], np.memmap) and streams_[0]._fds  # advice went to the shard files
