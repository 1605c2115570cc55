"""`--parallel ep=2,fsdp=2` on gloo (2 processes) against 1 process, through the harness's own build and step
(`train/step.py`): the experts split over the same 2 ranks FSDP2 shards the rest of the model over.

- deepseekv3_671b (MLA, group-limited routing with the bias update, a shared expert, a dense first layer,
  MTP, the sequence aux loss) and gpt_oss_20b, from the seed: the initial weights are bit-equal (each rank's
  expert slice is the one-process model's rows; FSDP2's shards gather to the whole tensors), train_loss is
  equal at rtol 1e-5 over 10 steps, so is the gradient norm clipping uses at every step (FSDP2's gradient
  shards and the expert slices summed over the ranks), the router biases are identical on every rank and
  as in one process, and the expert-load telemetry counts the global batch on every rank;
- deepseekv3_671b from a Hugging Face checkpoint (`hf_export` of a model) and from a ttt checkpoint of the
  same model: the same losses as one process loading the HF one;
- bf16 with activation checkpointing: trains, the expert slices stay fp32 masters, losses near fp32's.

One process with two micro-batches, two ranks with one each, so the same per-micro-batch means are taken.
One spawn serves every test (process start-up dominates); the one-process references run in the parent."""

import contextlib
import dataclasses
import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import small_deepseek_v3

import timetotrain.train.expert_parallel as expert_parallel
from timetotrain.models.gpt_oss import GptOssConfig
from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.train.parallel import Plan
from timetotrain.train.step import build_training

pytestmark = pytest.mark.distributed

WORLD, STEPS, LOAD_STEPS, BF16_STEPS = 2, 10, 3, 4
DS, GPT = get("deepseekv3_671b"), get("gpt_oss_20b")
DS_CFG = small_deepseek_v3()
GPT_CFG = GptOssConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, expert_ffn_dim=24,
    vocab_size=64, max_seq_len=16, sliding_window=4, init_std=0.1,
)  # fmt: skip


def _tier(bench, cfg):
    tiny = bench.tier("tiny")
    return dataclasses.replace(
        tiny, model=cfg, data=dataclasses.replace(tiny.data, seq_len=cfg.max_seq_len), global_batch_size=8,
        micro_batch_size=4, lr=1e-2, warmup_steps=1, max_steps=50, base=None,
    )  # fmt: skip


TIERS = {"ds": (DS, _tier(DS, DS_CFG)), "gpt": (GPT, _tier(GPT, GPT_CFG))}


def _tokens(cfg) -> torch.Tensor:
    # One batch, seen every step: the loss then falls, so the comparison is of a model that trains.
    return torch.randint(
        0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(1)
    )


