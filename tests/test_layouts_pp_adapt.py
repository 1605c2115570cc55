"""Pipeline parallelism (train/pipeline.py) with what adapts the model's training: LoRA fine-tuning and
float8, on gloo against one process through the harness's own build and step, 20 steps each at a 2-layer
Llama shape split into two stages of one layer, four micro-batches of one sample per step:

- llama2_70b_lora under `pp=2`: the frozen base loaded from a Hugging Face checkpoint into the stages, the
  adapters on qkv and proj drawn as one process draws them, only they trained (gradients and AdamW state),
  the answer-only loss of the task. The samples mask different prompt lengths, so a micro-batch's answer
  tokens differ from the next one's: the step's loss is the mean over micro-batches of each one's mean over
  its answer tokens, as the one-process step takes it (train/step.py), and a pipeline normalising otherwise
  (over the batch's answer tokens, say) fails here. Dropout 0: the stages run micro-batches in the
  schedule's order, so no pipeline draws one process's masks.
- llama31_8b under `pp=2` with `--precision fp8` (tensorwise, torchao's emulation on a CPU): every block
  linear of each stage in float8, as one process converts them. Bitwise: a stage runs the same float8
  casts on the same micro-batches, and the pipeline's gradient scaling (each micro-batch's mean loss, the
  summed gradients then divided by the 4 micro-batches) differs from one process's (each loss divided by 4
  before its backward) by a power of two, which neither fp32 rounding nor a dynamic float8 scale sees.
  Gradient clipping is off here: the norm is summed per stage and then over the stages, another order than
  one process's, and under float8 a last-bit difference in a weight flips some float8 roundings and grows
  (1.6e-3 relative in the loss after 20 clipped steps, measured); the clipped pipeline is held to rounding
  by the fp32 tests (LoRA here, tests/test_layouts_pp.py).

Each: the global train_loss and an evaluation, the first batch's gradients to the bit, and the final
trained weights (LoRA: at rtol 1e-5 and 1e-4, its clipped steps; fp8: to the bit); LoRA's base bit-equal to
the checkpoint's. Run as a script (by torchrun) this file is the
worker; it writes its losses per rank and rank 0 the gathered weights."""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import first_backward, layout_results_written, layout_run, small_llama

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.tasks.lora_sft import lm_block_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ = 20, 4, 32
CFG = small_llama(max_seq_len=SEQ + 1)
SCENARIOS = {"lora": "llama2_70b_lora", "fp8": "llama31_8b"}
BY_WORLD = {2: list(SCENARIOS)}


def tier(name: str):
    bench = get(SCENARIOS[name])
    t = bench.tier("tiny")
    if name == "lora":
        data = dataclasses.replace(t.data, block=SEQ + 1, dropout=0.0, vocab_keep=None)
    else:
        data = dataclasses.replace(t.data, seq_len=SEQ)
    return bench, dataclasses.replace(
        t, model=CFG, data=data, global_batch_size=GBS, micro_batch_size=1, lr=3e-3, warmup_steps=3,
        max_steps=100, base=None,
    )  # fmt: skip


def plan(name: str, world: int):
    from timetotrain.train import parallel

    fp8 = dict(precision="fp8", fp8_recipe="tensorwise", high="fp32") if name == "fp8" else {}
    return parallel.parse("pp=2" if world > 1 else None, world, **fp8)


def batches(data_rank: int, data_world: int) -> list[dict]:
    """Two random global batches in turn (memorised within 20 steps, so the loss falls); LoRA's labels
    mask a prompt of 3 to 24 tokens per sample, so the micro-batches hold different answer-token counts."""
    g = torch.Generator().manual_seed(3)
    two = []
    for _ in range(2):
        ids = torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g)
        prompt = torch.randint(3, 25, (GBS, 1), generator=g)
        labels = torch.where(torch.arange(SEQ + 1) < prompt, -100, ids)
        two.append({"ids": ids, "labels": labels})
    return [{k: v.chunk(data_world)[data_rank] for k, v in two[s % 2].items()} for s in range(STEPS)]


def loss_fn(name: str):
    if name == "lora":
        return lambda m, b: lm_block_loss(m, b["ids"], b["labels"])
    return lambda m, b: lm_loss(m, b["ids"], None)


