"""Gated DeltaNet under context parallelism (train/context_parallel_deltanet.py) on gloo against one process: the
layer and the bare rule over the head-tail chunks (rank c holds chunks c and 2N-1-c), gathered back to sequence
order, equal the single-process output (fp32), and so do the gradients of the inputs and of every weight; and so
does a whole DeltaNet block (norm, layer, MoE) with its layer swapped by `context_parallel`, as the harness does.

ONE torchrun of 4 ranks: CP over all 4 (ranks 1 and 2 are middle ranks, whose state and halo come from and go
to other ranks both ways), then CP over two groups of 2 consecutive ranks side by side (the harness's CP groups,
group ranks not global ranks). Chunks of 75 tokens (not a multiple of DELTANET_CHUNK, so the CP borders are not
the 64-token borders of the single-process rule) and of 2 tokens (shorter than the conv window of 3, which then
spans two chunks). Weak decays, so that the state handed on matters: the same comparison with the incoming
states replaced by zeros, or the conv halo by zeros, fails by far (the test checks that it does).

Run as a script (by torchrun) this file is the worker: every rank writes the relative errors of every case."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from forked import run_ranks

from timetotrain.models.qwen3_5_moe.config import Qwen35MoeConfig
from timetotrain.models.qwen3_5_moe.deltanet import GatedDeltaNet, chunk_gated_delta_rule, l2_normalize
from timetotrain.models.qwen3_5_moe.model import HybridBlock

pytestmark = pytest.mark.distributed

B = 2
WORLD = 4
CFG = Qwen35MoeConfig(
    dim=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8,
    lin_v_dim=6, n_experts=4, top_k=2, expert_ffn_dim=8, shared_ffn_dim=8, vocab_size=32, max_seq_len=2048,
)  # fmt: skip
# name -> (tokens per CP chunk, the layer's rule chunk)
LAYER_CASES = {"layer": (75, 64), "layer_tiny_chunks": (2, 64)}
RULE_TC = 75
TOL = 1e-5  # relative to the largest magnitude of each compared tensor (seen: 2e-6)
BROKEN = 1e-2  # what a wrong hand-off must at least miss by


def local(x: torch.Tensor, rank: int, n: int, dim: int) -> torch.Tensor:
    """The head-tail layout: chunks `rank` and `2n-1-rank` of 2n along `dim`, side by side."""
    chunks = x.chunk(2 * n, dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim)


def whole(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of `local` from every rank's part: the sequence back in order."""
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def normal(w: torch.Tensor, std: float) -> None:
    torch.nn.init.normal_(w, std=std)


def make_layer(chunk: int) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(CFG, chunk=chunk)
    layer.init_weights(normal, 0.3, 0.3)
    return weak_decay(layer)


def make_block() -> HybridBlock:
    """A whole DeltaNet block (norm, the layer, residual, MoE), the layer as the CP harness swaps it in."""
    torch.manual_seed(0)
    block = HybridBlock(CFG, 0)
    block.init_weights(normal, 0.3, 0.3)
    weak_decay(block.attn)
    return block


def weak_decay(layer: GatedDeltaNet) -> GatedDeltaNet:
    with torch.no_grad():
        layer.A_log.uniform_(0.002, 0.05).log_()  # weak decay: the state outlives a chunk
        layer.dt_bias.uniform_(-1.0, 1.0)
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def rule_inputs(T: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    H, dk, dv = 3, 5, 4

    def r(*shape):
        return torch.randn(*shape, generator=g)

    q = l2_normalize(r(B, H, T, dk)) * dk**-0.5
    k = l2_normalize(r(B, H, T, dk))
    beta, decay = torch.rand(B, H, T, generator=g), -0.05 * torch.rand(B, H, T, generator=g)
    return [q, k, r(B, H, T, dv), decay, beta]


def gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def compare_layer(chunk_tokens: int, chunk: int, group, block: bool = False) -> dict[str, float]:
    import torch.distributed as dist

    from timetotrain.train.context_parallel_deltanet import context_parallel

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    one = make_block() if block else make_layer(chunk)
    cp = copy.deepcopy(one)
    context_parallel(cp.attn if block else cp, group)
    extra = (None, None) if block else ()  # a DeltaNet block ignores the RoPE tables

    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, 2 * n * chunk_tokens, CFG.dim, generator=g, requires_grad=True)
    w = torch.randn(x.shape, generator=g)  # the loss's weights, so that each output has its own gradient
    want = one(x, *extra)
    (want * w).sum().backward()
    x_local = local(x.detach(), rank, n, 1).requires_grad_()
    got_local = cp(x_local, *extra)
    (got_local * local(w, rank, n, 1)).sum().backward()

    errors = {"out": relative(whole(gather(got_local.detach(), group), 1), want.detach())}
    errors["grad x"] = relative(whole(gather(x_local.grad, group), 1), x.grad)
    mine = dict(cp.named_parameters())
    for name, p in one.named_parameters():
        dist.all_reduce(mine[name].grad, group=group)  # each rank's part: the loss is the sum over ranks
        errors[f"grad {name}"] = relative(mine[name].grad, p.grad)
    return errors


