"""Expert parallelism on 2 CPU processes (gloo) against one process on the concatenated batch: the MoE layer
(outputs, gradients, telemetry; uneven routing, a rank receiving nothing) and 5 AdamW steps of a tiny model
with DDP over the replicated parameters and global-norm clipping.

One spawn serves every test (process start-up dominates): the workers compute the single-process
references and the EP results, and write relative errors and curves for the tests to check."""

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from timetotrain.models.common.moe import MoE, TopKRouter
from timetotrain.models.gpt_oss import GptOss, GptOssConfig
from timetotrain.train.expert_parallel import (
    apply_expert_parallel,
    clip_grad_norm_ep,
    expert_sharded_names,
    ignore_experts_in_ddp,
    is_expert_sharded,
)
from timetotrain.train.optim import build_adamw

WORLD = 2
TOL = 1e-5
STEPS = 5
CFG = GptOssConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    n_experts=4,
    top_k=2,
    expert_ffn_dim=24,
    vocab_size=64,
    max_seq_len=16,
    sliding_window=4,
    init_std=0.1,
)
TOKENS = 12  # per rank, layer tests
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
]  # the shared fixture spawns 2 gloo processes (several seconds)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest deviation relative to the reference's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# --- layer ---------------------------------------------------------------------------------------------------


def _layer_case(avoid: list[list[int]]) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """A layer and a global batch whose rank-r tokens never pick the experts in `avoid[r]`.

    Router rows are orthonormal (times 2), so pushing a token against row e lowers only logit e."""
    gen = torch.Generator().manual_seed(0)
    moe = MoE(
        TopKRouter(CFG.dim, CFG.n_experts, CFG.top_k), CFG.n_experts, CFG.top_k, CFG.dim, CFG.expert_ffn_dim
    )
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(CFG.dim, CFG.n_experts, generator=gen))
        moe.router.weight.copy_(2 * q.T)
        moe.experts.w1.normal_(0.0, 0.2, generator=gen)
        moe.experts.w2.normal_(0.0, 0.2, generator=gen)
    x = torch.randn(WORLD * TOKENS, CFG.dim, generator=gen)
    for r, experts in enumerate(avoid):
        part = x[r * TOKENS : (r + 1) * TOKENS]
        for e in experts:
            row = q[:, e]
            part -= (part @ row).unsqueeze(1) * row + 3.0 * row
    return moe, x, torch.randn(x.shape, generator=gen)


def _layer_errors(rank: int, avoid: list[list[int]], grouped_mm: bool | None = None) -> dict:
    moe, x, cotangent = _layer_case(avoid)
    moe.experts.use_grouped_mm = grouped_mm  # None: grouped_mm where the probe allows, else the loop
    # Reference: one layer, whole batch, the global loss = mean over ranks of each rank's token-mean loss.
    ref = copy.deepcopy(moe)
    xr = x.clone().requires_grad_(True)
    (ref(xr) * cotangent).sum().div(WORLD * TOKENS).backward()
    ref_out = ref(x).detach()

    apply_expert_parallel(moe)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    xl = x[mine].clone().requires_grad_(True)
    out = moe(xl)
    (out * cotangent[mine]).sum().div(TOKENS).backward()  # this rank's loss: mean over its tokens
    router = moe.router.weight.grad.clone()
    dist.all_reduce(router)  # what DDP does to a replicated parameter: the average over ranks
    local = CFG.n_experts // WORLD
    experts = slice(rank * local, (rank + 1) * local)
    return {
        "output": rel(out.detach(), ref_out[mine]),
        # d(global)/d(x_local) = d(rank loss)/d(x_local) / WORLD: exact for WORLD = 2.
        "grad input": rel(xl.grad / WORLD, xr.grad[mine]),
        "grad router": rel(router / WORLD, ref.router.weight.grad),
        "grad w1": rel(moe.experts.w1.grad, ref.experts.w1.grad[experts]),
        "grad w2": rel(moe.experts.w2.grad, ref.experts.w2.grad[experts]),
        "w1 shape": tuple(moe.experts.w1.shape),
        "counts": moe.tokens_per_expert.tolist(),
        "ref counts": ref.tokens_per_expert.tolist(),
        "rank0 counts": _rank_counts(ref, x[:TOKENS]),
        "zero expert grads": bool(
            moe.experts.w1.grad.abs().max() == 0 and moe.experts.w2.grad.abs().max() == 0
        ),
    }


