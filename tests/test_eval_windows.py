"""Which validation windows an evaluation reads: Megatron-Bridge's persistent cyclic sampler over the
seed-shuffled validation set (deepseekv3_671b), and whole global batches (llama31_405b)."""

import dataclasses

import numpy as np
import pytest
import torch

from timetotrain.data.cyclic_sampler import CyclicDraw
from timetotrain.data.gpt_dataset import GPTWindows
from timetotrain.data.indexed import IndexedDataset, IndexedWriter
from timetotrain.data.loader import ResolvedData
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share


def bridge_stream(total: int, mbs: int, rank: int, dp: int):
    """The indices rank `rank` gets from Megatron-Bridge v0.3.0's validation iterator, written from its
    sampler's own state (consumed_samples over all ranks, epoch = consumed // active): cyclic_iter over a
    DataLoader whose batch sampler is MegatronPretrainingRandomSampler(data_sharding=True)."""
    consumed = 0
    while True:  # cyclic_iter: a new pass of the loader re-enters the sampler's __iter__
        active = total - total % (mbs * dp)
        epoch, current = consumed // active, consumed % active
        bucket = (total // (mbs * dp)) * mbs
        g = torch.Generator()
        g.manual_seed(epoch)
        perm = torch.randperm(bucket, generator=g).tolist()
        batch = []
        for x in perm[current // dp :]:
            batch.append(rank * bucket + x)
            if len(batch) == mbs:
                consumed += mbs * dp
                yield from batch
                batch = []


@pytest.mark.parametrize("total, mbs, dp", [(37, 1, 1), (37, 2, 3), (100, 1, 4)])
def test_cyclic_draw_is_the_bridge_sampler_stream(total, mbs, dp):
    for rank in range(dp):
        stream = bridge_stream(total, mbs, rank, dp)
        want = [next(stream) for _ in range(3 * total)]  # three passes: the epochs' permutations differ
        draw = CyclicDraw(total, mbs, rank, dp)
        got = np.concatenate([draw.indices(k * 7, 7) for k in range(len(want) // 7)])
        assert got.tolist() == want[: len(got)]


def _val_folder(root):
    rng = np.random.default_rng(3)
    root.mkdir()
    with IndexedWriter(root / "val_text_document", np.uint16) as w:
        for _ in range(20):
            w.add_document(rng.integers(0, 500, 30))
    return ResolvedData(root / "train_text_document", root / "val_text_document", None)


class _Recorder(torch.nn.Module):
    """Stands in for the model: records the windows each evaluation feeds it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, tokens, labels, reduction):
        self.seen.append(torch.cat([tokens, labels[:, -1:]], dim=1))
        return tokens.sum().double()


def test_deepseek_evaluations_read_the_next_windows_of_the_seed_shuffled_set(tmp_path):
    """Each evaluation of the reference tier reads the next eval_samples windows of the validation set the
    reference's GPTDataset builds with the run's seed ((max_steps // interval + 1) x GBS asked for), in the
    cyclic sampler's order, each rank its share from its own bucket."""
    bench = get("deepseekv3_671b")
    ref = bench.tier("reference")
    assert ref.data.val_draw == "megatron_cyclic"
    tier = dataclasses.replace(
        ref, data=dataclasses.replace(ref.data, seq_len=16), global_batch_size=4, micro_batch_size=1,
        eval_samples=6, max_steps=5, eval_every_samples=4, division="open",
    )  # fmt: skip
    res = _val_folder(tmp_path / "d")
    windows = GPTWindows(IndexedDataset(res.val_prefix), 16, (5 // 1 + 1) * 4, 7, megatron_len=True)
    assert windows.num_epochs == 1 and windows.total_samples == (600 - 1) // 16  # megatron's len: 37
    cpu = torch.device("cpu")
    ev = bench.task._evaluator(tier, res, 7, Share.of(tier.global_batch_size), cpu, None, None)
    model = _Recorder()
    for _ in range(8):  # past the end of one pass: the stream wraps into the next permutation
        ev(model)
    stream = bridge_stream(windows.total_samples, 1, 0, 1)
    assert torch.equal(torch.cat(model.seen), windows.batch([next(stream) for _ in range(8 * 6)]))
    for rank in range(2):  # two data-parallel ranks: each its 3 of the 6 from its own bucket
        ev = bench.task._evaluator(tier, res, 7, Share.of(tier.global_batch_size, rank, 2), cpu, None, None)
        stream = bridge_stream(windows.total_samples, 1, rank, 2)
        assert np.concatenate([ev.draw(k) for k in range(8)]).tolist() == [next(stream) for _ in range(8 * 3)]
    first = windows.batch(list(CyclicDraw(37, 1, 0, 1).indices(0, 6)))
    assert not torch.equal(first, windows.batch(list(CyclicDraw(37, 1, 0, 1).indices(6, 6))))
    model = _Recorder()
    bench.task._evaluator(tier, res, 8, Share.of(tier.global_batch_size), cpu, None, None)(
        model
    )  # another seed, other windows
    again = torch.cat(model.seen)  # one window per micro-batch of 1
    assert again.shape == first.shape and not torch.equal(again, first)


@pytest.mark.parametrize("gbs, windows", [(1152, 5760), (2304, 6912), (4608, 9216), (1536, 6144)])
def test_llama31_405b_evaluates_whole_global_batches(gbs, windows):
    """pretrain_llama31.py: eval_batches = ceil(eval_tokens / GBS) global batches (limit_val_batches); the
    log still reports eval_samples 5,760."""
    from timetotrain.spec.benchmark import apply_overrides

    bench = get("llama31_405b")
    tier = apply_overrides(bench, bench.tier("reference"), [f"global_batch_size={gbs}"])
    assert bench.task.eval_windows(tier) == windows
    assert dict(bench.hyperparameters(tier))["eval_samples"] == 5760
