"""The GRPO task (timetotrain/tasks/grpo.py) and the qwen35_397b_grpo declaration: rollouts through the engine
into loss-ready rows, the global token-level mean across micro-batches, the rollout engines against each other,
pass@k, the eval points in samples, and the reference tier against the closed 6.1 rules (forbidden overrides
refused before any log line)."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from timetotrain.data import arithmetic
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import check_rules, config_keys, parallel_keys, submission_keys
from timetotrain.models.qwen3_5_moe import Qwen35Moe, init_weights
from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.spec.task import Share, split_batch
from timetotrain.suite import qwen35_397b_grpo as Q
from timetotrain.tasks.grpo import _Rollouts
from timetotrain.tasks.policy_gradient import token_logprobs
from timetotrain.tasks.rollout import TorchRollout, naive_generate
from timetotrain.train import prepare

BENCH = Q.BENCHMARK


@pytest.fixture(autouse=True)
def one_thread():
    """Decoding a 318k-parameter model is many small ops: two threads on a loaded 2-core host wait on each
    other far longer than they compute (docs/benchmarks/qwen35_397b_grpo.md, "Threads")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed=0):
    torch.manual_seed(seed)
    m = Qwen35Moe(Q.TINY_MODEL)
    init_weights(m, torch.Generator().manual_seed(seed))
    return m


def _problems(n, digits=2, seed=0):
    import random

    return arithmetic.draw(n, digits, random.Random(seed))


class _Env:
    """Reward 1 for a completion whose first digit is even: a reward the random model meets half the time."""

    def score_many(self, problems, texts):
        from timetotrain.tasks.envs import Outcome

        return [Outcome(float(bool(t) and t[0] in "02468")) for t in texts]


def _data(world=1, rank=0, engine=None, tier=Q.TINY):
    return _Rollouts(
        tier, _problems(64), _problems(16, seed=1), 3, Share.of(tier.global_batch_size, rank, world),
        torch.device("cpu"),
        engine or TorchRollout(generate), _Env(),
    )  # fmt: skip


def test_greedy_decode_with_cache_equals_the_cache_free_oracle_and_logprobs_a_full_forward():
    m = _model()
    prompts = [arithmetic.prompt_ids(p) for p in _problems(6)]
    fast, lp_fast = generate(m, prompts, max_new_tokens=4, temperature=0.0, eos_id=arithmetic.EOS)
    slow, lp_slow = naive_generate(m, prompts, max_new_tokens=4, temperature=0.0, eos_id=arithmetic.EOS)
    assert fast == slow
    for p, c, lp in zip(prompts, fast, lp_fast, strict=True):
        seq = torch.tensor([p + c])
        full = token_logprobs(m(seq[:, :-1]), seq[:, 1:])[0, len(p) - 1 :]
        assert torch.allclose(lp, full, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(lp_fast, lp_slow, strict=True))


def test_prepare_makes_loss_ready_rows_from_the_groups():
    data = _data()
    m = _model()
    batch = data.batch(0)
    G = Q.TINY.data.generations
    assert batch["prompt"].shape == (Q.TINY.global_batch_size, 2 * 2 + 3)
    # Rows come in groups of G copies of one prompt, in the file's order.
    assert batch["index"].view(-1, G).eq(batch["index"].view(-1, G)[:, :1]).all()
    out = data.prepare(m, batch)
    P = batch["prompt"].shape[1]
    assert torch.equal(out["tokens"][:, :P], batch["prompt"])
    # mask[t] = 1 where position t predicts a completion token: from the last prompt position on.
    assert out["mask"][:, : P - 1].sum() == 0 and out["mask"][:, P - 1].eq(1).all()
    # The token count is the global one; each group's advantages sum to ~0 or are all 0.
    assert out["norm"][0] == (out["mask"] * out["sample_mask"][:, None]).sum()
    adv = out["adv"].view(-1, G)
    assert adv.abs().sum() > 0
    # Only rollouts cut at the length cap (no EOS) are masked: sampler and trainer agree, so none is dropped
    # by the log-probability check.
    for row, m_row, keep in zip(out["tokens"][:, 1:], out["mask"], out["sample_mask"], strict=True):
        completion = row[m_row.bool()].tolist()
        assert keep == float(completion[-1] == arithmetic.EOS)
    # The step's rollout figures (logged as ttt_rollout_stats), against the rows by hand.
    done = [row[m_row.bool()].tolist() for row, m_row in zip(out["tokens"][:, 1:], out["mask"], strict=True)]
    ended = torch.tensor([float(c[-1] == arithmetic.EOS) for c in done])
    rewards = torch.tensor([float(arithmetic.decode(c)[:1] in tuple("02468")) for c in done]) * ended
    fig = data.step_figures(data.step_sums().tolist())
    zero_std = (rewards.view(-1, G) == rewards.view(-1, G)[:, :1]).all(1)
    assert torch.equal(zero_std, (adv == 0).all(1))  # those groups, and only those, have no gradient
    assert fig == pytest.approx(
        {"reward": rewards.mean().item(), "completion_tokens": out["mask"].sum().item() / len(done),
         "zero_std_groups": zero_std.float().mean().item(), "truncated": 1 - ended.mean().item(),
         "dropped": 1 - out["sample_mask"].mean().item()}
    )  # fmt: skip
    assert 0 < fig["reward"] < 1 and 0 < fig["zero_std_groups"] < 1


