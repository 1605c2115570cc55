"""Our DLRM-DCNv2 training step vs the same model written the obvious way in plain PyTorch, side by side.

    python bench/dlrm.py [--reps 5] [--steps 3] [--configs tiny,wide] [--device cpu]

Same config, same weights, same batch, same loss (BCE on the logit). Ours: one fused sum-pooled
`embedding_bag` over all 26 tables with a sparse gradient, and the row-sparse Adagrad of train/adagrad.py
(`ttt run`'s step). Plain: one `nn.EmbeddingBag` per table (dense gradient), `torch.optim.Adagrad` over every
parameter (it reads and writes every row of every table each step). TorchRec's DLRM_DCN would be the third
column; it needs fbgemm-gpu kernels for the installed torch, and the script says why when it cannot import.

Fair allocation: both models live in one process, are warmed up twice before timing (so each has its
buffers and optimizer state allocated), and alternate within every repetition, so allocator state and
drifting machine load hit both; medians and their ratio are printed. Set `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_` to large values to see how much of a difference is page faults on fresh memory.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from side_by_side import alternate
from torch import nn

from timetotrain.models import dlrm_dcnv2 as dl
from timetotrain.suite.dlrm_dcnv2 import TINY
from timetotrain.train.adagrad import SparseAdagrad

CONFIGS = {
    "tiny": (TINY.model, TINY.global_batch_size),  # the tiny tier: tables capped at 2,000 rows, 16-d
    # The tiny widths with tables capped at 200,000 rows (4.5 M rows): where touching every row costs.
    "wide": (
        dataclasses.replace(TINY.model, table_sizes=tuple(min(n, 200_000) for n in dl.CRITEO_TABLE_SIZES)),
        512,
    ),
}


class Plain(nn.Module):
    def __init__(self, ours: dl.DLRMDCNv2):
        super().__init__()
        cfg, e = ours.cfg, ours.embedding
        self.multi_hot = cfg.multi_hot
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, cfg.dim, mode="sum") for n in cfg.table_sizes)
        with torch.no_grad():
            for t, bag in enumerate(self.bags):
                bag.weight.copy_(e.weight[e.table_rows(t)])
        self.bottom, self.cross, self.top = ours.bottom, ours.cross, ours.top  # a deep copy of ours

    def forward(self, dense, sparse):
        pooled, col = [], 0
        for bag, k in zip(self.bags, self.multi_hot, strict=True):
            pooled.append(bag(sparse[:, col : col + k]))
            col += k
        x0 = torch.cat([self.bottom(dense), *pooled], 1)
        return self.top(self.cross(x0)).squeeze(-1)


def make(name, device):
    import copy

    cfg, batch = CONFIGS[name]
    ours = dl.DLRMDCNv2(cfg)
    dl.init(ours, torch.Generator().manual_seed(0))
    ours = ours.to(device)
    plain = Plain(copy.deepcopy(ours)).to(device)
    g = torch.Generator().manual_seed(1)
    sparse = torch.cat(
        [
            torch.randint(0, n, (batch, k), generator=g)
            for n, k in zip(cfg.table_sizes, cfg.multi_hot, strict=True)
        ],
        1,
    )
    data = (
        (torch.rand(batch, 13, generator=g) * 5).to(device),
        sparse.int().to(device),
        (torch.rand(batch, generator=g) < 0.25).float().to(device),
    )
    opt_ours = SparseAdagrad(list(ours.parameters()), lr=0.01)
    opt_plain = torch.optim.Adagrad(plain.parameters(), lr=0.01, eps=1e-8)

    def step(model, opt):
        def run(b):
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(model(b[0], b[1]), b[2]).backward()
            opt.step()

        return run

    return cfg, batch, data, step(ours, opt_ours), step(plain, opt_plain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default="tiny,wide")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    try:
        import torchrec  # noqa: F401

        trec = "imports (not yet timed here)"
    except Exception as e:  # ImportError, or fbgemm's kernel library failing to load
        trec = f"not importable ({type(e).__name__}: {e})"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; TorchRec {trec}")
    print(
        f"{'config':<6}{'table rows':>12}{'batch':>7}{'ours samples/s':>16}{'plain samples/s':>17}{'ratio':>8}"
    )
    for name in args.configs.split(","):
        cfg, batch, data, ours, plain = make(name, device)
        ma, mb = alternate(ours, plain, data, batch, args.reps, args.steps, device)
        print(f"{name:<6}{cfg.rows:>12,}{batch:>7}{ma:>16,.0f}{mb:>17,.0f}{ma / mb:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
