"""Context parallelism (`--parallel cp=N`, train/context_parallel.py) on gloo against one process, through
the harness's own build and step (`train/step.py`), 20 steps each: train_loss at rtol 1e-5 and the final
trained weights.

- llama31_8b under `cp=2`: plain causal GQA attention, each rank holding chunks (c, 3 - c) of four;
- gpt_oss_20b under `cp=2`: its sliding-window layers with a window as wide as a chunk, so each rank's
  queries need keys from the other rank's chunk just before theirs, beside full-attention layers, MoE;
- deepseekv3_671b under `cp=2`: MLA, the sequence-wise aux loss (its expert counts summed over the
  group) and multi-token prediction, whose token i + 1 at a chunk's last position lives on the other rank;
- qwen3_5_moe (qwen35_397b_grpo's model, trained here as a causal LM) under `cp=2`: a Gated DeltaNet layer,
  whose state and conv window pass from chunk to chunk in sequence order (train/context_parallel_deltanet.py),
  then a gated attention layer with partial RoPE;
- llama31_8b under `cp=2,fsdp=2` (4 ranks): FSDP2 sharding over the flattened (fsdp, cp) ranks.

The end-of-document mask is on and the EOD ids are crowded into one chunk, so the ranks hold different
numbers of labelled tokens: a loss normalised by local counts would not match. Run as a script (by
torchrun) this file is the worker; it writes its losses per rank and rank 0 the gathered weights."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_trains_as_one_process,
    layout_results_written,
    layout_run,
    small_deepseek_v3,
    small_llama,
)

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ, EOD = 20, 4, 32, 3


def gpt_oss_cfg():
    from timetotrain.models.gpt_oss import GptOssConfig

    return GptOssConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, expert_ffn_dim=32,
        vocab_size=128, max_seq_len=SEQ, sliding_window=8, init_std=0.05,
    )  # fmt: skip


def qwen_cfg():
    from timetotrain.models.qwen3_5_moe.config import Qwen35MoeConfig

    return Qwen35MoeConfig(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8,
        lin_v_dim=6, n_experts=4, top_k=2, expert_ffn_dim=16, shared_ffn_dim=16, vocab_size=128,
        max_seq_len=SEQ, full_attention_interval=2,
    )  # fmt: skip


# name -> (benchmark, model config, --parallel); by the world size that runs it. "qwen": qwen35_397b_grpo's
# model (a Gated DeltaNet layer, then a gated attention one) trained as a causal LM, llama31_8b's task (GRPO's
# whole-logits log-probabilities are not built under cp).
SCENARIOS = {
    "llama": ("llama31_8b", lambda: small_llama(max_seq_len=SEQ), "cp=2"),
    "gpt_oss": ("gpt_oss_20b", gpt_oss_cfg, "cp=2"),
    "deepseek": ("deepseekv3_671b", small_deepseek_v3, "cp=2"),
    "qwen": ("llama31_8b", qwen_cfg, "cp=2"),
    "llama_fsdp": ("llama31_8b", lambda: small_llama(max_seq_len=SEQ), "cp=2,fsdp=2"),
}
BY_WORLD = {2: ["llama", "gpt_oss", "deepseek", "qwen"], 4: ["llama_fsdp"]}
# The final weights' absolute tolerance. DeepSeek's router weights and the embedding row of MTP's fill id get
# gradients near zero, where rounding flips their sign and Adam turns either sign into a step of about lr:
# 20 steps leave ~1e-3 between summation orders. Its first step's gradients agree at 1e-5 of each
# tensor's largest, and its 20 losses at rtol 1e-5.
WEIGHT_ATOL = {"deepseek": 2e-3, "qwen": 2e-5}
# qwen: the DeltaNet recurrence under cp composes per-chunk affine maps (train/context_parallel_deltanet.py),
# another rounding of the same sums; its decay parameters' gradients are ~1e-5, which Adam scales up. Its
# losses agree at rtol 1e-5, its weights within 1e-5 (seen: 7e-6).


def tier(name: str):
    bench_name, cfg, _ = SCENARIOS[name]
    bench = get(bench_name)
    if name == "qwen":
        from timetotrain.models.qwen3_5_moe import FAMILY

        bench = dataclasses.replace(bench, family=FAMILY)
    t = bench.tier("tiny")
    return bench, dataclasses.replace(
        t, model=cfg(), data=dataclasses.replace(t.data, seq_len=SEQ), global_batch_size=GBS,
        micro_batch_size=GBS, lr=3e-3, warmup_steps=3, max_steps=100, base=None,
    )  # fmt: skip


def batches(vocab: int, data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn (memorised within 20 steps, so the loss falls), with EOD ids
    crowded into the first quarter of samples 0 and 2: CP rank 0 holds more masked positions than rank 1.
    Each half of the batch holds as many as the other: data-parallel ranks average their means, which
    equals one process's token mean only at equal counts (as for every dp layout)."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(4, vocab, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    for b in two:
        b[0::2, 1:7] = EOD
        b[1::2, 12] = EOD
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


@functools.cache  # the one-process runs, once per session
def train(name: str, plan, rank: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The global train_loss of every step and the trained weights gathered whole (every rank calls)."""
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    steps = enumerate(batches(t.model.vocab_size, plan.data_rank(rank), plan.data_parallel))
    losses = [tr.step(s, {"ids": b}, 1, lambda m, b: lm_loss(m, b["ids"], EOD))[0].item() for s, b in steps]
    return losses, trained_weights(tr.bare)


def trained_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_context_parallel_trains_as_one_process(tmp_path_factory, name):
    from timetotrain.train.parallel import Plan

    ranks, weights = layout_run(__file__, tmp_path_factory.getbasetemp() / "layouts_cp", BY_WORLD, name)
    expected, final = train(name, Plan())
    assert_trains_as_one_process(ranks, weights, name, expected, final, WEIGHT_ATOL.get(name, 1e-6))


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {}, {}
    for name in BY_WORLD[world]:
        plan = parallel.parse(SCENARIOS[name][2], world)
        results[name], weights[name] = train(name, plan, rank)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_head_tail_chunks():
    from timetotrain.train.context_parallel import head_tail_positions

    assert head_tail_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert head_tail_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # every rank the same share of the causal triangle: sum over its positions of (p + 1) keys
    shares = {int((head_tail_positions(64, 4, c) + 1).sum()) for c in range(4)}
    assert len(shares) == 1
    whole = torch.cat([head_tail_positions(24, 3, c) for c in range(3)]).sort().values
    assert whole.tolist() == list(range(24))


@pytest.mark.bad_input
def test_cp_refusals():
    from timetotrain.errors import UserError
    from timetotrain.train import context_parallel, parallel

    llama = get("llama31_8b")
    t = llama.tier("tiny")
    for spec, world, bench, needle in [
        ("cp=2,tp=2", 4, get("gpt_oss_20b"), "built for the llama family"),
        ("cp=3", 3, llama, "does not divide"),
        ("cp=2", 2, get("flux1"), "no context-parallel attention"),
        ("cp=2", 2, get("llama2_70b_lora"), "this benchmark's data has none"),
    ]:
        plan = parallel.parse(spec, world)
        with pytest.raises(UserError, match=needle) as e:
            context_parallel.check(bench, bench.tier("tiny") if bench is not llama else t, plan, spec)
        assert "\n" not in str(e.value)
