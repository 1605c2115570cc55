"""`ttt plan`: the memory estimate's arithmetic and its suggestion."""

import dataclasses

import pytest
import torch
from conftest import strict_loads

from timetotrain.cli import main
from timetotrain.errors import UserError
from timetotrain.models import flux
from timetotrain.models.flux import Flux, FluxConfig
from timetotrain.spec import registry
from timetotrain.spec.registry import get
from timetotrain.tasks.rectified_flow import flow_loss
from timetotrain.train.memory import (
    GiB,
    _root_copies,
    activation_bytes,
    degree,
    estimate,
    fits_from,
    format_plan,
    launch,
    padded_experts,
    plan,
    plan_doc,
    tp_degree,
)

BENCH = get("llama31_8b")
REF = BENCH.tier("reference")


def test_states_are_16_bytes_per_parameter_sharded_by_fsdp():
    """Weights, gradients and Adam's two moments; DDP adds its buckets, a second copy of the gradients."""
    n = 8_030_261_248
    dp = estimate(BENCH, REF, n, 8, 80, "dp", False, 1, bf16=True)
    fsdp = estimate(BENCH, REF, n, 8, 80, "fsdp", False, 1, bf16=True)
    assert dp.states == (16 + 4) * n and fsdp.states == 2 * n
    assert dp.compute_copies == 2 * n  # autocast's bf16 weight cache under DDP


def test_hsdp_states_are_sharded_over_the_shard_group_only():
    """dp_replicate=2,fsdp=8 on 16 GPUs: every GPU holds what fsdp=8 on 8 holds (the states 1/8, two blocks
    gathered over 8), the activations of one sample as fsdp=16's; the batch splits over all 16."""
    n, rows, best = plan(BENCH, REF, 16, 80, "dp_replicate=2,fsdp=8")
    _, fsdp8, _ = plan(BENCH, REF, 8, 80, "fsdp=8")
    _, fsdp16, _ = plan(BENCH, REF, 16, 80, "fsdp=16")
    assert {r.parallel for r in rows} == {"dp_replicate=2,fsdp=8"} and best is not None
    assert [(r.ac, r.micro_batch) for r in rows] == [(r.ac, r.micro_batch) for r in fsdp16]  # 1 sample each
    for h, f16 in zip(rows, fsdp16, strict=True):
        f8 = next(r for r in fsdp8 if (r.ac, r.micro_batch) == (h.ac, h.micro_batch))
        assert h.states == f8.states == 2 * f16.states and h.compute_copies == f8.compute_copies
        assert h.activations == f16.activations
    assert launch(BENCH, REF, best, 16, 8)["command"].startswith("torchrun --nnodes 2 --nproc_per_node 8")


def test_activation_count_for_the_8b_block():
    cfg = REF.model
    # 9.5h + 3f elements per token per block at kv/heads = 1/4, and 4h per token for the head (see the module
    # docstring); once per micro-batch the fp32 head-weight gradient and one chunk of logits (fp32 plus two
    # bf16 copies) of 512 rows (head_loss.chunk_rows: the same on every device).
    per_block = 9.5 * 4096 + 3 * 14336
    head = 4 * 4096 * 2
    rows = 512
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
    assert rows[0].states == (16 + 4) * n  # dp=8: states of all 20.5 B parameters and DDP's buckets per GPU
    # Activations scale with the k routed copies: more per token than a dense block of the same width.
    dense_like = bench.family.activation_elements(tier.model) - 4 * tier.model.top_k * tier.model.dim
    assert bench.family.activation_elements(tier.model) > dense_like
    assert best is not None and best.parallel == "fsdp=8"


def test_gpt_oss_count_is_what_each_kind_of_block_saves_on_a_gpu():
    """gpt_oss_20b's two kinds of block at the reference shape (one micro-batch of 2 x 8,192 tokens, bf16),
    under `ttt plan --simulate`'s fake tensors counted as a GPU keeps them (`fakes.gpu_attention`: the
    sliding layer in the windowed FlashAttention kernel, as on a GPU): each keeps the family's count, to
    within the RoPE tables' per-call bf16 casts and the router weight's fp32 copy (0.1%). The sliding
    layer on this CPU's masked band kept 5.35 GiB, 1.57 x the full layer's 3.40."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from timetotrain import fakes
    from timetotrain.models.gpt_oss import GptOss

    bench = get("gpt_oss_20b")
    cfg = dataclasses.replace(bench.tier("reference").model, n_layers=2)
    B, T = 2, 8192
    with torch.device("meta"):
        model = GptOss(cfg).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True), fakes.gpu_attention():
        model = model.to_empty(device="cpu")
        states = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]
        count = bench.family.activation_elements(cfg) * B * T * 2
        windows = []
        for block in model.layers:
            kept: dict[int, int] = {}

            def pack(t, kept=kept):
                s = t.untyped_storage()
                if s._cdata not in states:
                    kept[s._cdata] = s.nbytes()
                return t

            x = torch.randn(B, T, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(x, cos, sin, model.window_mask(T, block.window, x.device, torch.bfloat16))
            windows.append(block.window)
            assert sum(kept.values()) == pytest.approx(count, rel=2e-3), block.window
            del out
    assert windows == [cfg.sliding_window, None]


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


# -- flux1: the MMDiT's own count (models/flux/), checked against what autograd really saves --

FLUX_CFG = FluxConfig(
    dim=32, n_heads=2, n_double=2, n_single=2, latent_channels=4, patch=2, latent_size=8, txt_dim=24,
    txt_len=8, vec_dim=12, axes_dim=(4, 6, 6),
)  # fmt: skip


def _saved_bytes(fn, model):
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs (a view keeps its whole
    storage), the model's parameters and buffers left out: they are states, not activations."""
    states = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in states:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # held until counted, so no storage is freed and its address reused
    return sum(kept.values()), out


def _flux_model(dtype):
    model = Flux(FLUX_CFG)
    for p in model.parameters():  # bf16 parameters, fp32 buffers: what FSDP2's bf16 policy computes with
        p.data = p.data.to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_activation_count_is_what_autograd_saves(dtype):
    cfg, B, a = FLUX_CFG, 3, torch.finfo(dtype).bits // 8
    model = _flux_model(dtype)
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(B, cfg.img_len, cfg.in_channels, generator=g, dtype=dtype) for k in ("x0", "eps")}
    batch = {
        **x,
        "t": torch.rand(B, generator=g),
        "txt": torch.randn(B, cfg.txt_len, cfg.txt_dim, generator=g, dtype=dtype),
        "vec": torch.randn(B, cfg.vec_dim, generator=g, dtype=dtype),
    }
    measured, _ = _saved_bytes(lambda: flow_loss(model, batch), model)
    # Byte for byte. One CPU difference under bf16: LayerNorm keeps its mean and rstd in bf16 on CPU (CUDA,
    # which the count describes: fp32), 4 bytes less per normalised row (2 per double-block token, 1 per
    # single-block token, 1 per image token in the final layer).
    T, d = cfg.seq_len, cfg.dim

    def cpu_ln_stats(rows: int) -> int:
        return 0 if a == 4 else 4 * rows

    rows = T * (2 * cfg.n_double + cfg.n_single) + cfg.img_len
    assert measured == flux.activation_bytes(cfg, B, a, ac=False) - B * cpu_ln_stats(rows)

    # Each kind of block alone, over its inputs (the shared conditioning vector counts once per block here).
    freqs = model._tables(cfg.txt_len)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    svec = leaf(B, d)
    img, txt, joint = leaf(B, cfg.img_len, d), leaf(B, cfg.txt_len, d), leaf(B, T, d)
    for block, args, count, norms in (
        (model.layers[0], (img, txt, svec, freqs), flux.double_block_bytes, 2),
        (model.layers[-1], (joint, svec, freqs), flux.single_block_bytes, 1),
    ):
        measured, _ = _saved_bytes(lambda b=block, x=args: b(*x), model)
        per_token, per_sample = count(cfg, a)
        rope = flux.rope_table_bytes(cfg)  # the block's input here, kept by its q/k rotations
        assert measured == B * (T * per_token + per_sample + d * a - cpu_ln_stats(norms * T)) + rope, block


