"""Sequential recommendation (MLPerf Training 6.1 dlrmv4): HSTU reads a user's listening history and predicts
whether the anchor event is a real listen (`listen_plus`), streaming once over the Yambda day windows in
strict time order, with the exact AUC over the whole held-out window at each eval point.

The rules side (eval grid, first eval, LR band, the hyperparameter block) is `tasks/seqrec_rules.py`; this
file adds what reads the data and builds the batches. The stream is `data/yambda.py`'s: the train windows in
order (`stream_plan`), each cut to whole global batches (`global_batches`: global batch k of a window is its
anchors [k GBS, (k+1) GBS) at any world size), and this rank takes its contiguous `Share` of each. Samples
are collated into `models.hstu.HSTUBatch` and travel as a dict of its (jagged) fields: they cannot be cut
into micro-batches along a sample dimension, so the task takes whole per-rank batches (`whole_batches`).

The held-out window is scored whole: every anchor of it, in padded per-rank parts that the AUC gathers
(`tasks/auc.py`, ties at half). The reference cuts it to whole global batches (up to GBS - 1 anchors unscored,
train/utils.py:2994-3009); scoring all is the same metric over one more partial batch, and what the tiny
tier's `eval_samples` counts. docs/benchmarks/dlrmv4.md."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from timetotrain.data import yambda_synth
from timetotrain.data.yambda import YambdaConfig, YambdaDataset, global_batches, stream_plan
from timetotrain.data.yambda_layout import CROSS_SPECS
from timetotrain.errors import UserError
from timetotrain.models.hstu import HSTUBatch, collate
from timetotrain.models.hstu.head import masked_bce
from timetotrain.spec.task import Batch, DataRecipe, RunData
from timetotrain.tasks.auc import auc, gather
from timetotrain.tasks.seqrec_rules import SeqRecData, SeqRecRules


@dataclass(frozen=True)
class YambdaData(SeqRecData):
    """The rules' fields, and how the Yambda stream is read (the defaults are the reference's gin)."""

    history_length: int = 4086  # HISTORY_LENGTH: a third of it from each pool (yambda_5b.gin:451-453)
    min_history: int = 4086  # MIN_HISTORY: earlier events an anchor needs (yambda_5b.gin:500-502)
    num_train_ts: int = 299  # train windows from 0, in time order (yambda_5b.gin:568-580)
    eval_holdout_ts: int = 299  # the held-out window (yambda_5b.gin:788-793)
    eval_batch: int = 1024  # held-out samples scored at once (no effect on the AUC)
    # The generated data of this tier (`ttt data synth-yambda --scale NAME`), or None for real Yambda.
    synth_scale: str | None = None
    how_to_make: str = (
        "download Yambda-5B and preprocess it as the reference's README says (recommendation_v4/README.MD), "
        "then pass the folder that holds processed_5b/ and shared_metadata/"
    )


def yambda_config(tier) -> YambdaConfig:
    """The reader's config for a tier: its history and sequence shape, the crosses hashed into the model's
    table sizes (the reference's rows at the reference shape)."""
    d, rows = tier.data, dict(tier.model.tables)
    crosses = tuple((name, keys, rows[name], salt) for name, keys, _, salt in CROSS_SPECS)
    return YambdaConfig(
        history_length=d.history_length,
        min_history=d.min_history,
        max_seq_len=tier.model.max_seq_len,
        cross_specs=crosses,
    )


def as_batch(b: HSTUBatch) -> Batch:
    return {f.name: getattr(b, f.name) for f in fields(b)}


def _collated(ds: YambdaDataset, idx: np.ndarray, features) -> Batch:
    """The samples of anchors `idx` as one batch (the labels are the candidates' action bit: not needed)."""
    return as_batch(collate([(s.uih, s.candidates) for s in ds.samples(idx)], features))


def _loss(tier, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
    """The reference's masked BCE (sum over candidates / count x 0.2, modules/multitask_module.py:131-172);
    `reduction="sum"` the unnormalised sum (the loop never asks for it; kept to the interface)."""
    b = HSTUBatch(**batch)
    cfg = tier.model
    logits = model(b)
    labels = ((b.candidate_actions & cfg.task_bit) > 0).float()
    loss = masked_bce(logits, labels, None, cfg.loss_scale)
    return loss * logits.shape[0] if reduction == "sum" else loss


class Resolved:
    def __init__(self, data: YambdaDataset, train_windows: list[int], eval_window: int, seconds: float):
        self.data, self.train_windows, self.eval_window, self.seconds = (
            data,
            train_windows,
            eval_window,
            seconds,
        )

    def files(self):
        root = self.data.processed
        return sorted(p for p in (*root.rglob("*"), *self.data.metadata.rglob("*")) if p.is_file())


class _Stream(RunData):
    """The train windows in time order, whole global batches each; the held-out window for evaluation."""

    def __init__(self, tier, resolved: Resolved, share, device):
        self.tier, self.ds, self.features = tier, resolved.data, tier.model.features
        self.gbs, self.local, self.offset = tier.global_batch_size, share.local, share.offset
        self.world, self.device = share.world, device
        self.windows = resolved.train_windows
        counts = [len(self.ds.train_window_indices(ts)) // self.gbs for ts in self.windows]
        self.ends = np.cumsum(counts)  # batches before the end of each window
        self.batches = int(self.ends[-1]) if len(self.ends) else 0
        self._window: tuple[int, np.ndarray] | None = None
        self.eval_idx = self.ds.eval_holdout_indices(resolved.eval_window)
        self.eval_part = share.padded_part(len(self.eval_idx))
        self._eval_batches: list[tuple[Batch, int]] | None = None

    def _window_batches(self, w: int) -> np.ndarray:
        if self._window is None or self._window[0] != w:
            self._window = (w, global_batches(self.ds.train_window_indices(self.windows[w]), self.gbs))
        return self._window[1]

    def batch(self, step: int) -> Batch:
        j = step % self.batches  # a run is one pass; a longer --max-steps streams the windows again
        w = int(np.searchsorted(self.ends, j, side="right"))
        k = j - (int(self.ends[w - 1]) if w else 0)
        idx = self._window_batches(w)[k, self.offset : self.offset + self.local]
        return _collated(self.ds, idx, self.features)

    def loss(self, model, batch, reduction="mean"):
        return _loss(self.tier, model, batch, reduction)

    def _eval_chunks(self) -> list[tuple[Batch, int]]:
        """This rank's part of the held-out window in chunks (padded with the last anchor, dropped before the
        AUC), built once: the held-out window does not change between evals."""
        if self._eval_batches is None:
            n, step, out = len(self.eval_idx), self.tier.data.eval_batch, []
            for a in range(self.eval_part.start, self.eval_part.stop, step):
                pos = np.arange(a, min(a + step, self.eval_part.stop))
                real = int(np.count_nonzero(pos < n))
                idx = self.eval_idx[np.minimum(pos, n - 1)]
                out.append((_collated(self.ds, idx, self.features), real))
            self._eval_batches = out
        return self._eval_batches

    @torch.no_grad()
    def evaluate(self, model, autocast=None) -> float:
        was = model.training
        model.eval()
        scores, labels = [], []
        for cpu, real in self._eval_chunks():
            b = {k: v.to(self.device, non_blocking=True) for k, v in cpu.items()}
            with torch.autocast(
                self.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                logits = model(HSTUBatch(**b))
            # fp32 sigmoid, as torchrec's AUC scores the predictions (dlrm_v4/utils.py:943-951)
            scores.append(torch.sigmoid(logits.float())[:real])
            labels.append(((b["candidate_actions"] & self.tier.model.task_bit) > 0).float()[:real])
        model.train(was)
        empty = torch.empty(0, device=self.device)
        s = gather(torch.cat(scores) if scores else empty, self.world)
        y = gather(torch.cat(labels) if labels else empty, self.world)
        return auc(s, y)


class _Synthetic(RunData):
    """Random full-length samples made on the device (ids uniform in each table, a worst case for caches),
    for `ttt synth` and the warm-up."""

    def __init__(self, tier, local_batch: int, generator: torch.Generator, device):
        self.tier, self.cfg, self.n, self.generator, self.device = (
            tier,
            tier.model,
            local_batch,
            generator,
            device,
        )
        self._stamps: list[float] = []

    def batch(self, step):
        cfg, g, n, dev = self.cfg, self.generator, self.n, self.device
        hist = cfg.max_seq_len - cfg.contextual_len - 1  # one candidate

        def ids(names, count):
            cols = [torch.randint(0, dict(cfg.tables)[t], (count,), generator=g, device=dev) for t in names]
            return torch.stack(cols, 1)

        seq_tables = [t for _, _, t in cfg.features.sequence]
        t0 = 1_700_000_000
        ts = t0 + torch.arange(hist, device=dev).repeat(n) * 200
        self._stamps.append(time.perf_counter())
        return as_batch(
            HSTUBatch(
                uih_lengths=torch.full((n,), hist, dtype=torch.long, device=dev),
                num_candidates=torch.ones(n, dtype=torch.long, device=dev),
                contextual_ids=ids(cfg.features.contextual, n),
                uih_ids=ids(seq_tables, n * hist),
                uih_actions=torch.randint(0, 8, (n * hist,), generator=g, device=dev),
                uih_timestamps=ts,
                candidate_ids=ids(seq_tables, n),
                candidate_actions=torch.randint(0, 2, (n,), generator=g, device=dev),
                query_times=torch.full((n,), t0 + hist * 200, dtype=torch.long, device=dev),
            )
        )

    def loss(self, model, batch, reduction="mean"):
        return _loss(self.tier, model, batch, reduction)

    def figures(self) -> dict[str, float]:
        """Table lookups and attention tokens per second of this rank, over the later half of the steps (the
        earlier ones include the warm-up)."""
        cfg, stamps = self.cfg, self._stamps[len(self._stamps) // 2 :]
        if len(stamps) < 2:
            return {}
        per_s = self.n * (len(stamps) - 1) / (stamps[-1] - stamps[0])
        seq = len(cfg.features.sequence)
        lookups = cfg.contextual_len + (cfg.max_seq_len - cfg.contextual_len) * seq
        return {"embedding lookups/s": per_s * lookups, "attention tokens/s": per_s * cfg.max_seq_len}


class SequentialRecommendation(SeqRecRules):
    # A batch is jagged (histories of different lengths): it is never cut into micro-batches.
    whole_batches = True

    def validate(self, tier) -> None:
        super().validate(tier)
        d = tier.data
        if tier.model is not None and tier.model.max_seq_len != d.max_seq_len:
            raise UserError(
                f"{tier.name}: the model's max_seq_len {tier.model.max_seq_len} differs from the data's "
                f"{d.max_seq_len}"
            )

    def _generated(self, tier) -> bool:
        return tier.data.synth_scale is not None

    def data_name(self, tier) -> str | None:
        return f"yambda-synth-{tier.data.synth_scale}" if self._generated(tier) else None

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        if not self._generated(tier):
            raise UserError(
                f"{tier.name} reads Yambda-5B, which no recipe here makes: {tier.data.how_to_make}, "
                "with --data dlrmv4=DIR"
            )
        sc = yambda_synth.scale(tier.data.synth_scale)
        return DataRecipe(
            self.data_name(tier),
            f"a synthetic Yambda at {tier.data.synth_scale} scale (seed 0)",
            call=lambda out: yambda_synth.generate(Path(out), sc, seed=0, log=lambda *a: None),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        t0 = time.monotonic()
        d, cfg = tier.data, tier.model
        rows = dict(cfg.tables)
        tables = {name: rows[name] for name in ("item_id", "artist_id", "album_id", "uid")}
        ds = YambdaDataset(Path(data_dir), yambda_config(tier), tables=tables)
        train, eval_ts = stream_plan(ds.num_windows(), 0, d.num_train_ts, d.eval_holdout_ts)
        remake = (
            f"write it with `ttt data synth-yambda --scale {d.synth_scale} --out DIR`"
            if d.synth_scale
            else d.how_to_make
        )
        if eval_ts >= ds.num_windows() or len(train) != d.num_train_ts:
            raise UserError(
                f"--data {data_dir} has {ds.num_windows()} day windows; the {tier.name} tier trains on "
                f"{d.num_train_ts} and holds out window {d.eval_holdout_ts}: {remake}"
            )
        n_train = ds.total_train_anchors(0, len(train))
        n_eval = len(ds.eval_holdout_indices(eval_ts))
        if n_train != d.train_samples or n_eval != tier.eval_samples:
            raise UserError(
                f"--data {data_dir} has {n_train:,} training and {n_eval:,} held-out anchors; the {tier.name} "
                f"tier reads {d.train_samples:,} and {tier.eval_samples:,}: {remake}"
            )
        return Resolved(ds, train, eval_ts, time.monotonic() - t0)

    def open(self, tier, resolved, seed, share, device):
        return _Stream(tier, resolved, share, device)

    def synthetic(self, tier, local_batch, generator, device):
        return _Synthetic(tier, local_batch, generator, device)

    def flops_per_sample(self, family, tier):
        """The reference's count at max_seq_len (DlrmHSTU.get_num_flops_per_sample): 315.7 GFLOP at the
        reference shape (README.MD:530-562)."""
        return family.flops_per_token(tier.model)

    def sample_items(self, tier):
        return "samples", 1