def compare_rule(group) -> dict[str, float]:
    import torch.distributed as dist

    from timetotrain.train.context_parallel_deltanet import gated_delta_rule_cp

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    inputs = [t.requires_grad_() for t in rule_inputs(2 * n * RULE_TC)]
    want, _ = chunk_gated_delta_rule(*inputs)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (want * w).sum().backward()
    mine = [local(t.detach(), rank, n, 2).requires_grad_() for t in inputs]
    got = gated_delta_rule_cp(*mine, group)
    (got * local(w, rank, n, 2)).sum().backward()
    errors = {"out": relative(whole(gather(got.detach(), group), 2), want.detach())}
    for name, t, m in zip("q k v g beta".split(), inputs, mine, strict=True):
        errors[f"grad {name}"] = relative(whole(gather(m.grad, group), 2), t.grad)
    return errors


def run_cases(group) -> dict[str, dict[str, float]]:
    results = {name: compare_layer(*case, group) for name, case in LAYER_CASES.items()}
    results["block"] = compare_layer(*LAYER_CASES["layer"], group, block=True)
    results["rule"] = compare_rule(group)
    return results


def broken_runs(group) -> dict[str, dict[str, float]]:
    """The same comparisons with the state hand-off or the conv halo replaced by zeros."""
    from timetotrain.train import context_parallel_deltanet as cpd

    results = {}
    for part, zero in [
        ("_incoming_states", lambda pairs, group: pairs.new_zeros(*pairs.shape[:-1], CFG.lin_v_dim)),
        ("_halos", lambda tails, width, group: tails.new_zeros(*tails.shape[:-1], width)),
    ]:
        right = getattr(cpd, part)
        setattr(cpd, part, zero)
        try:
            results[part] = compare_layer(*LAYER_CASES["layer"], group)
        finally:
            setattr(cpd, part, right)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every rank's errors from ONE torchrun of 4 ranks: CP over all 4, then over two groups of 2 consecutive
    ranks at once (the harness's CP groups), and the broken hand-offs there."""
    root = tmp_path_factory.mktemp("cp_deltanet")
    run_ranks(__file__, [str(root)], WORLD, free_port())
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [4, 2])
def test_deltanet_under_cp_equals_one_process(results, cp):
    for rank_results in results:
        cases = rank_results[f"cp{cp}"]
        assert set(cases) == {*LAYER_CASES, "block", "rule"}
        # the output, the input's gradient and each weight's
        assert len(cases["layer"]) == 2 + len(list(make_layer(64).parameters()))
        assert len(cases["block"]) == 2 + len(list(make_block().parameters()))
        for case, errors in cases.items():
            for quantity, error in errors.items():
                assert error < TOL, (cp, case, quantity, error)


@pytest.mark.slow
def test_a_wrong_hand_off_fails_the_comparison(results):
    for rank_results in results:
        for part, errors in rank_results["broken"].items():
            # the incoming states or the conv halo zeroed: outputs and input gradients off by far
            assert errors["out"] > BROKEN and errors["grad x"] > BROKEN, (part, errors)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pairs, _ = dist.new_subgroups(group_size=2)
    results = {"cp4": run_cases(None), "cp2": run_cases(pairs), "broken": broken_runs(pairs)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