def test_flux_checkpointing_keeps_block_inputs_and_one_block():
    cfg, a = get("flux1").tier("reference").model, 2
    T, d = cfg.seq_len, cfg.dim
    dt, ds = flux.double_block_bytes(cfg, a)
    st, ss = flux.single_block_bytes(cfg, a)
    outer = flux.outer_bytes(cfg, a)
    rope = flux.rope_table_bytes(cfg)
    assert (
        flux.activation_bytes(cfg, 2, a, ac=False)
        == 2 * (19 * (T * dt + ds) + 38 * (T * st + ss) + outer) + rope
    )
    # Checkpointing: 57 block inputs, plus the larger block recomputed (its input already counted).
    recompute = max(T * dt + ds, T * st + ss) - T * d * a
    assert flux.activation_bytes(cfg, 2, a, ac=True) == 2 * (57 * T * d * a + recompute + outer) + rope
    assert flux.activation_bytes(cfg, 1, a, ac=True) < flux.activation_bytes(cfg, 1, a, ac=False) / 10


def test_flux1_on_8x80_suggests_fsdp_without_checkpointing():
    from timetotrain.train.memory import format_plan

    bench = get("flux1")
    tier = bench.tier("reference")
    n, rows, best = plan(bench, tier, 8, 80, None)
    assert n == flux.param_count(tier.model) and 11.8e9 < n < 12.0e9
    # Every parameter is the MMDiT's and trains: the frozen encoders are not part of training.
    assert bench.task.param_counts(bench.family, tier) == (n, 0)
    assert all(r.total > 80 * GiB for r in rows if r.parallel == "dp=8")  # 177 GiB of states alone
    one = next(r for r in rows if r.parallel == "fsdp=8" and not r.ac and r.micro_batch == 1)
    assert one.states == 16 * n / 8
    # Two double blocks gathered in bf16 and, through the backward, one's unsharded fp32 gradient.
    assert one.compute_copies == (2 * 2 + 4) * flux.double_block_params(tier.model)
    assert one.activations == flux.activation_bytes(tier.model, 1, 2, ac=False)
    assert 4.2 * GiB < one.activations < 4.4 * GiB  # 57 blocks x 512 tokens x 154-166 kB
    no_ac = {r.micro_batch: r.total for r in rows if r.parallel == "fsdp=8" and not r.ac}
    assert no_ac[8] <= 0.9 * 80 * GiB < no_ac[16]
    assert best is not None and best.parallel == "fsdp=8" and not best.ac and best.micro_batch == 8
    text = format_plan(bench, tier, n, rows, best, 8, 80)
    assert "--parallel fsdp=8 --precision bf16 --set micro_batch_size=8" in text
    assert "not validated on GPUs" in text and "frozen encoders" in text


def test_flux1_plan_other_gpu_counts():
    bench = get("flux1")
    tier = bench.tier("reference")
    _, _, best = plan(bench, tier, 64, 80, None)  # 8 images per GPU: micro-batch 8 without recomputation
    # 8 nodes: HSDP, FSDP2 within each node (its 22 GiB of states fit beside micro-batch 8)
    assert best.parallel == "dp_replicate=8,fsdp=8" and not best.ac and best.micro_batch == 8
    _, _, best = plan(bench, tier, 64, 80, None, gpus_per_node=64)  # one node: FSDP2 over all of it
    assert best.parallel == "fsdp=64" and not best.ac and best.micro_batch == 8
    _, _, best = plan(bench, tier, 2, 80, None)  # 89 GiB of states per GPU
    assert best is None
    _, _, best = plan(bench, tier, 4, 80, "fsdp=4")  # 44 GiB of states: micro-batch 4 or checkpointing
    assert best is not None and best.total <= 0.9 * 80 * GiB


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
        assert c.states == pytest.approx((16 + 4) * (n - experts) + 2 * experts)  # + DDP's buckets
        assert b.activations == a.activations
        # bf16 copies: FSDP2 gathers blocks without experts; the local expert slices' copies are cast once per
        # step and kept until it ends (models/common/weight_cast.py), for every layer, checkpointing or not.
        # The unsharded fp32 gradient of the block FSDP2 reduce-scatters (4 B a parameter): no experts either.
        assert b.compute_copies == pytest.approx(a.compute_copies - (2 * 2 + 4) * per_layer + 2 * experts / 8)
    assert best is not None and best.parallel == "ep=8,fsdp=8"
    with pytest.raises(UserError, match="needs a mixture-of-experts model"):
        plan(BENCH, REF, 8, 80, "ep=8,fsdp=8")


def test_the_step_peaks_at_the_larger_end_of_its_backward():
    """The last backward starts with every activation and the earlier micro-batches' gradients and ends, in
    the first block, with every gradient beside that block's backward (`backward_end_bytes`); the total
    charges the larger, not the sum. deepseekv3_671b on 8,192 GPUs has 2 samples per rank: at micro-batch 2
    the step is one micro-batch, whose end (under HSDP, `dp_replicate=32,fsdp=256,ep=256`, 9.9 GiB of
    gradients, the whole expert slices' among them) is less than the sum (the start holds no gradient yet);
    under `ep=256,fsdp=8192`, whose slices FSDP2 shards over their 32 replicas, the gradients are 1/8192 of
    the model's and the sum is less their share; at micro-batch 1 two micro-batches, whose start is the sum;
    gpt_oss_20b ep=8,fsdp=8 at micro-batch 2 (one as well) ends above the sum, its experts' gradients and a
    block's backward outgrowing the checkpointed inputs."""
    from timetotrain.train.memory import backward_end_bytes

    def parts(name, gpus, spec, micro, shards):
        bench = get(name)
        tier = bench.tier("reference")
        if tier.eval_samples % gpus:  # `ttt run` takes ep where the eval splits evenly (check_eval_split)
            tier = dataclasses.replace(tier, eval_samples=gpus)
        cfg = tier.model
        _, rows, _ = plan(bench, tier, gpus, 80, spec)
        r = next(r for r in rows if r.ac and r.micro_batch == micro)
        grads = 4 * bench.family.param_count(cfg) / shards  # everything, experts too, 1/shards per GPU
        end = backward_end_bytes(bench.family, cfg, micro * bench.task.sample_items(tier)[1], 2, True)
        return r, r.states + r.compute_copies + r.activations + r.margin, grads, end

    one, total, grads, end = parts("deepseekv3_671b", 8192, "dp_replicate=32,fsdp=256,ep=256", 2, 256)
    assert grads > 9 * GiB and grads + end > one.activations > end
    assert one.total == pytest.approx(total - one.activations + end) and one.total < total - 7 * GiB
    sharded, total, grads, end = parts("deepseekv3_671b", 8192, "ep=256,fsdp=8192", 2, 8192)
    assert grads < one.activations - end and sharded.total == pytest.approx(total - grads)
    two, total, grads, end = parts("deepseekv3_671b", 8192, "ep=256,fsdp=8192", 1, 8192)
    assert two.activations > end and two.overlap == 0 and two.total == pytest.approx(total)
    oss, total, grads, end = parts("gpt_oss_20b", 8, "ep=8,fsdp=8", 2, 8)
    assert end > oss.activations and oss.total == pytest.approx(total - oss.activations + end)


