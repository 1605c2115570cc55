"""SparseAdagrad: row-sparse embedding updates equal the dense update over the whole table for 5 steps
(element-wise: torch.optim.Adagrad on a dense gradient; row-wise: FBGEMM's formula written by hand), rows
the batches never looked up stay bitwise unchanged, and dense parameters follow torch.optim.Adagrad."""

import pytest
import torch
import torch.nn.functional as F

from timetotrain.train.adagrad import SparseAdagrad

ROWS, DIM, LR, EPS = 40, 6, 0.05, 1e-8


def _lookups(step, rows=ROWS):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, rows // 2, (12,), generator=g)  # rows >= ROWS // 2 are never looked up
    ids[:3] = ids[3]  # a repeated id within the batch: its gradients are summed first
    offsets = torch.tensor([0, 3, 7, 9])
    target = torch.randn(4, DIM, generator=g)
    return ids, offsets, target


def _loss(w, step, sparse):
    ids, offsets, target = _lookups(step, w.shape[0])
    return (F.embedding_bag(ids, w, offsets, mode="sum", sparse=sparse) - target).pow(2).sum()


def _start(rows=ROWS):
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(0))


# 40 rows: 12 lookups a step take the row-sparse path; 8 rows: as many lookups as rows take the dense one.
@pytest.mark.parametrize("rows", [ROWS, 8])
def test_exact_sparse_equals_torch_dense_adagrad_for_5_steps(rows):
    ours = torch.nn.Parameter(_start(rows))
    ref = torch.nn.Parameter(_start(rows))
    opt = SparseAdagrad([ours], lr=LR, eps=EPS)
    ref_opt = torch.optim.Adagrad(
        [ref], lr=LR, eps=EPS, lr_decay=0, weight_decay=0, initial_accumulator_value=0
    )
    for step in range(5):
        for w, o, sparse in ((ours, opt, True), (ref, ref_opt, False)):
            o.zero_grad()
            _loss(w, step, sparse).backward()
            o.step()
        torch.testing.assert_close(ours.data, ref.data, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[ours]["sum"], ref_opt.state[ref]["sum"], rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.data[rows // 2 :], _start(rows)[rows // 2 :])


@pytest.mark.parametrize("rows", [ROWS, 8])
def test_rowwise_sparse_equals_the_dense_rowwise_formula_for_5_steps(rows):
    ours = torch.nn.Parameter(_start(rows))
    w = _start(rows)
    state = torch.zeros(rows)
    opt = SparseAdagrad([ours], lr=LR, eps=EPS, rowwise=True)
    for step in range(5):
        opt.zero_grad()
        _loss(ours, step, True).backward()
        opt.step()
        wd = w.clone().requires_grad_()
        _loss(wd, step, False).backward()
        g = wd.grad
        state += g.pow(2).mean(1)  # untouched rows: + 0
        w = w - LR * g / (state.sqrt() + EPS).unsqueeze(1)
        torch.testing.assert_close(ours.data, w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[ours]["sum"], state, rtol=1e-6, atol=1e-7)
    assert opt.state[ours]["sum"].shape == (rows,)  # one accumulator per row
    assert torch.equal(ours.data[rows // 2 :], _start(rows)[rows // 2 :])


def test_dense_parameters_follow_torch_adagrad_exactly():
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 3)
    b = torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt = SparseAdagrad(a.parameters(), lr=0.1)
    ref = torch.optim.Adagrad(b.parameters(), lr=0.1, eps=1e-8)
    for i in range(5):
        x = torch.randn(7, 5, generator=torch.Generator().manual_seed(i))
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_refuses_weight_decay_and_bad_constants():
    with pytest.raises(ValueError):
        SparseAdagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = SparseAdagrad([{"params": [p], "weight_decay": 0.1}], lr=0.1)
    p.grad = torch.ones(2)
    with pytest.raises(ValueError):
        opt.step()