def write_base(folder: Path) -> Path:
    """A random Llama of shape CFG as a Hugging Face checkpoint (non-unit norms: a norm loaded into the
    wrong place shows), the base both builds load."""
    from safetensors.torch import save_file

    from timetotrain.models.llama.hf import hf_export
    from timetotrain.models.llama.model import Llama

    torch.manual_seed(11)
    model = Llama(CFG)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if n.endswith("norm.weight") else p.normal_(0.0, 0.03)
    state, config = hf_export(model.state_dict(), CFG)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def train(name: str, world: int, rank: int, base: Path):
    """The global train_loss of every step and an evaluation's metric; this rank's first gradients, trained
    weights (adapters and base apart) and float8 linears; how many tensors the optimizer keeps state for."""
    from timetotrain.spec.task import evaluate_ratio
    from timetotrain.train.float8 import converted
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    p = plan(name, world)
    tr = build_training(bench, t, torch.device("cpu"), 7, p, init_checkpoint=base if name == "lora" else None)
    if name == "fp8":  # (module docstring: the gradient norm sums in another order over the stages)
        tr.clip = None
    accum = GBS // t.micro_batch_size
    mine = batches(0, 1)
    fn = loss_fn(name)
    first_backward(tr, mine[0], accum, fn)
    held = {n: q for n, q in tr.bare.named_parameters() if q.device.type != "meta"}  # else another stage's
    weights = {f"grad of {n}": q.grad.clone() for n, q in held.items() if q.requires_grad}
    # A frozen parameter has no gradient at all (not a zero one): nothing was computed for it.
    assert all(q.grad is None for q in held.values() if not q.requires_grad)
    tr.opt.zero_grad(set_to_none=True)
    losses = [tr.step(s, b, accum, fn)[0].item() for s, b in enumerate(mine)]
    for n, q in held.items():
        weights[n if q.requires_grad else f"base {n}"] = q.detach().clone()

    def sums(model, b):  # the loss sum and answer-token count of an eval micro-batch
        ids, labels = b
        return lm_block_loss(model, ids, labels, "sum"), int((labels[:, 1:] >= 0).sum())

    labels = mine[0]["labels"] if name == "lora" else mine[0]["ids"]
    chunks = zip(mine[0]["ids"].split(3), labels.split(3), strict=True)
    metric = evaluate_ratio(tr.model, chunks, sums, torch.device("cpu"), 1)
    facts = {
        "optimizer states": len(tr.opt.state),
        "trainable": sum(q.requires_grad for q in held.values()),
        "float8": converted(tr.bare),
    }
    return losses + [metric], weights, facts


@functools.cache
def one_process(name: str, base: Path):
    return train(name, 1, 0, base)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layouts_pp_adapt")
    write_base(folder / "base")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pipeline_adapted_trains_as_one_process(root, name):
    ranks, weights = layout_run(__file__, root, BY_WORLD, name)
    expected, final, facts = one_process(name, root / "base")
    exact = name == "fp8"  # unclipped: the same operations as one process's, so the same bits
    for r in ranks:
        assert r[name] == ranks[0][name]  # every rank reports the same global loss
        if exact:
            assert r[name] == expected
        torch.testing.assert_close(torch.tensor(r[name]), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-2] < expected[0] - 0.2  # it trained (the last figure is the evaluation's)
    got = weights[name]
    assert got.keys() == final.keys() and final
    for n, w in final.items():
        # The first batch's gradients to the bit (the loss normalised as one process normalises it), and
        # LoRA's frozen base: the checkpoint's. The trained weights after clipped steps to rounding.
        if exact or n.startswith(("grad of ", "base ")):
            torch.testing.assert_close(got[n], w, rtol=0, atol=0, msg=n)
        else:
            torch.testing.assert_close(got[n], w, rtol=1e-4, atol=1e-6, msg=n)
    stages = [r["facts"][name] for r in ranks]
    if name == "lora":
        # Only the adapters train: two per adapted linear (A and B), qkv and proj in each block.
        assert facts["trainable"] == facts["optimizer states"] == 2 * 2 * CFG.n_layers
        assert [s["optimizer states"] for s in stages] == [s["trainable"] for s in stages] == [4, 4]
        assert any(n.startswith("base ") for n in final)
    else:  # every block linear of each stage in float8, as in one process
        assert facts["float8"] == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj",
                                   "ffn.fc1", "ffn.fc2")]  # fmt: skip
        assert [len(s["float8"]) for s in stages] == [4, 4]
        assert sorted(stages[0]["float8"] + stages[1]["float8"]) == sorted(facts["float8"])


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {"facts": {}}, {}
    for name in BY_WORLD[world]:
        results[name], mine, results["facts"][name] = train(name, world, rank, out.parent / "base")
        every = [None] * world
        dist.all_gather_object(every, mine)
        weights[name] = {n: w for part in every for n, w in part.items()}
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
