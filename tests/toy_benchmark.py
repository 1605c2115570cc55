"""A test-only benchmark of another shape than causal-LM pretraining, to prove the harness interface:
classification of points into Gaussian clusters by a small MLP. Dict batches ({"x", "y"}), Adam (L2-style
weight decay, every parameter), a warmup+constant schedule, accuracy as the metric (higher is better), and
eval points counted in epochs (`epoch_num`), as R-GAT's are. Not in `ttt list` (`listed=False`).

Made known to every `ttt` command by TTT_EXTRA_BENCHMARKS=toy_benchmark (with tests/ on PYTHONPATH).
Its data is one .npz file that `make_data` writes: its task's data recipe, so `ttt suite --data SRC` and
`ttt data prepare --for toy_classify --tier tiny --src SRC --out DIR` make it (SRC is not read). TOY_STEP_SECONDS=S makes each training batch take S
seconds more, so the fault tests can signal a run that is surely still training.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from timetotrain.errors import UserError
from timetotrain.models.family import ModelFamily
from timetotrain.spec.benchmark import Benchmark, Optimizer, Tier
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task

FILE = "toy_clusters.npz"


def make_data(out: Path, n_train: int = 2048, n_val: int = 512, classes: int = 4, dim: int = 8) -> Path:
    """Points around `classes` random centres (unit noise), split into train and validation."""
    rng = np.random.default_rng(0)
    centres = rng.normal(0.0, 1.2, (classes, dim))

    def draw(n):
        y = rng.integers(0, classes, n)
        return (centres[y] + rng.normal(0.0, 1.0, (n, dim))).astype(np.float32), y.astype(np.int64)

    (xt, yt), (xv, yv) = draw(n_train), draw(n_val)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / FILE, x_train=xt, y_train=yt, x_val=xv, y_val=yv)
    return out / FILE


@dataclass(frozen=True)
class MLPConfig:
    dim: int = 8
    hidden: int = 64
    classes: int = 4
    n_layers: int = 2


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        sizes = [cfg.dim] + [cfg.hidden] * cfg.n_layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
        self.out = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


@torch.no_grad()
def init(model: MLP, generator) -> None:
    for m in [*model.layers, model.out]:
        nn.init.normal_(m.weight, 0.0, 1.0 / math.sqrt(m.in_features), generator=generator)
        nn.init.zeros_(m.bias)


def _params(cfg: MLPConfig) -> int:
    return sum(p.numel() for p in MLP(cfg).parameters())


FAMILY = ModelFamily(
    name="mlp",
    build=MLP,
    init=init,
    param_count=_params,
    active_param_count=_params,
    flops_per_token=lambda cfg, seq_len=1, causal=False: 6 * _params(cfg),
    block_params=lambda cfg: cfg.hidden * (cfg.hidden + 1),
    activation_elements=lambda cfg: 2 * cfg.hidden,
)


@dataclass(frozen=True)
class ClusterData:
    file: str = FILE
    train_points: int = 2048  # what make_data writes by default (logged as train_samples)


class _Points(RunData):
    def __init__(self, x, y, xv, yv, gbs, share: Share, seed, device):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.samples_per_epoch = len(y)
        part = share.part(len(yv))  # this rank's contiguous part of the validation points
        self.xv, self.yv = torch.from_numpy(xv[part]).to(device), torch.from_numpy(yv[part]).to(device)
        self.gbs, self.local, self.offset = gbs, share.local, share.offset
        self.seed, self.world, self.device = seed, share.world, device
        self._perm: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm:  # one seeded shuffle per epoch, the same on every rank
            self._perm = {
                epoch: torch.randperm(len(self.y), generator=torch.Generator().manual_seed(self.seed + epoch))
            }
        return self._perm[epoch]

    def batch(self, step: int) -> Batch:
        time.sleep(float(os.environ.get("TOY_STEP_SECONDS", "0")))
        start = step * self.gbs + self.offset
        idx = torch.stack(
            [self._order(i // len(self.y))[i % len(self.y)] for i in range(start, start + self.local)]
        )
        return {"x": self.x[idx], "y": self.y[idx]}

    def loss(self, model, batch, reduction="mean"):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)

    @torch.no_grad()
    def evaluate(self, model, autocast=None) -> float:
        sums = torch.stack(
            [(model(self.xv).argmax(-1) == self.yv).sum(), torch.tensor(len(self.yv))]
        ).double()
        if self.world > 1:
            dist.all_reduce(sums)
        correct, n = sums.tolist()
        return correct / n


class _RandomPoints(RunData):
    def __init__(self, cfg: MLPConfig, n: int, generator, device):
        self.cfg, self.n, self.generator, self.device = cfg, n, generator, device

    def batch(self, step):
        x = torch.randn(self.n, self.cfg.dim, generator=self.generator, device=self.device)
        y = torch.randint(0, self.cfg.classes, (self.n,), generator=self.generator, device=self.device)
        return {"x": x, "y": y}

    loss = _Points.loss


class Resolved:
    def __init__(self, path: Path):
        self.path = path

    def files(self):
        return [self.path]


class Classify(Task):
    metric = Metric("validation accuracy", higher_is_better=True, unit="epochs")

    def data_name(self, tier):
        return f"toy-clusters-{tier.data.train_points}"

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        # Drawn, not read: the recipe makes the points whatever the source folder holds.
        return DataRecipe(
            self.data_name(tier),
            f"{tier.data.train_points:,} toy points",
            call=lambda out: make_data(Path(out), n_train=tier.data.train_points),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        path = Path(data_dir) / tier.data.file
        if not path.is_file():
            raise UserError(
                f"--data {data_dir} has no {tier.data.file}: write it with toy_benchmark.make_data"
            )
        return Resolved(path)

    def open(self, tier, resolved, seed, share, device):
        d = np.load(resolved.path)
        return _Points(
            d["x_train"],
            d["y_train"],
            d["x_val"],
            d["y_val"],
            tier.global_batch_size,
            share,
            seed,
            device,
        )

    def synthetic(self, tier, local_batch, generator, device):
        return _RandomPoints(tier.model, local_batch, generator, device)

    def flops_per_sample(self, family, tier):
        return family.flops_per_token(tier.model)

    def sample_items(self, tier):
        return "points", 1

    def hyperparameters(self, bench, tier, accum):
        return [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            ("opt_base_learning_rate", tier.lr),
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            *bench.optimizer.log_keys(),
            # The dataset sizes, which the official common rules require exactly once.
            ("train_samples", tier.data.train_points),
            ("eval_samples", tier.eval_samples),
        ]


TINY = Tier(
    name="tiny", model=MLPConfig(), data=ClusterData(), global_batch_size=32, micro_batch_size=16, lr=3e-3,
    end_lr=3e-3, warmup_steps=8, max_steps=1000, eval_every_samples=512, eval_samples=512, target=0.9,
    runs=3, division="open", description="test-only: Gaussian clusters, 2,048 points",
)  # fmt: skip

BENCHMARK = Benchmark(
    name="toy_classify",
    area="test-only classification",
    task=Classify(),
    family=FAMILY,
    tiers={"tiny": TINY},
    optimizer=Optimizer(
        name="adam", betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4, clip=None, decay_mask="all"
    ),
    schedule="warmup_constant",
    listed=False,
    rules_dir=Path(__file__).parent / "toy_rules",
)
