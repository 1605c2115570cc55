"""Click-through-rate prediction (MLPerf dlrm_dcnv2): batches of [dense features, multi-hot ids, click]
read in order from the memory-mapped days (data/criteo.py), binary cross-entropy on the logit, and the
exact AUROC of fp32 sigmoid(logit) over the whole validation half of the last day, gathered from every rank
(tasks/auc.py).

Eval points are in epochs (`epoch_num`, from 0, the reference's `epoch + it / len(train_dataloader)`,
dlrm_main.py:501) at the reference's cadence: every TOTAL_TRAINING_SAMPLES // (GBS x 20) steps
(`criteo.eval_every`). One epoch at most (--epochs 1); the last, partial batch is dropped (the rules allow
it), so an epoch is `criteo.batches` whole batches and each rank's share of a batch is contiguous: the
same rows the reference's round-robin of per-rank batches gives a global batch.

A batch: `dense` [B, 13] float32, `sparse` [B, sum(multi_hot)] int32 (per-table row ids, table-major
columns), `label` [B] float32.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from timetotrain.data import criteo, criteo_synth
from timetotrain.errors import UserError
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task
from timetotrain.tasks.auc import auc, gather


@dataclass(frozen=True)
class CTRData:
    train_rows: int  # training samples of the tier's dataset (days 0..22), for the cadence and the log
    val_rows: int  # the validation half of day 23
    eval_batch: int = 65_536  # validation samples scored at once (no effect on the AUC)
    evals_per_epoch: int = 20
    # The generated dataset of this tier (`ttt data synth-criteo --scale NAME`), or None for real Criteo.
    synth_scale: str | None = None
    how_to_make: str = (
        "download the MLCommons multi-hot Criteo with `ttt data download --for dlrm_dcnv2 --tier reference "
        "--out DIR`"
    )


def forward(model, batch: Batch) -> torch.Tensor:
    return model(batch["dense"], batch["sparse"])


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The scores the AUROC ranks: fp32 sigmoid(logits), as the reference scores them (dlrm_main.py:392-406),
    so logits that saturate to one probability (above ~16.6 every logit is 1.0) tie there and here."""
    return torch.sigmoid(logits.float())