# -- clusters: nodes, "fits from", ep rows by default, every benchmark planned or refused in one line --


def test_multi_node_launch_is_one_torchrun_per_node():
    bench = get("llama31_405b")
    tier = bench.tier("reference")
    n, rows, best = plan(bench, tier, 256, 80, None, gpus_per_node=8)
    text = format_plan(bench, tier, n, rows, best, 256, 80, gpus_per_node=8)
    assert "--nproc_per_node 256" not in text
    assert "torchrun --nnodes 32 --nproc_per_node 8 --rdzv-backend c10d" in text
    assert "#SBATCH --nodes=32 --ntasks-per-node=1 --gpus-per-node=8" in text
    # Nodes of 4: 64 of them, and no TP group wider than a node.
    n4, rows4, best4 = plan(bench, tier, 256, 80, None, gpus_per_node=4)
    assert best4 is not None and max(_tp(r) for r in rows4) <= 4 < max(_tp(r) for r in rows)
    assert launch(bench, tier, best4, 256, 4)["command"].startswith(
        "torchrun --nnodes 64 --nproc_per_node 4 "
    )
    # One node when --gpus fits in it: the single-node line, as before.
    one = launch(bench, tier, best, 4, 8)
    assert one == {"nodes": 1, "gpus_per_node": 4, "command": one["command"], "before": one["before"]}
    assert one["command"].startswith("torchrun --nproc_per_node 4 -m timetotrain run llama31_405b")
    doc = plan_doc(bench, tier, n, rows, best, 256, 80, gpus_per_node=8)
    assert (doc["nodes"], doc["suggestion"]["launch"]["nodes"]) == (32, 32)
    with pytest.raises(UserError, match=r"--gpus 12 is not a whole number of nodes of --gpus-per-node 8"):
        plan(BENCH, REF, 12, 80, None)


def _tp(r) -> int:
    return int(r.parallel.split(",")[0][3:]) if r.parallel.startswith("tp=") else 1


def test_nothing_fits_says_from_how_many_gpus_it_would():
    _, _, best = plan(BENCH, REF, 1, 24, None)
    assert best is None
    w, first = fits_from(BENCH, REF, 1, 24, None)
    assert first.total <= 0.9 * 24 * GiB and plan(BENCH, REF, w, 24, None)[2] == first
    # The smallest such world: every smaller one that splits the batch fits nothing.
    gbs = REF.global_batch_size
    assert all(
        plan(BENCH, REF, k, 24, None)[2] is None
        for k in range(2, w)
        if gbs % k == 0 and (k <= 8 or k % 8 == 0)
    )
    n, rows, _ = plan(BENCH, REF, 1, 24, None)
    text = format_plan(BENCH, REF, n, rows, None, 1, 24, larger=(w, first))
    assert f"nothing fits on 1 GPU; fits from {w} GPUs ({first.parallel}," in text
    # A layout given with --parallel grows with the world; nowhere at all says so.
    w2, r2 = fits_from(get("llama31_405b"), get("llama31_405b").tier("reference"), 8, 80, "tp=8")
    assert r2.parallel == f"tp=8,fsdp={w2 // 8}" and w2 % 8 == 0
    assert fits_from(BENCH, REF, 1, 0.01, None) is None


def test_fits_from_reaches_worlds_above_eight_samples_a_gpu():
    # llama31_405b at GBS 16 on 48 GiB: no layout of a TP group a rank (up to 16 x 8 = 128 GPUs) fits; the CP
    # pair across nodes does, on 256 GPUs (`cp=2,tp=8,fsdp=16`): 16 GPUs a data-parallel rank.
    bench = get("llama31_405b")
    tier = dataclasses.replace(bench.tier("reference"), global_batch_size=16)
    assert plan(bench, tier, 128, 48, None)[2] is None
    w, best = fits_from(bench, tier, 16, 48, None)
    assert (w, best.parallel) == (256, "fsdp=16,cp=2,tp=8")
    assert best.total <= 0.9 * 48 * GiB


def test_moe_benchmarks_get_ep_rows_by_default():
    for name, gpus in (("gpt_oss_20b", 8), ("deepseekv3_671b", 256)):
        bench = get(name)
        tier = bench.tier("reference")
        _, rows, _ = plan(bench, tier, gpus, 80, None)
        kinds = {r.parallel for r in rows}
        assert {f"ep={gpus}", f"ep={gpus},fsdp={gpus}", f"fsdp={gpus}"} <= kinds, name
    _, rows, best = plan(get("deepseekv3_671b"), get("deepseekv3_671b").tier("reference"), 256, 80, None)
    assert best is not None and best.parallel == "ep=256,fsdp=256"
    assert not any(r.parallel.startswith("ep") for r in plan(BENCH, REF, 8, 80, None)[1])  # dense: none


def test_more_gpus_than_experts_get_the_expert_data_parallel_hybrid():
    """DeepSeek-V3's 256 experts on 1,024 GPUs: ep=256,fsdp=1024 (train/parallel.py), 1/256 of the experts
    sharded over the 4 GPUs holding it and 1/1024 of the rest, so 1/1024 of the model's states on each GPU;
    suggested on 80 GiB, where nothing else fits."""
    from timetotrain.train.memory import expert_params

    ds = get("deepseekv3_671b")
    tier = ds.tier("reference")
    _, rows, best = plan(ds, tier, 1024, 80, None)
    hybrid = [r for r in rows if r.parallel == "ep=256,fsdp=1024"]
    experts, _ = expert_params(ds.family, tier.model)
    n = ds.family.param_count(tier.model)
    assert experts > n / 2 and hybrid and all(r.states == pytest.approx(16 * n / 1024) for r in hybrid)
    assert best is not None and best.parallel == "ep=256,fsdp=1024"
    _, given, _ = plan(ds, tier, 256, 80, "ep=64,fsdp=256")
    assert {r.parallel for r in given} == {"ep=64,fsdp=256"}
    assert given[0].states == pytest.approx(16 * n / 256)