def _rank_counts(moe: MoE, x: torch.Tensor) -> list[int]:
    with torch.no_grad():
        _, ids = moe.router(x)
    return torch.bincount(ids.flatten(), minlength=CFG.n_experts).tolist()


# --- model + optimizer -------------------------------------------------------------------------------------


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=gen) for _ in range(STEPS)]


def _model() -> GptOss:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return GptOss(CFG)


def _adamw(model) -> torch.optim.Optimizer:
    return build_adamw(model, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _single_run() -> dict:
    model = _model()
    opt = _adamw(model)
    losses, norms = [], []
    for tokens in _batches():
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"loss": losses, "norm": norms, "counts": model.tokens_per_expert().tolist()}


def _ep_run(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    # The wiring a training loop uses with ep = dp = world: a dedicated EP group, DDP over the rest.
    ep_group = dist.new_group(list(range(WORLD)))
    apply_expert_parallel(model, ep_group)
    names = expert_sharded_names(model)
    ignore_experts_in_ddp(model)
    ddp = DDP(model)
    opt = _adamw(model)  # after sharding: it must hold the slices
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    for tokens in _batches():
        mb = tokens.chunk(WORLD)[rank]
        loss = F.cross_entropy(ddp(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
        loss.backward()
        norms.append(clip_grad_norm_ep(params, 1.0, ep_group).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach() / WORLD
        dist.all_reduce(total)
        losses.append(total.item())
    return {
        "loss": losses,
        "norm": norms,
        "counts": model.tokens_per_expert().tolist(),
        "sharded": names,
        "n_sharded": sum(is_expert_sharded(p) for p in params),
    }


# --- harness -----------------------------------------------------------------------------------------------


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        res = {
            # Rank 0's tokens skip expert 3 (rank 1's), rank 1's skip experts 0 and 1: rank 1 sends rank 0
            # nothing, expert 3 gets no token from rank 0.
            "uneven": _layer_errors(rank, [[3], [0, 1]]),
            "uneven, loop": _layer_errors(rank, [[3], [0, 1]], grouped_mm=False),
            # Nobody picks experts 2 or 3: rank 1 receives no rows at all.
            "idle rank": _layer_errors(rank, [[2, 3], [2, 3]]),
            "ep": _ep_run(rank),
        }
        if rank == 0:
            res["single"] = _single_run()
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("case", ["uneven", "uneven, loop", "idle rank"])
def test_layer_matches_single_process(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        for key in ("output", "grad input", "grad router", "grad w1", "grad w2"):
            assert r[key] <= TOL, (case, rank, key, r[key])
        assert r["w1 shape"] == (CFG.n_experts // WORLD, 2 * CFG.expert_ffn_dim, CFG.dim)
        # Telemetry: the global counts, on every rank, as one process counts them.
        assert r["counts"] == r["ref counts"]
    uneven = results[0]["uneven"]
    assert uneven["rank0 counts"][3] == 0 and uneven["ref counts"][3] > 0  # expert 3: none from rank 0
    assert sum(uneven["ref counts"][:2]) == uneven["rank0 counts"][0] + uneven["rank0 counts"][1]
    idle = results[1]["idle rank"]
    assert idle["counts"][2:] == [0, 0] and idle["zero expert grads"]


def test_training_matches_single_process(results):
    single = torch.tensor(results[0]["single"]["loss"], dtype=torch.float64)
    ref_norm = torch.tensor(results[0]["single"]["norm"], dtype=torch.float64)
    assert ref_norm[0] > 1.0  # clipping engages
    for res in results:
        ep = res["ep"]
        assert res["ep"]["n_sharded"] == 2 * CFG.n_layers
        assert ep["sharded"] == [
            f"layers.{i}.ffn.experts.{w}" for i in range(CFG.n_layers) for w in ("w1", "w2")
        ]
        loss = torch.tensor(ep["loss"], dtype=torch.float64)
        norm = torch.tensor(ep["norm"], dtype=torch.float64)
        assert len(loss) == STEPS
        assert ((loss - single).abs() / single.abs()).max() <= TOL, (loss.tolist(), single.tolist())
        assert ((norm - ref_norm).abs() / ref_norm.abs()).max() <= TOL, (norm.tolist(), ref_norm.tolist())
        assert ep["counts"] == results[0]["single"]["counts"]
