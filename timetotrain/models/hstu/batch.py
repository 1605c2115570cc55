"""The HSTU batch: per-sample features as the reference's Yambda dataset yields them
(dlrm_v4/datasets/yambda.py:958-1073, `_build_sample`: two KeyedJaggedTensors, the user's history and the
candidates), collated into flat (jagged) tensors with per-sample lengths.

A sample is a mapping `{feature name: (values, lengths)}` (numpy or torch, int64 ids and seconds), or a pair
of such mappings (history, candidates), as the reference builds its two KJTs; names the model does not read
are ignored (the dataset's `dummy_query_time`, `dummy_watch_time`, `item_dummy_watchtime`: the latter two feed
only regression tasks, and dlrmv4 has one binary task). `lengths` of a feature is its number of values for
the sample (an int or a one-element array)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from timetotrain.models.hstu.config import Features


@dataclass
class HSTUBatch:
    """B samples; T_u history events and T_c candidates over the batch, sample after sample."""

    uih_lengths: torch.Tensor  # [B] history events of each sample
    num_candidates: torch.Tensor  # [B] candidates of each sample
    contextual_ids: torch.Tensor  # [B, len(features.contextual)] row ids, one per contextual table
    uih_ids: torch.Tensor  # [T_u, len(features.sequence)] row ids of each event (item, artist, album)
    uih_actions: torch.Tensor  # [T_u] action bitmask of each event
    uih_timestamps: torch.Tensor  # [T_u] seconds
    candidate_ids: torch.Tensor  # [T_c, len(features.sequence)]
    candidate_actions: torch.Tensor  # [T_c] bitmask; the label is one of its bits
    query_times: torch.Tensor  # [T_c] seconds

    @property
    def size(self) -> int:
        return int(self.uih_lengths.shape[0])

    def to(self, device, non_blocking: bool = False) -> HSTUBatch:
        return HSTUBatch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )


def _merged(sample) -> Mapping:
    if isinstance(sample, Mapping):
        return sample
    uih, candidates = sample
    return {**uih, **candidates}


def _values(sample: Mapping, name: str, i: int) -> np.ndarray:
    if name not in sample:
        raise ValueError(f"sample {i} has no feature {name!r} (it has {sorted(sample)})")
    values, lengths = sample[name]
    values = np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values).reshape(-1)
    n = int(np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths).sum())
    if n != values.shape[0]:
        raise ValueError(f"sample {i} feature {name!r}: lengths say {n} values, it has {values.shape[0]}")
    return values.astype(np.int64, copy=False)


def collate(samples: Sequence, features: Features | None = None) -> HSTUBatch:
    """Per-sample feature mappings -> one HSTUBatch (the reference's KJT concatenation, key by key)."""
    features = features if features is not None else Features()
    if not samples:
        raise ValueError("collate needs at least one sample")
    ctx, uih_ids, cand_ids, uih_act, uih_ts, cand_act, query = [], [], [], [], [], [], []
    uih_len, cand_len = [], []
    for i, raw in enumerate(samples):
        s = _merged(raw)
        c = [_values(s, name, i) for name in features.contextual]
        if any(v.shape[0] != 1 for v in c):
            raise ValueError(f"sample {i}: each contextual feature has one value (the reference asserts it)")
        ctx.append(np.concatenate(c))
        hist = [_values(s, u, i) for u, _, _ in features.sequence]
        hist += [_values(s, features.action, i), _values(s, features.timestamp, i)]
        cand = [_values(s, c_name, i) for _, c_name, _ in features.sequence]
        cand += [_values(s, features.candidate_action, i), _values(s, features.query_time, i)]
        if len({v.shape[0] for v in hist}) != 1 or len({v.shape[0] for v in cand}) != 1:
            raise ValueError(f"sample {i}: history features (or candidate features) differ in length")
        if cand[0].shape[0] == 0:
            raise ValueError(f"sample {i} has no candidate: nothing to predict")
        uih_len.append(hist[0].shape[0])
        cand_len.append(cand[0].shape[0])
        uih_ids.append(np.stack(hist[:-2], axis=1))
        uih_act.append(hist[-2])
        uih_ts.append(hist[-1])
        cand_ids.append(np.stack(cand[:-2], axis=1))
        cand_act.append(cand[-2])
        query.append(cand[-1])

    def cat(parts):
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))

    return HSTUBatch(
        uih_lengths=torch.tensor(uih_len, dtype=torch.long),
        num_candidates=torch.tensor(cand_len, dtype=torch.long),
        contextual_ids=torch.from_numpy(np.stack(ctx)),
        uih_ids=cat(uih_ids),
        uih_actions=cat(uih_act),
        uih_timestamps=cat(uih_ts),
        candidate_ids=cat(cand_ids),
        candidate_actions=cat(cand_act),
        query_times=cat(query),
    )


def synthetic_samples(
    cfg, hist: Sequence[int], cands: Sequence[int], seed: int, id_share: float = 1.0
) -> list:
    """Random samples in the dataset's layout (`collate`'s input), for tests and benchmarks: `hist[i]` history
    events and `cands[i]` candidates for sample i, ids uniform over the first `id_share` of each table of
    `cfg` (an HSTUConfig), action bitmasks over 3 bits, timestamps increasing at Yambda's scale (~2e7 s), the
    candidates' query time after the last event."""
    rng = np.random.default_rng(seed)
    f, sizes = cfg.features, dict(cfg.tables)
    out = []
    for n, c in zip(hist, cands, strict=True):
        top = {name: max(int(rows * id_share), 1) for name, rows in sizes.items()}
        uih = {name: (rng.integers(0, top[name], 1), 1) for name in f.contextual}
        cand = {}
        for u, cn, table in f.sequence:
            uih[u] = (rng.integers(0, top[table], n), n)
            cand[cn] = (rng.integers(0, top[table], c), c)
        ts = 20_000_000 + np.cumsum(rng.integers(1, 200_000, n))
        uih[f.action], uih[f.timestamp] = (rng.integers(0, 8, n), n), (ts, n)
        cand[f.query_time] = (np.full(c, ts[-1] + 10), c)
        cand[f.candidate_action] = (rng.integers(0, 8, c), c)
        out.append((uih, cand))
    return out