def _loss(model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(forward(model, batch), batch["label"], reduction=reduction)


def _to_batch(rows: tuple, device=None) -> Batch:
    dense, labels, sparse = rows
    out = {
        "dense": torch.from_numpy(dense),
        "sparse": torch.from_numpy(sparse),
        "label": torch.from_numpy(labels),
    }
    return out if device is None else {k: v.to(device, non_blocking=True) for k, v in out.items()}


class _Days(RunData):
    def __init__(self, files: criteo.CriteoFiles, spec: CTRData, gbs: int, share: Share, device):
        self.files, self.spec = files, spec
        self.train = criteo.Rows(files.days[:-1])
        self.val = criteo.Rows(files.days[-1:], count=files.val_rows)
        self.batches = criteo.batches(len(self.train), gbs)
        self.samples_per_epoch = self.batches * gbs
        self.gbs, self.local, self.offset = gbs, share.local, share.offset
        self.rank, self.world, self.device = share.rank, share.world, device
        # This rank's contiguous share of the validation rows (the AUC gathers every share). Every rank scores
        # the same number of equal chunks, the last share padded with repeats of the last row (dropped before
        # the AUC): sharded tables run collectives in each forward, which every rank must join alike.
        self.val_rows = share.padded_part(len(self.val))

    def batch(self, step: int) -> Batch:
        self.files.mapped.check_unchanged()  # before touching mapped pages: a file cut short is a SIGBUS
        j = step % self.batches  # a run is one epoch; a longer --max-steps reads the epoch again
        return _to_batch(self.train.take(j * self.gbs + self.offset, self.local))

    def loss(self, model, batch, reduction="mean"):
        return _loss(model, batch, reduction)

    @torch.no_grad()
    def evaluate(self, model, autocast=None) -> float:
        was = model.training
        model.eval()
        scores, labels = [], []
        n_val = len(self.val)
        for a in range(self.val_rows.start, self.val_rows.stop, self.spec.eval_batch):
            n = min(self.spec.eval_batch, self.val_rows.stop - a)
            real = max(min(n, n_val - a), 0)
            self.files.mapped.check_unchanged()
            rows = self.val.take(a, real) if real else self.val.take(n_val - 1, 1)
            pad = n - len(rows[0])
            if pad:  # the last row again, scored and dropped
                rows = tuple(np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) for x in rows)
            b = _to_batch(rows, self.device)
            with torch.autocast(
                self.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                scores.append(probabilities(forward(model, b))[:real])
            labels.append(b["label"][:real])
        model.train(was)
        empty = torch.empty(0, device=self.device)
        s = gather(torch.cat(scores) if scores else empty, self.world)
        y = gather(torch.cat(labels) if labels else empty, self.world)
        return auc(s, y)

    def close(self) -> None:
        self.files.close()


class _Synthetic(RunData):
    """Random batches made on the device: ids uniform in each table (a worst case for caches), for
    `ttt synth` and the warm-up."""

    def __init__(self, tier, local_batch: int, generator: torch.Generator, device):
        self.cfg, self.n, self.generator, self.device = tier.model, local_batch, generator, device
        self._stamps: list[float] = []  # when each batch was asked for: one a step

    def batch(self, step):
        g, n, dev = self.generator, self.n, self.device
        cols = [
            torch.randint(0, rows, (n, k), generator=g, device=dev, dtype=torch.int32)
            for rows, k in zip(self.cfg.table_sizes, self.cfg.multi_hot, strict=True)
        ]
        self._stamps.append(time.perf_counter())
        return {
            "dense": torch.rand(n, self.cfg.dense_in, generator=g, device=dev) * 5,
            "sparse": torch.cat(cols, 1),
            "label": (torch.rand(n, generator=g, device=dev) < 0.25).float(),
        }

    def loss(self, model, batch, reduction="mean"):
        return _loss(model, batch, reduction)

    def figures(self) -> dict[str, float]:
        """Embedding lookups and the bytes they move per second of this rank, over the later half of the
        steps (the earlier ones include the warm-up): rows read forward, a gradient row written and read
        back per lookup, and the optimizer's read and write of each row and its state (an upper bound:
        repeated ids in a batch are updated once)."""
        cfg, stamps = self.cfg, self._stamps[len(self._stamps) // 2 :]
        if len(stamps) < 2:
            return {}
        per_s = self.n * (len(stamps) - 1) / (stamps[-1] - stamps[0])
        row = cfg.dim * 4
        return {
            "embedding lookups/s": per_s * cfg.hots,
            "embedding GB moved/s": per_s * cfg.hots * row * (1 + 2 + 4) / 1e9,
            "embedding bytes/sample": float(cfg.hots * row * (1 + 2 + 4)),
        }


class Resolved:
    def __init__(self, files: criteo.CriteoFiles, seconds: float):
        self.criteo_files, self.seconds = files, seconds

    def files(self):
        return self.criteo_files.files()


class ClickThroughRate(Task):
    metric = Metric("validation AUROC", higher_is_better=True, unit="epochs")

    def validate(self, tier) -> None:
        if tier.warmup_steps != 0:
            raise UserError(
                f"--set warmup_steps={tier.warmup_steps}: dlrm_dcnv2 has no LR schedule (the closed rules fix "
                "warmup, decay start and decay steps at 0)"
            )
        if len(tier.model.table_sizes) != 26:
            raise UserError(f"{tier.name}: Criteo has 26 categorical features, the model {tier.model.tables}")
        if criteo.batches(tier.data.train_rows, tier.global_batch_size) < 1:
            raise UserError(
                f"--set global_batch_size={tier.global_batch_size} exceeds the {tier.data.train_rows:,} "
                "training samples"
            )

    def _every(self, tier) -> int:
        return criteo.eval_every(tier.data.train_rows, tier.global_batch_size, tier.data.evals_per_epoch)

    def eval_every_steps(self, tier) -> int:
        """The reference's cadence at the tier's GBS, unless --set eval_every_samples chose another."""
        if "eval_every_samples" in tier.user_set:
            return tier.eval_every_steps
        return self._every(tier)

    def steps_at_gbs(self, tier, gbs: int) -> int:
        return criteo.batches(tier.data.train_rows, gbs)  # one epoch at any GBS (--epochs 1)

    def _generated(self, tier) -> bool:
        return tier.data.synth_scale is not None

    def data_name(self, tier) -> str | None:
        return f"criteo-synth-{tier.data.synth_scale}" if self._generated(tier) else None

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        if not self._generated(tier):
            raise UserError(
                f"{tier.name} reads the MLPerf multi-hot Criteo, which no recipe here makes: "
                f"{tier.data.how_to_make}, then pass --data dlrm_dcnv2=DIR"
            )
        sc = criteo_synth.scale(tier.data.synth_scale)
        return DataRecipe(
            self.data_name(tier),
            f"a synthetic multi-hot Criteo at {tier.data.synth_scale} scale (seed 0)",
            call=lambda out: criteo_synth.generate(Path(out), sc, seed=0, log=lambda *a: None),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        t0 = time.monotonic()
        cfg, spec = tier.model, tier.data
        files = criteo.open_files(Path(data_dir), cfg.table_sizes, cfg.multi_hot)
        try:
            if files.train_rows != spec.train_rows or files.val_rows != spec.val_rows:
                raise UserError(
                    f"--data {data_dir} has {files.train_rows:,} training and {files.val_rows:,} validation "
                    f"samples; the {tier.name} tier reads {spec.train_rows:,} and {spec.val_rows:,}: "
                    + (
                        f"write it with `ttt data synth-criteo --scale {spec.synth_scale} --out DIR`"
                        if spec.synth_scale
                        else spec.how_to_make
                    )
                )
            if verify:
                criteo.verify(files)
        except BaseException:
            files.close()
            raise
        return Resolved(files, time.monotonic() - t0)

    def open(self, tier, resolved, seed, share, device):
        return _Days(resolved.criteo_files, tier.data, tier.global_batch_size, share, device)

    def synthetic(self, tier, local_batch, generator, device):
        return _Synthetic(tier, local_batch, generator, device)

    def flops_per_sample(self, family, tier):
        return family.flops_per_token(tier.model)

    def sample_items(self, tier):
        return "samples", 1

    def hyperparameters(self, bench, tier, accum):
        """The reference's keys in its order (dlrm_main.py:704-716, 854-890, 904-908)."""
        opt = bench.optimizer.log_keys()
        return [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            opt[0],
            ("opt_base_learning_rate", tier.lr),
            *opt[1:],
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            ("opt_learning_rate_decay_start_step", 0),
            ("opt_learning_rate_decay_steps", 0),
            (
                "train_samples",
                criteo.batches(tier.data.train_rows, tier.global_batch_size) * tier.global_batch_size,
            ),
            ("eval_samples", tier.data.val_rows),
        ]

    def baseline_loss(self, tier):
        return math.log(2)
