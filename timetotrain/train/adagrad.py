"""Adagrad with row-sparse updates for embedding tables, as the DLRM-DCNv2 reference trains them.

The reference (recommendation_v2/torchrec_dlrm/dlrm_main.py:786-801) hands `torch.optim.Adagrad` with
lr and eps=1e-8 to `apply_optimizer_in_backward` for the embeddings; TorchRec 0.3.2 maps that class to
FBGEMM's `EmbOptimType.EXACT_ADAGRAD` (torchrec/distributed/utils.py:249), as the reference's own comment
says (dlrm_main.py:789): one accumulator per *element*, applied once per step to each row the batch looked
up, after the gradients of repeated ids are summed ("exact"). lr_decay, weight_decay and the initial
accumulator are 0, fixed inside FBGEMM 0.3.2 (dlrm_main.py:792-793). The dense parameters get
`torch.optim.Adagrad(lr, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-8)`
(dlrm_main.py:828-837). So for every parameter:

    state += g * g;   p -= lr * g / (sqrt(state) + eps)

A row the batch did not touch has g = 0 there, so the dense formula leaves it (and its state) unchanged:
updating only the touched rows is the same optimizer, without reading 40M-row tables every step.

`rowwise=True` is FBGEMM's EXACT_ROWWISE_ADAGRAD (torchrec.optim.RowWiseAdagrad), what many DLRM
submissions use to save memory: one accumulator per row, the mean of the squared gradient over the row,

    state[r] += mean_d(g[r, d]^2);   p[r] -= lr * g[r] / (sqrt(state[r]) + eps)

Only gradients that are sparse tensors (FusedEmbeddingBag's) take the row path; dense gradients take
torch.optim.Adagrad's element-wise update with its exact operations (addcmul, sqrt, add eps, addcdiv).
"""

from __future__ import annotations

import torch


class SparseAdagrad(torch.optim.Optimizer):
    def __init__(self, params, lr: float, eps: float = 1e-8, rowwise: bool = False):
        if lr <= 0 or eps < 0:
            raise ValueError(f"Adagrad needs lr > 0 and eps >= 0, got lr={lr} eps={eps}")
        super().__init__(params, {"lr": lr, "eps": eps, "rowwise": rowwise, "weight_decay": 0.0})

    def _state_sum(self, p: torch.Tensor, rowwise: bool) -> torch.Tensor:
        st = self.state[p]
        if "sum" not in st:  # initial_accumulator_value = 0
            shape = p.shape[:1] if rowwise else p.shape
            st["sum"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        return st["sum"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("weight_decay", 0.0):
                raise ValueError("SparseAdagrad has no weight decay (the reference's is 0)")
            lr, eps, rowwise = group["lr"], group["eps"], group["rowwise"]
            dense_p, dense_g, dense_s = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    self._sparse_update(p, p.grad, lr, eps, rowwise)
                else:
                    dense_p.append(p)
                    dense_g.append(p.grad)
                    dense_s.append(self._state_sum(p, rowwise=False))
            if dense_p:
                torch._foreach_addcmul_(dense_s, dense_g, dense_g, value=1.0)
                std = torch._foreach_sqrt(dense_s)
                torch._foreach_add_(std, eps)
                torch._foreach_addcdiv_(dense_p, dense_g, std, value=-lr)
        return loss

    def _sparse_update(self, p, grad, lr, eps, rowwise) -> None:
        if grad._nnz() >= p.shape[0]:
            # As many lookups as the table has rows (a small table): summing them into a dense gradient and
            # updating every row is cheaper than sorting them, and the same update (up to the rounding of
            # the summed duplicates, measured at 1 ulp): a row not looked up has g = 0, so its state gains
            # exactly 0 and its weight moves by -lr * 0.
            self._dense_update(p, grad.to_dense(), lr, eps, rowwise)
            return
        g = grad.coalesce()  # repeated ids summed: one update per touched row ("exact")
        rows, vals = g.indices()[0], g.values()
        state = self._state_sum(p, rowwise)
        if rowwise:
            s = state.index_select(0, rows) + vals.pow(2).mean(1)
            state.index_copy_(0, rows, s)
            step = vals / (s.sqrt() + eps).unsqueeze(1)
        else:
            s = state.index_select(0, rows).addcmul_(vals, vals)
            state.index_copy_(0, rows, s)
            step = vals / s.sqrt().add_(eps)
        p.index_add_(0, rows, step, alpha=-lr)

    def _dense_update(self, p, g, lr, eps, rowwise) -> None:
        state = self._state_sum(p, rowwise)
        if rowwise:
            state.add_(g.pow(2).mean(1))
            p.addcdiv_(g, (state.sqrt() + eps).unsqueeze(1), value=-lr)
        else:
            state.addcmul_(g, g)
            p.addcdiv_(g, state.sqrt().add_(eps), value=-lr)