def test_micro_batches_and_their_gradients_add_up_to_the_whole_batch():
    """The harness divides each micro-batch's loss by accum and DDP averages ranks: the task's scaling makes
    the step's gradient the gradient of the global token-level mean, whatever the split."""
    data = _data()
    m = _model()
    batch = data.prepare(m, data.batch(0))
    grads = []
    for accum in (1, 4):
        m.zero_grad()
        total = 0.0
        for mb in split_batch(batch, accum):
            loss = data.loss(m, mb) / accum
            loss.backward()
            total += loss.item()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        if accum == 1:
            whole = total
    assert total == pytest.approx(whole, rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_log_probabilities_leave_the_step_and_the_check_unchanged(temperature, monkeypatch):
    """GRPO's loss and the logprob check read the log-probabilities through the chunked head
    (`completion_logprobs`): the step's loss and every parameter's gradient, and the check's values, equal
    today's whole-logits path (`token_logprobs` of `model(tokens)`), at chunks that do not divide the rows."""
    from timetotrain.models.common import head_loss
    from timetotrain.tasks.grpo import completion_logprobs
    from timetotrain.tasks.policy_gradient import policy_loss

    monkeypatch.setattr(head_loss, "chunk_rows", lambda n, v: 13)
    data = _data()
    data.d = dataclasses.replace(data.d, train_temperature=temperature)
    m = _model()
    batch = data.prepare(m, data.batch(0))
    tokens = batch["tokens"]
    with torch.no_grad():
        whole = token_logprobs(m(tokens[:, :-1]), tokens[:, 1:], temperature)
        torch.testing.assert_close(completion_logprobs(m, tokens, temperature), whole, rtol=1e-6, atol=1e-6)
    got = data.loss(m, batch)
    got.backward()
    got_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    logp = token_logprobs(m(tokens[:, :-1]), tokens[:, 1:], temperature)
    b = batch
    ref = policy_loss(
        logp, b["gen_logp"], b["adv"], b["mask"], b["sample_mask"], b["norm"][0], cfg=data.loss_cfg
    )
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert ref.item() != 0
    for (name, p), g in zip(m.named_parameters(), got_grads, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_ranks_hold_whole_groups_or_equal_parts_of_one_and_an_uneven_split_is_refused():
    a, b = _data(world=2, rank=0), _data(world=2, rank=1)
    ia, ib = a.batch(3)["index"], b.batch(3)["index"]
    assert len(ia) == len(ib) == Q.TINY.global_batch_size // 2 and set(ia.tolist()).isdisjoint(ib.tolist())
    # 16 ranks of GBS 64: 4 rollouts each, half a group of 8; ranks 0 and 1 answer the same prompt.
    halves = [_data(world=16, rank=r).batch(3)["index"] for r in range(3)]
    assert halves[0].tolist() == halves[1].tolist() == [halves[0][0].item()] * 4 != halves[2].tolist()
    with pytest.raises(UserError, match="split a group of 8 generations unevenly"):
        _data(world=8, tier=dataclasses.replace(Q.TINY, global_batch_size=48))


def test_pass_at_k_counts_a_problem_solved_by_any_of_its_samples():
    class Fixed:
        name = "fixed"

        def generate(self, model, prompt_ids, **kw):
            # Problem i of the 16 gets one right answer among its k = 4 samples when i is even.
            out = []
            for j, _ in enumerate(prompt_ids):
                i, s = divmod(j, 4)
                out.append([0, arithmetic.EOS] if (i % 2 == 0 and s == 3) else [1, arithmetic.EOS])
            return out, [torch.zeros(2) for _ in out]

    data = _data(engine=Fixed())
    assert data.evaluate(_model()) == 0.5


def test_eval_points_in_samples():
    task = BENCH.task
    # The closed rule: first at GBS x ceil(2.5 + 3840 / GBS), then every step.
    for gbs, first in ((256, 18), (512, 10), (1024, 7)):
        tier = prepare.resolve_tier(BENCH.name, "reference", [f"global_batch_size={gbs}"])[1]
        assert task.first_eval_step(tier) * gbs == gbs * math.ceil(2.5 + 3840 / gbs)
        assert [s for s in range(1, 25) if task.eval_due(tier, s)] == list(range(first, 25))
    assert [s for s in range(1, 26) if task.eval_due(Q.TINY, s)] == [10, 15, 20, 25]


def _logged(tier):
    return (
        submission_keys(BENCH, tier, "org", "box") + BENCH.hyperparameters(tier)
        + parallel_keys(None, tier.micro_batch_size) + config_keys(BENCH, tier)
    )  # fmt: skip


@pytest.mark.parametrize("gbs", [256, 512, 1024, 2048])
def test_the_reference_tier_passes_the_closed_6_1_rules_at_any_gbs(gbs):
    tier = prepare.resolve_tier(BENCH.name, "reference", [f"global_batch_size={gbs}"])[1]
    files = [official_rules_dir() / f for f in BENCH.closed_rules]
    assert Path(files[1]).name == "closed_qwen35_397b_grpo.yaml" and "training_6.1.0" in str(files[1])
    assert hparam_violations(files, _logged(tier)) == []
    assert tier.lr == pytest.approx(1e-6 * math.sqrt(gbs / 256)) and BENCH.clip(tier) == pytest.approx(
        2 / math.sqrt(gbs)
    )
    check_rules(BENCH, tier)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("generations=8", "num_generations_per_prompt"),
        ("lr=2e-6", "opt_base_learning_rate"),
        ("warmup_steps=5", "opt_learning_rate_warmup_steps"),
        ("eval_samples=256", "eval_samples"),
    ],
)
def test_the_reference_tier_refuses_a_forbidden_override(override, needle):
    with pytest.raises(UserError, match=needle):
        tier = prepare.resolve_tier(BENCH.name, "reference", [override])[1]
        check_rules(BENCH, tier)