def test_every_benchmark_is_planned_or_refused_in_one_line(capsys):
    for name in registry.names():
        # The closed configuration where the benchmark has one; else (a benchmark of no round, whose tiers
        # are all ours) its first declared tier.
        tiers = registry.get(name).tiers
        tier = "reference" if "reference" in tiers else next(iter(tiers))
        code = main(["plan", name, "--tier", tier, "--gpus", "8", "--gpu-mem", "80"])
        out, err = capsys.readouterr()
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"ttt: error: ttt plan {name}: "), (name, err)
            assert "Config" not in lines[0] and "--parallel dp=N" in lines[0]
        else:
            assert code in (0, 1) and out.startswith(f"{name} {tier}: "), (name, code, err)
            assert ("torchrun --nproc_per_node 8 " in out) == (code == 0), name
            # Not fitting, the plan names the GPU count that would, or why no count would, with what is
            # needed (qwen35_397b_grpo's 65,536-token sample: test_grpo_reference_says_what_one_sample_needs).
            assert (
                code == 0
                or "fits from " in out
                or (
                    "nor on more GPUs: on " in out and ("needed: " in out or "the states alone exceed" in out)
                )
            ), name
    main(["plan", "rgat", "--gpus", "8", "--gpu-mem", "80"])
    assert "no memory model for the rgat family" in capsys.readouterr().err


def test_plan_json_carries_nodes_launch_and_fits_from(capsys):
    """`ttt plan --json` keeps its keys and adds the nodes, the launch lines and, when nothing fits, the
    smallest world that would; strict JSON (conftest.strict_loads)."""
    argv = ["plan", "llama31_405b", "--gpus", "256", "--gpu-mem", "80", "--json"]
    assert main(argv) == 0
    doc = strict_loads(capsys.readouterr().out)
    how = doc["suggestion"]["launch"]
    assert (doc["gpus_per_node"], doc["nodes"], how["nodes"], how["gpus_per_node"]) == (8, 32, 32, 8)
    assert how["command"].startswith("torchrun --nnodes 32 --nproc_per_node 8 ")
    assert doc["suggestion"]["run_flags"] in how["command"] and how["slurm"][0] == "#!/bin/bash"
    assert main(["plan", "llama31_8b", "--gpus", "1", "--gpu-mem", "24", "--json"]) == 1
    doc = strict_loads(capsys.readouterr().out)
    w, r = fits_from(BENCH, REF, 1, 24, None)
    assert (
        doc["suggestion"] is None
        and doc["fits_from"]["gpus"] == w
        and doc["fits_from"]["parallel"] == r.parallel
    )
    assert f"fits from {w} GPUs" in doc["suggestion_reason"]
    assert main(["plan", "llama31_8b", "--gpus", "8", "--gpu-mem", "80", "--gpus-per-node", "0"]) == 2
    assert capsys.readouterr().err.strip() == "ttt: error: --gpus-per-node 0 must be at least 1"


