"""Exact AUC (tasks/auc.py) equals sklearn.metrics.roc_auc_score on 10^5 random scores with many ties, and
the rank formula by hand on small cases; the gather keeps every rank's scores."""

import pytest
import torch
from conftest import require

from timetotrain.tasks.auc import auc, gather


def test_equals_sklearn_on_1e5_scores_with_ties():
    metrics = require("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    n = 100_000
    labels = (torch.rand(n, generator=g) < 0.3).float()
    # Scores rounded to 1/100: about 1,000 samples share each value, both classes in most groups.
    scores = (torch.rand(n, generator=g) + 0.3 * labels).mul(100).round().div(100)
    assert len(torch.unique(scores)) < 200
    ours = auc(scores, labels)
    theirs = metrics.roc_auc_score(labels.numpy(), scores.numpy())
    assert ours == pytest.approx(theirs, abs=1e-12)
    # Any monotone transform of the scores leaves it (logits instead of probabilities).
    assert auc(torch.exp(3 * scores.double()) - 7, labels) == pytest.approx(ours, abs=1e-12)


def test_small_cases_by_hand():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # a tie counts half
    assert auc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    assert auc(torch.tensor([0.2, 0.3]), torch.tensor([1, 1])) != auc(torch.tensor([0.2]), torch.tensor([1]))


def test_gather_on_one_rank_is_the_tensor():
    t = torch.arange(5.0)
    assert gather(t, 1) is t
