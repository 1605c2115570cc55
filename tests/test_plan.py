"""`ttt plan`: the memory estimate's arithmetic and its suggestion."""

import pytest

from timetotrain.suite import get
from timetotrain.train.memory import GiB, activation_bytes, estimate, plan

BENCH = get("llama31_8b")
REF = BENCH.tier("reference")


def test_states_are_16_bytes_per_parameter_sharded_by_fsdp():
    n = 8_030_261_248
    dp = estimate(BENCH, REF, n, 8, 80, "dp", False, 1, bf16=True)
    fsdp = estimate(BENCH, REF, n, 8, 80, "fsdp", False, 1, bf16=True)
    assert dp.states == 16 * n and fsdp.states == 2 * n
    assert dp.compute_copies == 2 * n  # autocast's bf16 weight cache under DDP


def test_activation_count_for_the_8b_block():
    cfg = REF.model
    # 9.5h + 3f elements per token per block at kv/heads = 1/4, and 4h per token for the head (see the module
    # docstring); once per micro-batch the fp32 head-weight gradient and one chunk of logits (fp32 plus two
    # bf16 copies) of 1 GiB / (4 * vocab) rows.
    per_block = 9.5 * 4096 + 3 * 14336
    head = 4 * 4096 * 2
    rows = (1 << 30) // (4 * 128_256)
    fixed = 128_256 * 4096 * 4 + rows * 128_256 * (4 + 4)
    assert activation_bytes(BENCH.family, cfg, 8192, 2, ac=False) == pytest.approx(
        8192 * (32 * per_block * 2 + head) + fixed
    )
    with_ac = activation_bytes(BENCH.family, cfg, 8192, 2, ac=True)
    assert with_ac == pytest.approx(8192 * (32 * 4096 * 2 + per_block * 2 + head) + fixed)
    assert with_ac < activation_bytes(BENCH.family, cfg, 8192, 2, ac=False) / 4


def test_8b_on_8x80_needs_fsdp():
    n, rows, best = plan(BENCH, REF, 8, 80, None)
    assert n == 8_030_261_248
    assert all(r.total > 80 * GiB for r in rows if r.parallel == "dp=8")  # 128 GB of states alone
    assert best is not None and best.parallel == "fsdp=8" and best.total <= 0.9 * 80 * GiB
    # Without checkpointing only micro-batch 1 fits (about 65 GiB); two sequences need it on.
    no_ac = {r.micro_batch: r.total for r in rows if r.parallel == "fsdp=8" and not r.ac}
    assert no_ac[1] <= 0.9 * 80 * GiB < no_ac[2]
    assert not best.ac and best.micro_batch == 1


def test_nothing_fits_on_one_small_gpu():
    _, _, best = plan(BENCH, REF, 1, 24, None)
    assert best is None


def test_moe_family_hook_gives_the_gpt_oss_estimate():
    """The MoE family's hook: total parameters for the states, active parameters reported, a suggestion."""
    bench = get("gpt_oss_20b")
    tier = bench.tier("reference")
    n, rows, best = plan(bench, tier, 8, 80, None)
    assert n == 20_488_418_112 == bench.family.param_count(tier.model)
    assert bench.family.active_param_count(tier.model) == 3_766_907_712
    assert rows[0].states == 16 * n  # dp=8: states of all 20.5 B parameters on every GPU
    # Activations scale with the k routed copies: more per token than a dense block of the same width.
    dense_like = bench.family.activation_elements(tier.model) - 4 * tier.model.top_k * tier.model.dim
    assert bench.family.activation_elements(tier.model) > dense_like
    assert best is not None and best.parallel == "fsdp=8"


def test_405b_on_256_gpus_suggests_tensor_parallel_with_checkpointing():
    from timetotrain.train.memory import format_plan

    bench = get("llama31_405b")
    tier = bench.tier("reference")
    n, rows, best = plan(bench, tier, 256, 80, None)
    assert all(r.total > 80 * GiB for r in rows if not r.parallel.startswith("tp="))  # FSDP alone: no
    assert best is not None and best.parallel.startswith("tp=") and best.ac
    tp = int(best.parallel.split(",")[0].split("=")[1])
    assert tp * int(best.parallel.split("fsdp=")[1]) == 256 and 1152 // (256 // tp) % best.micro_batch == 0
    # Block states split over all 256 ranks, embedding and head over the FSDP ranks only.
    blocks = tier.model.n_layers * bench.family.block_params(tier.model)
    assert best.states == pytest.approx(16 * (blocks / 256 + (n - blocks) / (256 // tp)))
    text = format_plan(bench, tier, n, rows, best, 256, 80)
    assert f"--parallel {best.parallel}" in text and "--ac" in text
    assert "not validated on GPUs" in text


def test_expert_parallel_rows():
    """`--parallel ep=N[,fsdp=N]` for the MoE families: the expert count behind the estimate, DDP keeping 1/N
    of the experts, FSDP2 the states of fsdp=N but gathering blocks without their experts."""
    from timetotrain.errors import UserError
    from timetotrain.train.memory import expert_params

    ds = get("deepseekv3_671b")
    cfg = ds.tier("reference").model
    experts, per_layer = expert_params(ds.family, cfg)
    assert per_layer == 256 * 3 * 7168 * 2048
    assert experts == (cfg.n_layers - cfg.first_dense + cfg.mtp_layers) * per_layer  # 58 MoE layers + MTP

    bench = get("gpt_oss_20b")
    tier = bench.tier("reference")
    n, fsdp_rows, _ = plan(bench, tier, 8, 80, "fsdp=8")
    _, ep_fsdp, best = plan(bench, tier, 8, 80, "ep=8,fsdp=8")
    _, ep_ddp, _ = plan(bench, tier, 8, 80, "ep=8")
    experts, per_layer = expert_params(bench.family, tier.model)
    assert experts == tier.model.n_layers * per_layer
    assert {r.parallel for r in ep_fsdp} == {"ep=8,fsdp=8"} and {r.parallel for r in ep_ddp} == {"ep=8"}
    for a, b, c in zip(fsdp_rows, ep_fsdp, ep_ddp, strict=True):
        assert b.states == a.states == 2 * n
        assert c.states == pytest.approx(16 * (n - experts) + 2 * experts)
        assert b.activations == a.activations
        # bf16 copies: FSDP2 gathers blocks without experts; the local expert slices' autocast copies are
        # kept for the backward, for every layer unless checkpointing recomputes them block by block.
        local = 2 * (2 * per_layer / 8 if b.ac else experts / 8)
        assert b.compute_copies == pytest.approx(a.compute_copies - 4 * per_layer + local)
        assert (b.compute_copies < a.compute_copies) == b.ac
    assert best is not None and best.parallel == "ep=8,fsdp=8"
    with pytest.raises(UserError, match="needs a mixture-of-experts model"):
        plan(BENCH, REF, 8, 80, "ep=8,fsdp=8")
