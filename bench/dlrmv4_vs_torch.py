"""Our hstu training step (dlrmv4) vs the same model with its tables written the obvious way in plain PyTorch,
side by side.

    python bench/dlrmv4_vs_torch.py [--reps 5] [--steps 3] [--configs tiny,wide] [--device cpu]

Same config, same weights, same batch, same loss. Ours (`ttt run`'s step): the 11 tables as one fused
[rows, dim] weight looked up once per step with a sparse gradient (models/common/embedding.FusedEmbedding),
row-wise Adagrad on the rows the batch touched (train/adagrad.py), Adam on the dense part. Plain: one
`nn.Embedding(sparse=False)` per table, looked up per feature column (a dense gradient of every table), one
`torch.optim.Adam` over every parameter (it reads and writes every row of every table each step). Both run
the attention as the reference's PyTorch path computes it (pytorch_hstu_mha: the batch padded to its longest
sequence, one pair of einsums, SiLU / N, the mask; models/hstu/attention.py at attention_block 0, what the
model's author transcribed and tests/test_hstu.py checks per sample); `--attention-block K` gives ours the
blocked, recomputing attention instead. No gradient clipping in either.

Fair allocation: both models live in one process, are warmed up twice before timing (so each has its
buffers and optimizer state allocated), and alternate within every repetition, so allocator state and
drifting machine load hit both; medians and their ratio are printed. Set `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_` to large values to see how much of a difference is page faults on fresh memory.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import numpy as np
import torch
from side_by_side import alternate
from torch import nn

from timetotrain.models import hstu
from timetotrain.train.adagrad import SparseAdagrad

SHAPE = dict(
    table_dim=32, dim=32, heads=2, linear_dim=16, qk_dim=16, layers=2, preprocessor_hidden=32, max_seq_len=128,
    input_dropout=0.0, linear_dropout=0.0, mlp_hidden=32, position_buckets=128, time_buckets=256,
)  # fmt: skip
CONFIGS = {
    # (config, samples per step, longest history, candidates per sample)
    "tiny": (hstu.HSTUConfig(tables=hstu.tiny_tables(4096, 1024), **SHAPE), 32, 100, 4),
    # The same widths with 200,000 rows per table (2.2 M rows): where touching every row costs.
    "wide": (hstu.HSTUConfig(tables=hstu.tiny_tables(200_000, 200_000), **SHAPE), 32, 100, 4),
}


class Plain(hstu.HSTU):
    """Ours with the tables as one nn.Embedding each, copied from `ours`, looked up per feature column."""

    def __init__(self, ours: hstu.HSTU):
        super().__init__(ours.cfg)
        self.load_state_dict(ours.state_dict())
        e = self.embedding
        self.tables = nn.ModuleList(nn.Embedding(n, e.dim) for n in e.table_sizes)
        with torch.no_grad():
            for t, table in enumerate(self.tables):
                table.weight.copy_(e.weight[e.table_rows(t)])
        del self.embedding

    def _look(self, ids: torch.Tensor, tables: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([self.tables[t](ids[:, j]) for j, t in enumerate(tables)], dim=1)

    def embed(self, batch):
        return (
            self._look(batch.contextual_ids, self.contextual_tables),
            self._look(batch.uih_ids, self.sequence_tables),
            self._look(batch.candidate_ids, self.sequence_tables),
        )


def _batch(cfg: hstu.HSTUConfig, samples: int, longest: int, cands: int, seed: int = 1) -> hstu.HSTUBatch:
    hist = np.random.default_rng(seed).integers(longest // 4, longest + 1, samples).tolist()
    return hstu.collate(hstu.synthetic_samples(cfg, hist, [cands] * samples, seed), cfg.features)


def make(name: str, device: torch.device, block: int):
    cfg, samples, longest, cands = CONFIGS[name]
    ours = hstu.HSTU(dataclasses.replace(cfg, attention_block=block))
    hstu.init(ours, torch.Generator().manual_seed(0))
    plain = Plain(copy.deepcopy(ours)).to(device)
    plain.cfg = cfg
    for layer in plain.layers:
        layer.attention_block = 0
    ours = ours.to(device)
    batch = _batch(cfg, samples, longest, cands).to(device)
    table_opt = SparseAdagrad(hstu.table_parameters(ours), lr=1e-3, rowwise=True)
    dense_opt = torch.optim.Adam(hstu.dense_parameters(ours), lr=1e-3, betas=(0.95, 0.999), eps=1e-8)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3, betas=(0.95, 0.999), eps=1e-8)

    def step(model, opts):
        def run(b):
            for o in opts:
                o.zero_grad(set_to_none=True)
            model.loss(model(b), b).backward()
            for o in opts:
                o.step()

        return run

    with torch.no_grad():  # the same function: the two losses agree before any step
        gap = (ours.loss(ours(batch), batch) - plain.loss(plain(batch), batch)).abs().item()
    return cfg, samples, batch, step(ours, (table_opt, dense_opt)), step(plain, (plain_opt,)), gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default="tiny,wide")
    ap.add_argument("--attention-block", type=int, default=0, help="ours only: 0 is the reference's path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}")
    print(
        f"{'config':<6}{'table rows':>12}{'batch':>7}{'ours samples/s':>16}{'plain samples/s':>17}{'ratio':>8}"
    )
    for name in args.configs.split(","):
        cfg, samples, batch, ours, plain, gap = make(name, device, args.attention_block)
        assert gap < 1e-5, f"{name}: the two losses differ by {gap}"
        ma, mb = alternate(ours, plain, batch, samples, args.reps, args.steps, device)
        print(f"{name:<6}{cfg.rows:>12,}{samples:>7}{ma:>16,.1f}{mb:>17,.1f}{ma / mb:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