def test_grpo_reference_says_what_one_sample_needs(capsys):
    """qwen35_397b_grpo reference on H200s (141 GiB): no layout without context parallelism fits. At 256 GPUs
    (GBS 256: one rollout per GPU) the smallest such layout's one 65,536-token sample keeps the checkpointed
    blocks and GRPO's chunked log-probability head (one chunk of logits, as a causal LM's loss); the
    sequence must be split, and cp layouts fit. On the RCPs' 256 x 288 GiB (GB300) ep=256,fsdp=256 fits: until the
    head was chunked it needed ~333 GiB of activations."""
    bench = get("qwen35_397b_grpo")
    ref = bench.tier("reference")
    cfg, T = ref.model, ref.data.seq_len
    # With context parallelism (GRPO's log-probabilities in parts) it fits from 256 GPUs: fsdp=32,cp=8, AC
    # (at 128, fsdp=16,cp=8 holds a block's unsharded fp32 gradient, 24.5 GiB, beside the rest: 153 GiB).
    w, r8 = fits_from(bench, ref, 8, 141, None)
    assert (w, r8.parallel, r8.ac, r8.peak) == (256, "fsdp=32,cp=8", True, "the training step")
    # At 256 GPUs GBS 256 gives each data-parallel rank part of a group of 16 generations, which its ranks
    # share (tasks/grpo.py `check_groups`): fsdp=32,cp=8 at the tier's GBS, 8 rollouts a data-parallel rank.
    _, _, best = plan(bench, ref, 256, 141, None)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=32,cp=8", True, 1)
    # A share that would cut a group unevenly is refused in one line (GBS 384 = 24 groups over 64 ranks).
    with pytest.raises(UserError, match="split a group of 16 generations unevenly"):
        plan(bench, dataclasses.replace(ref, global_batch_size=384), 64, 141, "fsdp=64")
    # What one sample on one GPU would need (the estimate of that row, which the search no longer offers).
    r = estimate(bench, ref, bench.family.param_count(cfg), 256, 141, "fsdp", 1, 1, True)
    assert (r.ac, r.micro_batch, r.peak) == (True, 1, "the training step")
    assert r.activations == activation_bytes(bench.family, cfg, T, 2, True)
    # No whole logits: a [tokens, vocab] fp32 array alone would be 61 GiB.
    assert r.activations < 2.2 * T * cfg.vocab_size * 4
    cap = 0.9 * 141 * GiB
    # The end of the backward (the DeltaNet block recomputed beside its gradients, every parameter gradient)
    # outweighs its start: the activations must fit that.
    assert r.overlap < 0
    fixed = r.states + r.compute_copies + r.margin
    act = r.activations - r.overlap
    assert -(-act // (cap - fixed)) > 1  # the sequence must be split: cp
    # The RCPs' 256 x 288 GiB at the tier's GBS 256: fsdp=256's gathered blocks hold their experts, and
    # through the backward a block's unsharded fp32 gradient (24.5 GiB): 264.9 GiB with AC, over the line;
    # no ep row (its 251 eval samples split over no expert-parallel ranks: `parallel.check_eval_split`,
    # which `ttt run` applies), so a sample's sequence over 2 GPUs: fsdp=128,cp=2, AC, ~180 GiB.
    _, rows, best = plan(bench, ref, 256, 288, None)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=128,cp=2", True, 1)
    assert best.total <= 0.9 * 288 * GiB and not any("ep=" in r.parallel for r in rows)
    assert all(r.total > 0.9 * 288 * GiB for r in rows if r.parallel == "fsdp=256")
    with pytest.raises(UserError, match="eval_samples 251 must divide over 256 expert-parallel ranks"):
        plan(bench, ref, 256, 288, "ep=256,fsdp=256")


def test_grpo_phases_beside_the_step_are_the_decode_and_the_logprob_check():
    """A GPU decodes its share of the rollouts at once (KV cache of the full-attention layers, fp32 DeltaNet
    state and conv window of the others, at the full sequence length each) and runs the logprob check's
    no-grad forward through the chunked head (its rows' hidden states, fp32 and bf16, and one chunk of
    logits, bf16 and fp32): both by hand from the config."""
    bench = get("qwen35_397b_grpo")
    ref = bench.tier("reference")
    c, T = ref.model, ref.data.seq_len
    full = sum(c.is_full_attention(i) for i in range(c.n_layers))
    row = full * 2 * c.n_kv_heads * c.head_dim * T * 2
    row += (
        (c.n_layers - full)
        * 4
        * (c.lin_v_heads * c.lin_k_dim * c.lin_v_dim + c.conv_dim * (c.conv_kernel - 1))
    )
    phases = bench.task.plan_phases(bench.family, ref, 4, 2)
    chunk = (256 << 20) // (4 * c.vocab_size)
    assert phases == {
        "the rollouts' decode": 4 * row,
        "the logprob check": 4 * T * c.dim * (4 + 2) + chunk * c.vocab_size * (2 + 4),
    }
    # Under cp=2 a rank decodes its data rank's 8 rollouts whole; the check runs on its part of them.
    assert bench.task.plan_phases(bench.family, ref, 4, 2, cp=2) == {
        "the rollouts' decode": 8 * row, "the logprob check": phases["the logprob check"],
    }  # fmt: skip
    # With 4 rollouts a GPU: neither phase outgrows one sample's step any more (the check's whole logits of
    # all 4 did, 569 GiB).
    n = bench.family.param_count(c)
    for kind in ("fsdp", "dp"):
        r = estimate(bench, ref, n, 64, 141, kind, 1, 1, True)
        assert r.peak == "the training step", kind


def test_grpo_head_keeps_the_hidden_states_not_the_logits():
    """What autograd keeps of GRPO's head (`completion_logprobs`: the model's per-token cross-entropy at the
    sampling temperature, bf16 autocast on CPU): the bf16 copy of the final hidden states (the h the plan
    counts for the hidden states' gradient) and the targets; no `[tokens, vocab]` array."""
    from timetotrain.models.common.head_loss import logits_or_loss

    T, d, V = 64, 32, 1000
    head = torch.nn.Linear(d, V, bias=False)
    h = torch.randn(1, T, d, requires_grad=True)
    tokens = torch.randint(0, V, (1, T))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, out = _saved_bytes(lambda: logits_or_loss(h, head, tokens, "none", 0.7), head)
    # The bf16 hidden states, the int64 targets and their bool mask (the weight is a state, not counted).
    assert kept == T * d * 2 + T * 8 + T
    out.sum().backward()


# -- the legal batch sizes of the RCP table where the tier's does not split --


def test_a_gbs_that_does_not_split_is_planned_at_the_rcp_tables_next(capsys):
    """llama31_8b's GBS 16 splits over no layout of 256 GPUs but a CP pair across nodes with TP 8 (TP groups
    are at most 8 wide), a last resort: the plan is made at the RCP table's smallest GBS where a layout
    without CP fits, with that RCP's LR, and the launch line carries it."""
    argv = ["plan", "llama31_8b", "--tier", "reference", "--gpus", "256", "--gpu-mem", "80", "--json"]
    assert main(argv) == 0
    doc = strict_loads(capsys.readouterr().out)
    bench = get("llama31_8b")
    gbs = doc["global_batch_size"]
    assert gbs in bench.rcp_hparams and gbs > bench.tier("reference").global_batch_size
    assert f"planned at {gbs}" in doc["global_batch_size_chosen"]
    assert f"LR {bench.rcp_hparams[gbs].lr:g}" in doc["global_batch_size_chosen"]
    assert f"--set global_batch_size={gbs}" in doc["suggestion"]["launch"]["command"]
    # A GBS the user set is theirs: planned where a layout splits it (16: TP 8 x a CP pair across nodes, 16
    # data-parallel ranks), refused in one line where none does, never replaced.
    assert main([*argv, "--set", "global_batch_size=16"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert (doc["global_batch_size"], doc["suggestion"]["parallel"]) == (16, "fsdp=16,cp=2,tp=8")
    assert main([*argv[:-1], "--set", "global_batch_size=8"]) == 2
    assert "global_batch_size 8 does not split over 256" in capsys.readouterr().err


def test_the_launch_line_carries_the_users_sets(capsys):
    argv = ["plan", "llama31_8b", "--tier", "reference", "--gpus", "8", "--gpu-mem", "80", "--json"]
    assert main([*argv, "--set", "global_batch_size=32", "--set", "lr=9e-4"]) == 0
    flags = strict_loads(capsys.readouterr().out)["suggestion"]["run_flags"]
    assert "--set global_batch_size=32" in flags and "--set lr=0.0009" in flags


def test_a_frozen_base_under_tp_is_charged_its_stored_bytes():
    """llama2_70b_lora tp=2,fsdp=8: the plan charged the frozen base 16 B a parameter, as if trained (258.9
    GiB of states where the built model holds 8.2 a GPU). Under TP as without it, the frozen base weighs the
    task's frozen bytes and only the adapters 16: half of fsdp=8's (the embedding and head, under 1% of
    the parameters, are split over the 8 fsdp ranks in both)."""
    bench = get("llama2_70b_lora")
    tier = bench.tier("reference")
    _, tp_rows, _ = plan(bench, tier, 16, 80, "tp=2,fsdp=8")
    _, fsdp_rows, _ = plan(bench, tier, 8, 80, "fsdp=8")
    assert tp_rows[0].states == pytest.approx(fsdp_rows[0].states / 2, rel=0.01)


def test_pipeline_stages_hold_their_layers_and_the_micro_batches_in_flight():
    """llama31_405b at 512 x 80 GiB under pp=8 (train/memory.py `_pipeline_rows`): a stage's 16 layers
    sharded over its 64 GPUs hold the shards tp=8,fsdp=64 holds plus the stage's whole fp32 gradients (torch's
    schedule turns FSDP2's reduction off until the last micro-batch); 1F1B keeps 8 micro-batches of the
    stage's blocks in flight, interleaving (vpp=2) more; the suggestion launches as `ttt run` takes it."""
    from timetotrain.train import parallel, pipeline

    bench = get("llama31_405b")
    tier = bench.tier("reference")
    n, pp_rows, best = plan(bench, tier, 512, 80, "pp=8,tp=8,fsdp=8")
    _, flat, _ = plan(bench, tier, 512, 80, "tp=8,fsdp=64")
    _, vpp_rows, _ = plan(bench, tier, 512, 80, "pp=8,vpp=2,tp=8,fsdp=8")
    assert {r.parallel for r in pp_rows} == {"pp=8,tp=8,fsdp=8"}
    one = {(r.ac, r.micro_batch): r for r in pp_rows}
    # About a stage's 1/8 of the model, per TP rank, less its shard (the most loaded stage holds 16 of the
    # 126 layers and the embedding whole: 12% more)
    whole_grads = 4 * n / 8 / 8 * (1 - 1 / 8)
    assert one[(0, 1)].states - flat[0].states == pytest.approx(1.12 * whole_grads, rel=0.02)
    stage = dataclasses.replace(tier, model=dataclasses.replace(tier.model, n_layers=16))
    _, stage_rows, _ = plan(bench, stage, 64, 80, "tp=8,fsdp=8")
    assert 4 * stage_rows[0].activations < one[(0, 1)].activations < 8 * stage_rows[0].activations
    interleaved = {(r.ac, r.micro_batch): r for r in vpp_rows}
    assert interleaved[(0, 1)].activations > one[(0, 1)].activations
    assert best is not None and best.total <= 0.9 * 80 * 2**30
    given = parallel.parse(best.parallel, 512)
    local = parallel.check_batch_split(tier.global_batch_size, given)
    assert pipeline.check(bench, tier, given, local, best.micro_batch, True, "--set micro_batch_size")


def test_nvidias_405b_layout_cp_with_tp_and_pp_is_estimated():
    """NVIDIA's llama31_405b layout, TP 8 x PP 8 x CP 2 x DP 4 on 512 x 80 GiB (docs/scale.md), is estimated,
    not dropped to pp x tp: FSDP2 shards a stage over its (fsdp, cp) ranks, so the states equal
    `pp=8,tp=8,fsdp=8`'s, and a rank holds half of each sequence's activations (plus the gathered K/V of
    its heads). The same for `tp=8,cp=2` without pp, against `tp=8,fsdp=64`. The suggestion is what `ttt
    run` takes."""
    from timetotrain.train import context_parallel, parallel, pipeline

    bench = get("llama31_405b")
    tier = bench.tier("reference")
    # (as --parallel names it, as the rows name it: KINDS order, the layout without cp)
    for with_cp, label, without in [
        ("tp=8,cp=2,pp=8,fsdp=4", "pp=8,fsdp=4,cp=2,tp=8", "pp=8,tp=8,fsdp=8"),
        ("tp=8,cp=2,fsdp=32", "fsdp=32,cp=2,tp=8", "tp=8,fsdp=64"),
    ]:
        _, rows, best = plan(bench, tier, 512, 80, with_cp, ac=1)
        _, flat, _ = plan(bench, tier, 512, 80, without, ac=1)
        assert {r.parallel for r in rows} == {label}
        one, other = rows[0], flat[0]
        assert one.micro_batch == other.micro_batch == 1
        assert one.states == pytest.approx(other.states, rel=1e-9)
        assert 0.5 * other.activations < one.activations < other.activations
        assert best is not None and best.total <= 0.9 * 80 * 2**30
        given = parallel.parse(best.parallel, 512)
        context_parallel.check(bench, tier, given, best.parallel)  # `ttt run`'s preflight takes it
        if given.pp > 1:
            local = parallel.check_batch_split(tier.global_batch_size, given)
            assert pipeline.check(bench, tier, given, local, best.micro_batch, True, "--set micro_batch_size")


def test_context_parallel_is_searched_where_nothing_else_fits(capsys):
    """gpt_oss_20b reference on 64 x 18 GiB: no dp, fsdp, ep or tp x ep layout fits at the tier's GBS; the
    search's last resort, cp (train/memory.py module docstring), is tried with each C that splits the batch:
    `cp=C,fsdp=64/C` (FSDP2 over 64 ranks cuts the 32 experts' stacks on their FFN rows, no padded shard:
    train/expert_fsdp.py) and `cp=C,ep=32,fsdp=64/C`; only the latter fits, with AC (the former's gathered
    blocks hold their experts, and their unsharded fp32 gradients through the backward). For an MoE model CP
    within a node stands where TP stands for the others (the MoE TP plans run the MoE whole on every TP
    rank), so `ttt plan` keeps the tier's GBS with it and offers, beside it, the rows of the legal larger GBS
    where a layout without TP or CP fits (`ep=32,fsdp=64` at GBS 64, its expert slices sharded over their 2
    holders). Where a layout without CP
    fits (8 x 80 GiB) the suggestion is that one; GRPO's reference on
    256 x 141 GiB gets cp=8, and `ttt run`'s preflight takes it."""
    from timetotrain.train import context_parallel, parallel

    bench = get("gpt_oss_20b")
    tier = bench.tier("reference")
    _, rows, best = plan(bench, tier, 64, 18, None)
    cap = 0.9 * 18 * GiB
    assert not any(r.total <= cap for r in rows if "cp=" not in r.parallel)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=16,ep=32,cp=4", 1, 1)
    assert not any(r.total <= cap for r in rows if "ep=" not in r.parallel)
    # cp=2 leaves 32 data-parallel ranks, over which GBS 16 does not split: `ttt run` refuses it. Each C
    # with FSDP2 over all the GPUs, and with the experts split over them first (32 experts, 64 GPUs: ep=32).
    cp_rows = {r.parallel for r in rows if "cp=" in r.parallel}
    assert cp_rows == {"fsdp=16,cp=4", "fsdp=8,cp=8", "fsdp=16,ep=32,cp=4", "fsdp=8,ep=32,cp=8"}
    assert main(["plan", bench.name, "--gpus", "64", "--gpu-mem", "18", "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert (doc["global_batch_size"], doc["suggestion"]["parallel"]) == (16, "fsdp=16,ep=32,cp=4")
    assert "--parallel fsdp=16,ep=32,cp=4 " in doc["suggestion"]["launch"]["command"]
    beside = {r["parallel"] for r in doc["rows"] if r["global_batch_size"] == 64 and r["fits"] == "yes"}
    assert beside == {"ep=32,fsdp=64"}
    # Where a layout without CP fits, no CP row is even estimated.
    assert not any("cp=" in r.parallel for r in plan(bench, tier, 8, 80, None)[1])
    # On 32 GPUs the tier's GBS 16 splits only with a sample on 2 GPUs: CP (for an MoE model where TP would
    # stand for the others), with the legal GBS 32's layout without either beside it.
    assert main(["plan", bench.name, "--gpus", "32", "--gpu-mem", "24", "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert (doc["global_batch_size"], doc["suggestion"]["parallel"]) == (16, "fsdp=16,ep=32,cp=2")
    beside = {r["parallel"] for r in doc["rows"] if r["global_batch_size"] == 32 and r["fits"] == "yes"}
    assert "ep=32,fsdp=32" in beside
    # GRPO (its per-token log-probabilities in parts, tasks/grpo.py): nothing without cp fits 256 x 141 GiB,
    # nor cp=4 (129.9 GiB with AC, over the 126.9 usable); cp=8 with checkpointing does.
    grpo = get("qwen35_397b_grpo")
    _, rows, best = plan(grpo, grpo.tier("reference"), 256, 141, None)
    assert not any(r.total <= 0.9 * 141 * GiB for r in rows if "cp=" not in r.parallel)
    assert not any(r.total <= 0.9 * 141 * GiB for r in rows if "cp=4" in r.parallel)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=32,cp=8", 1, 1)
    given = parallel.parse(best.parallel, 256)
    context_parallel.check(
        grpo, grpo.tier("reference"), given, best.parallel
    )  # `ttt run`'s preflight takes it


def test_pipeline_is_searched_where_nothing_else_splits_the_batch(capsys, monkeypatch, tmp_path):
    """llama31_405b reference on 4,096 x 80 GiB: GBS 1152 splits over no 4,096 / tp data-parallel ranks (at
    most 128 of them divide it), nor over a CP pair across nodes' 256, so no layout without pipeline
    parallelism exists (on 2,048 the CP pair splits it: `test_cp_with_tp_across_nodes_where_tp_fills_a_node`);
    the search's last resort (train/memory.py `_pipeline_search_rows`) tries pp = 2 (no split), 4, 8 and stops
    at the fewest stages that fit: `pp=8,tp=8,fsdp=64`, at micro-batch 1 (18 micro-batches a step, the least
    bubble). `ttt run`'s preflight takes the launch line's flags on rank 0 of 4,096, and so does `ttt run
    --dry-run`. Where a layout
    without pp fits (512 x 80) none is even estimated; benchmarks whose families or tasks have no stage
    split (MoE, LoRA, GRPO) get no pp row where nothing fits."""
    import shlex

    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.train import distributed, prepare

    bench = get("llama31_405b")
    tier = bench.tier("reference")
    _, rows, best = plan(bench, tier, 4096, 80, None)
    cap = 0.9 * 80 * GiB
    assert rows and all(r.parallel.startswith("pp=") for r in rows)
    # pp=2 splits it over no 4,096 / (2 x tp) ranks; none past the first fit
    assert {r.parallel.split(",")[0] for r in rows} == {"pp=4", "pp=8"}
    assert not any(r.total <= cap for r in rows if not r.parallel.startswith("pp=8,"))
    assert (best.parallel, best.ac, best.micro_batch) == ("pp=8,tp=8,fsdp=64", 1, 1) and best.total <= cap
    assert main(["plan", bench.name, "--gpus", "4096", "--gpu-mem", "80"]) == 0
    text = capsys.readouterr().out
    assert "micro-batch 1, 18 micro-batches a step (the pipeline schedule needs at least 8)" in text
    assert "pp rows (the search tries them only where no layout without pipeline" in text
    line = next(w.strip() for w in text.splitlines() if w.strip().startswith("torchrun --nnodes 512 "))
    argv = shlex.split(line)
    ttt = argv[argv.index("-m") + 2 :]  # run llama31_405b --tier reference ... --parallel ... --ac
    assert ttt[ttt.index("--parallel") + 1] == "pp=8,tp=8,fsdp=64" and "--ac" in ttt
    # `ttt run`'s preflight on rank 0 of the 4,096, with the line's micro-batch (its --set).
    prep = prepare.preflight(
        bench, apply_overrides(bench, tier, ["micro_batch_size=1"]), tmp_path, "pp=8,tp=8,fsdp=64", "bf16", 1,
        False, device="cpu", ranks=distributed.Dist(rank=0, world=4096, local_rank=0),
    )  # fmt: skip
    assert (prep.plan.pp, prep.plan.tp, prep.plan.fsdp, prep.local_batch, prep.accum) == (8, 8, 64, 18, 18)
    # The launch line's ttt command, as a dry run on that rank (torchrun's environment).
    monkeypatch.setenv("WORLD_SIZE", "4096")
    assert main([*ttt, "--dry-run", "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert doc["rules"]["verdict"] == "pass"
    assert (doc["plan"]["per_rank_batch"], doc["plan"]["accumulation_steps"]) == (18, 18)
    # Where a layout without pp fits, no pp row is estimated.
    assert not any("pp=" in r.parallel for r in plan(bench, tier, 512, 80, None)[1])
    # Where nothing fits, tasks without a stage split get none either (`pipeline.check`: GRPO).
    grpo = get("qwen35_397b_grpo")
    _, rows, best = plan(grpo, grpo.tier("reference"), 128, 80, None)  # (on 141 GiB cp fits)
    assert rows and best is None and not any("pp=" in r.parallel for r in rows)


def test_pipeline_rows_of_lora_and_fp8():
    """pp rows of a LoRA run (train/memory.py `_pipeline_rows`): a stage's frozen base has no gradients and no
    optimizer states, so what the schedule keeps whole until the last micro-batch is its adapters' fp32
    gradients, not the stage's (0.06 GiB here, not 96); ttt plan --simulate counts 16.14 GiB of states on
    rank 0 at `--layers 3` against these 16.33. Under fp8 (tensorwise) the gathered stage holds its float8
    linears at 1 byte: less than the same stage in bf16."""
    from timetotrain.train.memory import fp8_model

    bench = get("llama2_70b_lora")
    tier = bench.tier("reference")
    _, rows, _ = plan(bench, tier, 8, 80, "pp=2,fsdp=4")
    assert rows and {r.parallel for r in rows} == {"pp=2,fsdp=4"}
    stage = dataclasses.replace(tier, model=dataclasses.replace(tier.model, n_layers=40))
    adapters, base = bench.task.param_counts(bench.family, stage)
    # the stage's layout fsdp=4: adapters 16 B and the bf16 base 2 B per parameter, sharded over 4 GPUs;
    # then the adapters' gradients whole (4 B) less their shard
    expected = (16 * adapters + 2 * base) / 4 + 4 * adapters * (1 - 1 / 4)
    assert rows[0].states == pytest.approx(expected, rel=1e-9)
    assert rows[0].states < 17 * 2**30  # were the base's gradients counted: 96 GiB more
    dense = get("llama31_8b")
    ref = dense.tier("reference")
    bf16_rows = plan(dense, ref, 8, 80, "pp=2,fsdp=4")[1]
    fp8_rows = plan(dense, ref, 8, 80, "pp=2,fsdp=4", fp8=fp8_model(dense, ref))[1]
    assert [r.compute_copies for r in fp8_rows] < [r.compute_copies for r in bf16_rows]
    assert [r.states for r in fp8_rows] == [r.states for r in bf16_rows]


def test_sharded_rows_count_a_blocks_unsharded_fp32_gradient():
    """FSDP2 reduce-scatters a block's gradients in fp32 (reduce_dtype, train/parallel.py), whole through the
    backward: llama31_405b `fsdp=64` with AC on 64 x 192 GiB simulated at 161.7 GiB (`--simulate --layers
    3`), 147.0 by the formula without them, 158.9 with. Every sharded row counts them (4 B per parameter of a
    block, as the TP rows do); DDP reduces no gathered block, and its rows are as before."""
    bench = get("llama31_405b")
    tier = bench.tier("reference")
    cfg, fam = tier.model, bench.family
    n, block = fam.param_count(cfg), fam.block_params(cfg)
    root = _root_copies(fam, cfg, True)
    for kind, replicas in (("fsdp", 1), ("hsdp", 8)):
        r = estimate(bench, tier, n, 64, 192, kind, 1, 1, True, replicas=replicas)
        assert r.compute_copies == 2 * 2 * block + 4 * block + root, kind
    assert estimate(bench, tier, n, 64, 192, "dp", 1, 1, True).compute_copies == 2 * n
    # A LoRA block's gradients are its adapters' only.
    lora = get("llama2_70b_lora")
    lt = lora.tier("reference")
    trainable, _ = lora.task.param_counts(lora.family, lt)
    r = estimate(lora, lt, lora.family.param_count(lt.model), 8, 80, "fsdp", 1, 1, True)
    lb = lora.family.block_params(lt.model)
    assert r.compute_copies == 2 * 2 * lb + 4 * trainable / lt.model.n_layers + _root_copies(
        lora.family, lt.model, True
    )


def test_the_search_leaves_out_only_fsdp_that_pads_the_experts():
    """qwen35_397b_grpo's 512 experts under FSDP2 over 1,024 ranks: cut on their FFN rows (train/expert_fsdp.py:
    before, dim 0 padded to one expert per rank simulated at 139.9 GiB against the formula's 58.8 at
    `fsdp=128,cp=8`), no shard is padded, so the search offers such layouts again. Only where no dimension
    of a stacked expert weight splits evenly over more ranks than experts does FSDP2 still pad them, and
    the search leaves that layout out (the user's own is still counted)."""
    bench = get("qwen35_397b_grpo")
    tier = bench.tier("reference")
    assert not padded_experts(tier, "fsdp", 1024) and not padded_experts(tier, "tp", 4096, tp=4)
    assert not padded_experts(tier, "ep,fsdp", 1024, ep=512)
    assert not padded_experts(REF, "fsdp", 1024)  # a dense model
    _, rows, best = plan(bench, tier, 1024, 141, None)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=256,cp=4", 1, 1)
    # On 80 GiB nothing fits: `fsdp=128,cp=8` simulated at 86.3 GiB + 5.0 margin, over the line's 72.0, and the
    # rows now count what the formula missed there, the unsharded fp32 gradient of the 6.6 B-parameter block
    # FSDP2 reduce-scatters (24.5 GiB): 88.3 GiB with the margin.
    assert plan(bench, tier, 1024, 80, None)[2] is None
    row = next(r for r in plan(bench, tier, 1024, 80, "fsdp=128,cp=8")[1] if r.ac and r.micro_batch == 1)
    assert 0.9 * 80 * GiB < row.total < 89 * GiB
    # An odd width and FFN (3 x 1,367, 3 x 341): no dimension of w1 [512, 2,046, 4,101] divides 1,024.
    odd = dataclasses.replace(tier, model=dataclasses.replace(tier.model, dim=4101, expert_ffn_dim=1023))
    assert padded_experts(odd, "fsdp", 1024) and padded_experts(odd, "hsdp", 2048, replicas=2)
    assert not padded_experts(odd, "fsdp", 512)  # fewer ranks than experts: dim 0 splits
    with pytest.raises(UserError, match="does not split"):  # (at 1,024 GPUs only cp or pp rows split GBS 256)
        plan(bench, odd, 1024, 141, None)
    assert plan(bench, odd, 1024, 141, "fsdp=256,cp=4")[1]


def test_hsdp_with_ep_is_offered_and_cp_with_tp_picked_where_needed():
    """The search's other products (train/memory.py `_data_parallel_rows`, `_context_parallel_rows`), each
    planned as `--parallel` names it. HSDP x EP across nodes: gpt_oss_20b at GBS 128 on 2 nodes of 64 GPUs
    (80 GiB) is offered `dp_replicate=2,ep=32,fsdp=64` and `ep=32,fsdp=128` without AC, and picks plain HSDP
    (FSDP2 over the node's 64 ranks cuts the 32 experts' stacks evenly: `expert_fsdp`), which holds less
    and needs no all-to-all; on nodes of 8 likewise.
    cp x tp: llama31_8b at sequence 131,072 on 8 x 48 GiB, where no layout with tp alone or cp alone fits,
    gets `cp=4,tp=2` (fewer TP first: `cp=2,tp=4` fits too), and `ttt run`'s checks take it; on 8 x 64
    `tp=2,fsdp=4` fits and no cp row is estimated."""
    from timetotrain.train import context_parallel, parallel

    bench = get("gpt_oss_20b")
    tier = dataclasses.replace(bench.tier("reference"), global_batch_size=128)
    _, rows, best = plan(bench, tier, 128, 80, None, gpus_per_node=64)
    fits = {r.parallel for r in rows if r.total <= 0.9 * 80 * GiB and not r.ac}
    assert {"ep=32,fsdp=128", "dp_replicate=2,ep=32,fsdp=64"} <= fits
    assert (best.parallel, best.ac, best.micro_batch) == ("dp_replicate=2,fsdp=64", 0, 1)
    tier = dataclasses.replace(bench.tier("reference"), global_batch_size=64)
    _, rows, best = plan(bench, tier, 64, 141, None)
    assert {"dp_replicate=8,fsdp=8", "dp_replicate=8,ep=8,fsdp=8"} <= {r.parallel for r in rows if not r.ac}
    assert (best.parallel, best.ac) == ("dp_replicate=8,fsdp=8", 0)

    ref = dataclasses.replace(
        REF,
        model=dataclasses.replace(REF.model, max_seq_len=131072),
        data=dataclasses.replace(REF.data, seq_len=131072),
    )
    _, rows, best = plan(BENCH, ref, 8, 48, None)
    cap = 0.9 * 48 * GiB
    assert not any(r.total <= cap for r in rows if "cp=" not in r.parallel or "tp=" not in r.parallel)
    assert {"cp=4,tp=2", "cp=2,tp=4"} <= {r.parallel for r in rows if r.total <= cap}
    assert (best.parallel, best.ac, best.micro_batch) == ("cp=4,tp=2", 1, 1)
    given = parallel.parse(best.parallel, 8)
    context_parallel.check(BENCH, ref, given, best.parallel)  # `ttt run`'s preflight takes it
    _, rows, best = plan(BENCH, ref, 8, 64, None)
    assert best.parallel == "tp=2,fsdp=4" and not any("cp=" in r.parallel for r in rows)


def test_cp_with_tp_across_nodes_where_tp_fills_a_node():
    """NVIDIA's llama31_405b layout (TP 8 within a node, CP 2 across two): llama31_405b on 2,048 x 80 GiB,
    where GBS 1152 splits over at most 128 data-parallel ranks and no layout within a node splits it, gets
    `cp=2,tp=8,fsdp=128` (AC, micro-batch 1) before any pipeline, and `ttt run`'s checks take it; on 4,096
    GPUs the CP pair leaves 256 data-parallel ranks (no split), so the pipeline stays (`CROSS_NODE_CP` stops
    at 2). Where a layout within a node fits (llama31_8b at sequence 131,072 on 2 nodes x 36 GiB: cp x fsdp,
    cp x tp within a node), no CP group crosses nodes: its rows are not estimated."""
    from timetotrain.train import context_parallel, parallel

    bench = get("llama31_405b")
    tier = bench.tier("reference")
    _, rows, best = plan(bench, tier, 2048, 80, None)
    assert (best.parallel, best.ac, best.micro_batch) == ("fsdp=128,cp=2,tp=8", 1, 1)
    assert not any("pp=" in r.parallel for r in rows)  # tried before the pipeline, which is not reached
    given = parallel.parse(best.parallel, 2048)
    assert parallel.check_batch_split(tier.global_batch_size, given) == 9
    context_parallel.check(bench, tier, given, best.parallel)
    assert plan(bench, tier, 4096, 80, None)[2].parallel == "pp=8,tp=8,fsdp=64"

    ref = dataclasses.replace(
        REF,
        model=dataclasses.replace(REF.model, max_seq_len=131072),
        data=dataclasses.replace(REF.data, seq_len=131072),
    )
    _, rows, best = plan(BENCH, ref, 16, 36, None)
    assert best.parallel == "fsdp=2,cp=8" and "cp=2,tp=8" not in {r.parallel for r in rows}
    # where nothing within a node fits, the pair across the 2 nodes is estimated (and does not fit either)
    _, rows, best = plan(BENCH, ref, 16, 24, None)
    assert best is None and "cp=2,tp=8" in {r.parallel for r in rows}


def test_an_moe_model_tries_context_before_tensor_parallelism():
    # The MoE TP plans run the router and routed experts whole on every TP rank of a group (the same MoE T
    # times over); CP splits the experts' tokens too. gpt_oss_20b on 64 x 80 GiB at the tier's GBS 16 (a sample
    # on 4 GPUs): `fsdp=16,cp=4`, no TP row estimated; a dense model keeps TP first (llama31_8b: no CP row).
    bench = get("gpt_oss_20b")
    _, rows, best = plan(bench, bench.tier("reference"), 64, 80, None)
    assert best.parallel == "fsdp=16,cp=4" and not any(tp_degree(r) > 1 for r in rows)
    llama = get("llama31_8b")
    _, rows, best = plan(llama, llama.tier("reference"), 64, 80, None)
    assert tp_degree(best) > 1 and not any(degree(r, "cp") > 1 for r in rows)
