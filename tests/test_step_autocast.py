"""`train.step.train_step` under bf16 autocast enters autocast once per optimizer step (each fp32 weight is
cast to bf16 once per step, from autocast's cache, instead of once per micro-batch): the loss and every
gradient equal those of one autocast context per micro-batch, the path it replaced (1e-5 fp32; bitwise on
this CPU)."""

import torch
from conftest import small_llama

from timetotrain.spec.registry import get
from timetotrain.train.step import train_step


def _model():
    bench = get("llama31_8b")
    m = bench.family.build(small_llama())
    bench.family.init(m, torch.Generator().manual_seed(0))
    return m


def _loss(model, mb):
    t = mb["tokens"]
    return model(t[:, :-1], labels=t[:, 1:])


def test_one_autocast_per_step_equals_one_per_micro_batch():
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    ref = _model()
    for mb in tokens.chunk(4):  # the replaced path: a context per micro-batch, the backward outside it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(ref, {"tokens": mb}) / 4
        loss.backward()
    model = _model()
    grads = {}

    class Capture(torch.optim.SGD):  # the step's gradients, before train_step zeroes them
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    opt = Capture(model.parameters(), lr=0.0)
    train_step(model, opt, {"tokens": tokens}, 4, _loss, None, list(model.parameters()), torch.bfloat16)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
