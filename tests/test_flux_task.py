"""flux1's objective, sampler, evaluation and schedule (tasks/rectified_flow.py, suite/flux1.py), and its
hyperparameter blocks against the official closed rules and our tiny rule file."""

import dataclasses

import numpy as np
import pytest
import torch
from fakelogs import logged_keys, uncovered_rule_keys

from timetotrain.data import flux_encodings as enc
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks import rectified_flow as rf
from timetotrain.train import schedule

BENCH = get("flux1")
CFG = dataclasses.replace(
    BENCH.tier("tiny").model, dim=32, n_heads=2, axes_dim=(4, 6, 6), latent_channels=4, latent_size=4,
    txt_len=4, txt_dim=8, vec_dim=6,
)  # fmt: skip


def write_dataset(root, cfg, n_train=24, n_val=10, seed=0):
    """A small encoded dataset in the layout `ttt data prepare flux` writes, each text row marked by its
    sample (row i's T5 states all equal i + 1), empty-prompt encodings zero."""
    g = torch.Generator().manual_seed(seed)
    shapes = rf.shapes_of(cfg)
    for split, n in (("train", n_train), ("validation", n_val)):
        t5 = (torch.arange(n, dtype=torch.float32) + 1).view(n, 1, 1).expand(n, *shapes.t5)
        arrays = {
            "t5": t5,
            "clip": torch.randn(n, *shapes.clip, generator=g),
            "vae_mean": torch.randn(n, *shapes.latent, generator=g),
            "vae_logvar": torch.full((n, *shapes.latent), -4.0),
        }
        stored = {k: enc.to_numpy(v, "bfloat16") for k, v in arrays.items()}
        # as the tiny tier's stand-in encoders record themselves (FluxData.encoders, .tokenizer)
        meta = {
            "dtypes": dict.fromkeys(enc.FIELDS, "bfloat16"),
            "encoders": "standin",
            "tokenizer": {"name": "llama2"},
        }
        enc.write_split(root, split, [f"{split}{i:04d}" for i in range(n)], stored, meta)
    enc.write_empty(
        root, enc.to_numpy(torch.zeros(shapes.t5), "bfloat16"), enc.to_numpy(torch.zeros(shapes.clip), "bfloat16"),
        "bfloat16",
    )  # fmt: skip
    return root


def tier_for(cfg, **changes):
    t = BENCH.tier("tiny")
    data = dataclasses.replace(t.data, eval_batch=16, **{"eval_repeats": 8, **changes.pop("data", {})})
    return dataclasses.replace(t, model=cfg, data=data, **{"eval_samples": 80, **changes})


def open_data(tmp_path, tier, seed=0, rank=0, world=1):
    resolved = BENCH.task.resolve(tier, tmp_path)
    return BENCH.task.open(
        tier, resolved, seed, Share.of(tier.global_batch_size, rank, world), torch.device("cpu")
    )


# ------------------------------------------------------------------------------------------------ objective