def test_the_reference_tier_does_not_run_here(tmp_path):
    with pytest.raises(UserError, match="R2E-Gym SWE agent"):
        BENCH.task.resolve(Q.REFERENCE, tmp_path)


def test_a_sharded_model_decodes_in_lockstep_and_a_whole_one_does_not():
    """Under FSDP2 or expert parallelism a forward is a collective: the engine then runs every decode step on
    every rank (the family's `all_steps`); a whole model stops when its rows have ended."""
    from timetotrain.train.parallel import forwards_are_collective

    seen = []
    engine = TorchRollout(lambda model, prompts, **kw: seen.append(kw.get("all_steps", False)) or ([[1]], []))
    m = _model()
    assert not forwards_are_collective(m)
    for lockstep in (False, True):
        engine.generate(m, [[1]], max_new_tokens=2, temperature=1.0, top_p=1.0, eos_id=0, generator=None,
                        lockstep=lockstep)  # fmt: skip
    assert seen == [False, True]


def test_the_reference_tier_freezes_the_moe_routers_as_the_recipe_and_tiny_trains_them():
    """NeMo-RL's recipe sets `freeze_moe_router: true`: at the reference tier every router takes no gradient
    and is not in the optimizer (built here at the tiny width: the reference's 397B cannot be), and the log
    says so; the tiny tier trains them, as its shipped RCP's runs did."""
    import dataclasses

    from timetotrain.models.common.moe import MoE
    from timetotrain.train.step import build_training

    assert Q.REFERENCE.data.freeze_moe_router and not Q.TINY.data.freeze_moe_router
    for tier, frozen in ((Q.REFERENCE, True), (Q.TINY, False)):
        assert dict(BENCH.hyperparameters(tier))["ttt_freeze_moe_router"] is frozen
    data = dataclasses.replace(Q.TINY.data, freeze_moe_router=Q.REFERENCE.data.freeze_moe_router)
    for tier, frozen in ((dataclasses.replace(Q.TINY, data=data), True), (Q.TINY, False)):
        tr = build_training(BENCH, tier, torch.device("cpu"), 0)
        routers = [m.router.weight for m in tr.bare.modules() if isinstance(m, MoE)]
        assert len(routers) == Q.TINY_MODEL.n_layers
        held = {id(p) for g in tr.opt.param_groups for p in g["params"]}
        assert [r.requires_grad for r in routers] == [not frozen] * len(routers)
        assert [id(r) in held for r in routers] == [not frozen] * len(routers)
        assert len(held) == sum(p.requires_grad for p in tr.bare.parameters())  # the rest all train
        before = [r.detach().clone() for r in routers]
        tr.bare(torch.randint(0, Q.TINY_MODEL.vocab_size, (2, 8))).float().pow(2).mean().backward()
        tr.opt.step()
        assert [torch.equal(r, b) for r, b in zip(routers, before, strict=True)] == [frozen] * len(routers)