def _loss(model, batch):
    return lm_loss(model, batch["tokens"], None)


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as its whole tensor: FSDP2 shards and expert slices gathered (collectives)."""
    from torch.distributed.tensor import DTensor

    experts = {_clean(n): t for n, t in expert_parallel.expert_dtensors(model).items()}
    out = {}
    for n, p in model.named_parameters():
        t = experts.get(_clean(n), p)
        out[_clean(n)] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


@contextlib.contextmanager
def _recording_norms(norms: list):
    """Record the gradient norm each step clips by (one process: clip_grad_norm_; EP: clip_grad_norm_ep)."""
    real_ep, real_one = expert_parallel.clip_grad_norm_ep, torch.nn.utils.clip_grad_norm_

    def ep(*args, **kwargs):
        norms.append(real_ep(*args, **kwargs).item())
        return norms[-1]

    def one(*args, **kwargs):
        norms.append(real_one(*args, **kwargs).item())
        return norms[-1]

    expert_parallel.clip_grad_norm_ep, torch.nn.utils.clip_grad_norm_ = ep, one
    try:
        yield
    finally:
        expert_parallel.clip_grad_norm_ep, torch.nn.utils.clip_grad_norm_ = real_ep, real_one


def _train(family: str, plan: Plan, rank: int, steps: int, init=None, weights: bool = False) -> dict:
    bench, tier = TIERS[family]
    torch.manual_seed(0)
    tr = build_training(bench, tier, torch.device("cpu"), seed=3, plan=plan, init_checkpoint=init)
    out = {"weights": _full_state(tr.bare)} if weights else {}
    tokens = _tokens(tier.model).chunk(plan.world)[rank]
    accum = tier.global_batch_size // plan.world // tier.micro_batch_size
    losses, norms = [], []
    with _recording_norms(norms):
        for step in range(1, steps + 1):
            losses.append(tr.step(step, {"tokens": tokens}, accum, _loss)[0].item())
    routers = getattr(tr.bare, "routers", None)
    experts = [p for p in tr.bare.parameters() if expert_parallel.is_expert_sharded(p)]
    return {
        **out,
        "loss": losses,
        "norm": norms,
        "bias": torch.stack([r.bias for r in routers()]).tolist() if routers else None,
        "counts": tr.bare.tokens_per_expert().tolist(),
        "expert_dtypes": sorted({str(p.dtype) for p in experts}),
        "n_experts_local": [p.shape[0] for p in experts],
        # Expert elements this rank stores (FSDP2's shard of a slice sharded over its replicas), and those of
        # the whole model's experts.
        "expert_numel": sum(getattr(p, "_local_tensor", p).numel() for p in experts),
        "expert_numel_whole": sum(expert_parallel.expert_slice(p)[0] * p.shape[1:].numel() for p in experts),
    }


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    plan = Plan(fsdp=WORLD, ep=WORLD)
    try:
        res = {
            "ds": _train("ds", plan, rank, STEPS, weights=True),
            "gpt": _train("gpt", plan, rank, STEPS, weights=True),
            "ds hf": _train("ds", plan, rank, LOAD_STEPS, init=root / "hf"),
            "ds ttt": _train("ds", plan, rank, LOAD_STEPS, init=root / "ttt"),
            "ds bf16 ac": _train(
                "ds",
                dataclasses.replace(plan, precision="bf16", activation_checkpointing=True),
                rank,
                BF16_STEPS,
            ),
        }
        torch.save(res, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def write_bases(root: Path) -> None:
    """A base to continue from: another seed's model, as a Hugging Face folder (`root / "hf"`) and as a ttt
    checkpoint (`root / "ttt"`)."""
    from safetensors.torch import save_file

    from timetotrain.train.checkpoint import save_checkpoint

    bench, tier = TIERS["ds"]
    base = build_training(bench, tier, torch.device("cpu"), seed=11).bare
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # far from any seed's init, routing biases set: the loaded model is recognisable
        for p in base.parameters():
            p.mul_(2.0)
        for r in base.routers():
            r.bias.normal_(0.0, 0.05, generator=gen)
    state, config = bench.family.hf_export({k: v.detach() for k, v in base.state_dict().items()}, tier.model)
    (root / "hf").mkdir()
    save_file(state, root / "hf" / "model.safetensors", metadata={"format": "pt"})
    (root / "hf" / "config.json").write_text(json.dumps(config))
    save_checkpoint(root / "ttt", base, None, step=0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-fsdp")
    torch.set_num_threads(1)
    write_bases(root)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(str(root),), nprocs=WORLD, join=True)
    single = {
        "ds": _train("ds", Plan(), 0, STEPS, weights=True),
        "gpt": _train("gpt", Plan(), 0, STEPS, weights=True),
        "ds hf": _train("ds", Plan(), 0, LOAD_STEPS, init=root / "hf"),
    }
    return single, [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]


def _close(got, want, rtol=1e-5):
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=rtol, atol=0
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ds", "gpt"])
def test_ep_fsdp_trains_as_one_process(results, family):
    single, ranks = results
    one = single[family]
    assert one["loss"][-1] < one["loss"][0]  # it trains
    n_experts = TIERS[family][1].model.n_experts
    for rank, res in enumerate(ranks):
        two = res[family]
        assert two["n_experts_local"] and set(two["n_experts_local"]) == {n_experts // WORLD}
        # Initial weights: bit-equal, experts included (each rank drew the whole stack and kept its rows).
        assert two["weights"].keys() == one["weights"].keys()
        for name, t in one["weights"].items():
            assert torch.equal(two["weights"][name], t), (rank, name)
        _close(two["loss"], one["loss"])
        _close(two["norm"], one["norm"])  # the global norm: FSDP2 shards + expert slices over the ranks
        # Telemetry: global counts, the same on both ranks (every token's k copies per MoE layer).
        assert two["counts"] == ranks[0][family]["counts"]
        top_k = TIERS[family][1].model.top_k
        assert all(sum(layer) == 8 * TIERS[family][1].model.max_seq_len * top_k for layer in two["counts"])
    worst = {
        k: max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r[family][k], one[k], strict=True))
        for k in ("loss", "norm")
    }
    print(
        f"{family}: loss {one['loss'][0]:.4f} -> {one['loss'][-1]:.4f}, norms {min(one['norm']):.3f}..{max(one['norm']):.3f}, "
        f"largest relative difference of ep=2,fsdp=2: loss {worst['loss']:.1e}, norm {worst['norm']:.1e}"
    )
    if family == "ds":
        for res in ranks:  # the balancing biases moved, identically on every rank and as in one process
            bias = torch.tensor(res["ds"]["bias"])
            assert bias.abs().sum() > 0
            torch.testing.assert_close(bias, torch.tensor(one["bias"]), rtol=0, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ds hf", "ds ttt"])
def test_ep_fsdp_loads_a_checkpoint(results, case):
    single, ranks = results
    for res in ranks:
        _close(res[case]["loss"], single["ds hf"]["loss"])
        print(case, res[case]["loss"], single["ds hf"]["loss"])
    # Not the seed's model: the checkpoint's.
    assert abs(ranks[0][case]["loss"][0] - single["ds"]["loss"][0]) > 1e-3


@pytest.mark.slow
def test_ep_fsdp_bf16_with_activation_checkpointing(results):
    single, ranks = results
    fp32 = single["ds"]["loss"][:BF16_STEPS]
    for res in ranks:
        bf16 = res["ds bf16 ac"]
        assert bf16["expert_dtypes"] == ["torch.float32"]  # fp32 masters; the matmuls run under autocast
        assert bf16["loss"] == ranks[0]["ds bf16 ac"]["loss"]
        _close(bf16["loss"], fp32, rtol=2e-2)
        print("bf16 + AC", bf16["loss"], "fp32", fp32)
        assert bf16["loss"][-1] < bf16["loss"][0]


def test_parse_ep_with_fsdp():
    from timetotrain.errors import UserError
    from timetotrain.train import parallel

    plan = parallel.parse("ep=4,fsdp=4", 4)
    assert (plan.ep, plan.fsdp, plan.dp, plan.world, plan.data_parallel, plan.sharded) == (
        4,
        4,
        1,
        4,
        4,
        True,
    )
    assert plan.describe().startswith("fsdp=4, ep=4")
    hybrid = parallel.parse("ep=2,fsdp=4", 4)  # the expert-data-parallel hybrid (tests/test_ep_hybrid.py)
    assert (hybrid.ep, hybrid.fsdp, hybrid.world, hybrid.data_parallel) == (2, 4, 4, 4)
    for spec, world, needle in [
        ("ep=3,fsdp=4", 4, "ep must divide fsdp .* a multiple of E"),
        ("ep=4,fsdp=2", 2, "ep must divide fsdp"),
        ("ep=2,fsdp=2,dp=2", 4, "for dp x fsdp use HSDP"),
        ("ep=2,tp=2,dp=2", 4, "tp does not combine with dp"),
    ]:
        with pytest.raises(UserError, match=needle):
            parallel.parse(spec, world)
