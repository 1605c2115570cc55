"""Exact area under the ROC curve, over every score, with ties counted as half (the Mann-Whitney U
statistic): what torchmetrics' binary AUROC (the reference's metric, dlrm_main.py:392) and
sklearn.metrics.roc_auc_score compute from the whole ROC curve. No binning, no approximation."""

from __future__ import annotations

import torch
import torch.distributed as dist


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC of `scores` (any monotone transform of the predicted probability) for 0/1 `labels`: the mean
    rank of the positives among all scores, tied scores sharing their average rank, in fp64. NaN when one
    class is absent."""
    scores = scores.reshape(-1)
    labels = labels.reshape(-1).to(torch.float64)
    if scores.numel() != labels.numel():
        raise ValueError("one label per score")
    pos = labels.sum()
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    values, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    # Ranks 1..N in ascending order; a group of c tied scores starting after s smaller ones has the
    # average rank s + (c + 1) / 2.
    counts = counts.to(torch.float64)
    before = torch.cumsum(counts, 0) - counts
    avg_rank = before + (counts + 1) / 2
    pos_in_group = torch.zeros_like(counts).index_add_(0, inverse, labels)
    rank_sum = (pos_in_group * avg_rank).sum()
    return float((rank_sum - pos * (pos + 1) / 2) / (pos * neg))


def gather(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's 1-D `t` (their lengths may differ by some rows), concatenated in rank order, on every
    rank: the exact AUC needs every score."""
    if world == 1:
        return t
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    most = int(max(s.item() for s in sizes))
    padded = torch.zeros(most, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