class Constant(torch.nn.Module):
    """Predicts a fixed velocity and records what it was given."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, img, txt, vec, t):
        self.seen = (img.clone(), t.clone())
        return self.value.expand_as(img)


def test_hand_computed_objective():
    x0 = torch.tensor([[[1.0, 2.0]], [[0.0, -2.0]]])
    eps = torch.tensor([[[3.0, -1.0]], [[1.0, 1.0]]])
    t = torch.tensor([0.25, 1.0])
    # x_t = (1 - t) x0 + t eps: [0.75 + 0.75, 1.5 - 0.25] and eps itself at t = 1
    assert torch.equal(rf.noisy(x0, eps, t), torch.tensor([[[1.5, 1.25]], [[1.0, 1.0]]]))
    assert torch.equal(rf.velocity(x0, eps), torch.tensor([[[2.0, -3.0]], [[1.0, 3.0]]]))
    model = Constant(torch.tensor([1.0, 0.0]))
    batch = {"x0": x0, "eps": eps, "t": t, "txt": torch.zeros(2, 1, 1), "vec": torch.zeros(2, 1)}
    # errors (1, -3) and (0, 3): squares 1, 9, 0, 9 -> mean 4.75; per sample 5 and 4.5
    assert rf.flow_loss(model, batch).item() == 4.75
    assert torch.equal(model.seen[0], torch.tensor([[[1.5, 1.25]], [[1.0, 1.0]]]))
    assert torch.equal(rf.per_sample_mse(model, batch), torch.tensor([5.0, 4.5]))


def test_patchify_order():
    z = torch.arange(2 * 4 * 4, dtype=torch.float32).view(1, 2, 4, 4)
    p = rf.patchify(z, 2)
    assert p.shape == (1, 4, 8)
    # patch (row 0, col 1): channel 0 rows 0-1 cols 2-3, then channel 1's
    assert p[0, 1].tolist() == [2, 3, 6, 7, 18, 19, 22, 23]


def test_latent_draw_and_normalisation():
    mean, logvar, eps = torch.tensor([1.0]), torch.tensor([2 * np.log(0.5)]), torch.tensor([2.0])
    # (1 + 0.5 * 2 - 0.1159) * 0.3611
    assert enc.sample_latent(mean, logvar, eps, 0.1159, 0.3611).item() == pytest.approx(1.8841 * 0.3611)


def test_cfg_drop_rate_over_many_draws(tmp_path):
    write_dataset(tmp_path, CFG)
    data = open_data(tmp_path, tier_for(CFG))
    dropped = n = 0
    for step in range(250):
        b = data.batch(step)
        txt_empty = (b["txt"] == 0).flatten(1).all(1)
        assert torch.equal(txt_empty, (b["vec"] == 0).all(1))  # both encodings drop together
        dropped, n = dropped + int(txt_empty.sum()), n + len(txt_empty)
    assert n == 4000
    assert abs(dropped / n - 0.1) < 4 * (0.09 / n) ** 0.5  # 0.1 within 4 standard errors


def test_training_batches_follow_stored_order_and_differ_by_rank(tmp_path):
    write_dataset(tmp_path, CFG)
    tier = tier_for(CFG, data={"cfg_drop": 0.0})
    r0, r1 = open_data(tmp_path, tier, rank=0, world=2), open_data(tmp_path, tier, rank=1, world=2)
    b0, b1 = r0.batch(1), r1.batch(1)
    # step 1 of GBS 16 on 24 samples: rank 0 has samples 16..23, rank 1 re-loops to 0..7
    assert b0["txt"][:, 0, 0].tolist() == list(range(17, 25))
    assert b1["txt"][:, 0, 0].tolist() == list(range(1, 9))
    assert not torch.equal(b0["t"], b1["t"])
    again = open_data(tmp_path, tier, rank=0, world=2).batch(1)
    assert all(torch.equal(again[k], b0[k]) for k in b0)  # a step's batch depends on (seed, rank, step)


def test_eval_timesteps_balanced_and_noise_fixed_by_seed(tmp_path):
    write_dataset(tmp_path, CFG)
    tier = tier_for(CFG, eval_samples=80, data={"eval_repeats": 8})
    a, b, other = open_data(tmp_path, tier), open_data(tmp_path, tier), open_data(tmp_path, tier, seed=1)
    chunks = [a.eval_chunk(c) for c in range(5)]
    t = torch.cat([c["t"] for c in chunks])
    assert torch.equal(torch.bincount((t * 8).long()), torch.full((8,), 10))  # exactly balanced
    assert t[:9].tolist() == [0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 0]
    # each image at all 8 timesteps: items 0..7 are validation sample 0
    assert (torch.cat([c["vec"] for c in chunks])[:8] == chunks[0]["vec"][0]).all()
    assert torch.equal(b.eval_chunk(3)["eps"], chunks[3]["eps"])  # same seed, same noise
    assert not torch.equal(other.eval_chunk(3)["eps"], chunks[3]["eps"])


def test_evaluate_is_the_mean_of_per_item_mse(tmp_path):
    write_dataset(tmp_path, CFG)
    tier = tier_for(CFG, eval_samples=40, data={"eval_repeats": 4})
    data = open_data(tmp_path, tier)
    model = Constant(torch.zeros(CFG.in_channels))
    want = torch.cat(
        [rf.velocity(c["x0"], c["eps"]).square().flatten(1).mean(1) for c in map(data.eval_chunk, range(3))]
    )
    assert len(want) == 40
    assert data.evaluate(model) == pytest.approx(want.double().mean().item(), rel=1e-12)


def test_reference_schedule_is_torchtitan_warmup_then_constant():
    tier = BENCH.tier("reference")
    lr = schedule.for_tier(BENCH.schedule, tier)
    assert lr(0) == pytest.approx(2e-4 / 1600)  # (s + 1) / W: the first update already moves
    assert lr(799) == pytest.approx(2e-4 * 800 / 1600)
    assert lr(1599) == lr(1600) == lr(29_999) == 2e-4


# ------------------------------------------------------------------------------------------------ rules


def logged(tier):
    return logged_keys(BENCH, tier)


def test_reference_block_passes_every_official_closed_rule():

    closed = [official_rules_dir() / f for f in BENCH.closed_rules]
    tier = BENCH.tier("reference")
    assert hparam_violations(closed, logged(tier)) == []
    assert dict(logged(tier))["evaluation_frequency"] == 262_144
    assert uncovered_rule_keys(closed, logged(tier)) == []
    bad = apply_overrides(BENCH, tier, ["eval_every_samples=131072"])
    assert any(p.startswith("evaluation_frequency") for p in hparam_violations(closed, logged(bad)))


def test_reference_tier_is_spec_11():
    from timetotrain.models import flux

    tier = BENCH.tier("reference")
    cfg = tier.model
    assert (cfg.dim, cfg.n_heads, cfg.n_double, cfg.n_single, cfg.axes_dim) == (
        3072,
        24,
        19,
        38,
        (16, 56, 56),
    )
    assert (cfg.txt_len, cfg.txt_dim, cfg.vec_dim, cfg.img_len, cfg.in_channels) == (256, 4096, 768, 256, 64)
    assert (tier.data.shift, tier.data.scale, tier.data.cfg_drop) == (0.1159, 0.3611, 0.1)
    assert (tier.eval_samples, tier.target, tier.data.train_samples) == (29_696, 0.586, 1_099_776)
    assert tier.eval_samples % 8 == 0  # the eval timesteps balance exactly
    assert BENCH.optimizer.decay_mask == "all"
    assert flux.param_count(cfg) == pytest.approx(11.9e9, rel=0.01)
    gbs = apply_overrides(BENCH, tier, ["global_batch_size=4096"])
    assert (gbs.lr, gbs.warmup_steps, gbs.eval_every_steps) == (4e-4, 100, 64)


def test_tiny_block_passes_our_rule_file():
    tier = BENCH.tier("tiny")
    assert hparam_violations([rule_file("flux1", "tiny")], logged(tier)) == []
    wrong = apply_overrides(BENCH, tier, ["eval_samples=400"])
    assert hparam_violations([rule_file("flux1", "tiny")], logged(wrong))


# ------------------------------------------------------------------------------------------------ synth


def test_synth_reports_images_and_mfu(tmp_path):
    from timetotrain.models import flux
    from timetotrain.train.synth import SynthOptions, synth

    opts = SynthOptions(
        "flux1", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=3, sets=["global_batch_size=4"]
    )
    s = synth(opts)
    assert s["item"] == "images" and s["images_per_s"] > 0
    assert s["images_per_s"] == pytest.approx(s["samples_per_s"])
    assert s["model_flops_per_sample"] == flux.flops_per_sample(BENCH.tier("tiny").model)
    assert s["model_tflops_per_s"] * 1e12 == pytest.approx(s["images_per_s"] * s["model_flops_per_sample"])
    assert s["mfu"] == pytest.approx(s["model_tflops_per_s_per_device"] / s["peak_tflops_per_device"])
    # random latents and noise: predicting 0 (the zero-initialised output) costs about E|eps - x0|^2 = 2
    assert abs(s["final_loss"] - 2.0) < 0.2


def test_eval_forwards_are_equal_across_ranks(tmp_path):
    """Under FSDP every forward all-gathers with every rank, so each rank runs as many as the others: 7
    chunks over 2 ranks are 4 forwards each, rank 1's last one a repeat that counts nothing."""
    import torch.distributed as dist

    write_dataset(tmp_path, CFG)
    tier = tier_for(CFG, eval_samples=80, data={"eval_repeats": 8})
    tier = dataclasses.replace(tier, data=dataclasses.replace(tier.data, eval_batch=12))  # 7 chunks
    counting = Constant(torch.zeros(CFG.in_channels))
    calls = []
    counting.register_forward_hook(lambda m, args, out: calls.append(len(out)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a one-process group: the all-reduce adds nothing, so each rank's own share comes back
        for rank in (0, 1):
            calls.clear()
            data = open_data(tmp_path, tier, rank=rank, world=2)
            got = data.evaluate(counting)
            assert len(calls) == 4
            mine = [data.eval_chunk(c) for c in range(rank, 7, 2)]
            want = torch.cat([rf.velocity(b["x0"], b["eps"]).square().flatten(1).mean(1) for b in mine])
            assert got == pytest.approx(want.double().mean().item(), rel=1e-12)
    finally:
        dist.destroy_process_group()
