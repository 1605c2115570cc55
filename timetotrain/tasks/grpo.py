"""GRPO with verifiable rewards: every step samples rollouts from the policy, scores them in an environment and
trains on group-relative advantages (MLPerf Training 6.1 qwen35_397b_grpo; docs/benchmarks/qwen35_397b_grpo.md
for every rule and where the reference states it).

A global batch is `num_prompts_per_step` prompts x G generations = GBS rollouts (the samples the log
counts), grouped contiguously. A data-parallel rank holds whole groups, or an equal part of one group
(`check_groups`): then a group spans G / local consecutive ranks, which gather its rewards (`_group_rewards`)
so that each computes the group's statistics over all G, as one process does. Each rollout is sampled from a
stream of its own, seeded by the run's seed, the step and its global generation index (`_row_generators`),
so the rollouts do not depend on how the batch is split. `RunData.batch(step)` gives a rank its rows'
prompts; `prepare(model, batch)` (the loop calls it before each step: `Task.on_policy`) samples
the completions from the current weights through the rollout engine, scores them, and returns the tensors
the loss needs, so that micro-batches of the step are independent rows:

- tokens `[B, P + L]`: prompt then completion, PAD after; `mask` `[B, P + L - 1]`: 1 where position t
  predicts a completion token; `gen_logp`: the sampler's log-probabilities there;
- `adv` `[B]`: group-relative advantages (leave-one-out, zero std undivided), over each whole group;
- `sample_mask` `[B]`: 0 for a rollout cut at the length cap (overlong filtering) or whose trainer and
  sampler log-probabilities disagree (mean exp|gen - prev| > 2);
- `norm` `[B]`: the global batch's valid token count (all ranks), the token-level mean's denominator, and
  `rows`, this rank's rollouts, so each micro-batch's share of the gradient is exact.

Validation: every validation problem sampled `val_generations` times at temperature 0.1 / top-p 0.95, and the
metric is pass@k (a problem counts when any of its k rewards is > 0), strictly above the target.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from timetotrain.data import arithmetic
from timetotrain.errors import UserError
from timetotrain.mlperf.results import ROLLOUT_STATS_KEY
from timetotrain.models.common.head_loss import chunk_rows
from timetotrain.models.common.moe import MoE
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task
from timetotrain.tasks.envs import ExactAnswer
from timetotrain.tasks.envs import Problem as EnvProblem
from timetotrain.tasks.policy_gradient import (
    LOGPROB_ERROR_THRESHOLD,
    TIS_MAX,
    TIS_MIN,
    LossConfig,
    group_advantages,
    logprob_error_mask,
    policy_loss,
)
from timetotrain.tasks.rollout import RolloutEngine, TorchRollout
from timetotrain.train.context_parallel import ContextParallel, SequenceParts
from timetotrain.train.parallel import forwards_are_collective


def reference_first_eval_step(gbs: int) -> int:
    """The closed rules' first validation, in steps: GBS x ceil(2.5 + 3840 / GBS) samples
    (closed_qwen35_397b_grpo.yaml, global_batch_size POST)."""
    return math.ceil(2.5 + 3840 / gbs)


def check_groups(tier, local: int, ranks: int) -> None:
    """Each data-parallel rank holds whole groups of generations, or an equal part of one (a group then spans
    G / local consecutive ranks, which gather its rewards: `_Rollouts._group_rewards`): one line where
    `local` rollouts a rank would cut a group unevenly."""
    g = tier.data.generations
    if local % g and g % local:
        raise UserError(
            f"--set global_batch_size={tier.global_batch_size}: {ranks} data-parallel ranks get {local} "
            f"rollouts each, which would split a group of {g} generations unevenly; make GBS / ranks a "
            f"multiple or a divisor of {g} (change --gpus or --set global_batch_size)"
        )


def stream_seed(seed: int, stream: int, step: int, index: int) -> int:
    """The seed of one rollout's random stream: a hash of the run's seed, the use (1 training rollouts, 2
    validation), the step and the rollout's global index, so that every rank seeds a rollout alike and no
    two rollouts of a run share a stream."""
    key = f"{seed}:{stream}:{step}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (2**63)


@dataclass(frozen=True)
class GRPOData:
    """What a GRPO tier reads and how it samples."""

    generations: int  # G, num_generations_per_prompt
    max_new_tokens: int  # the completion length cap
    seq_len: int  # max_sequence_length: prompt + completion
    train_problems: int  # training prompts in the set (train_samples = this x G, as the reference logs)
    val_problems: int  # the fixed validation set (eval_samples)
    val_generations: int = 4  # k of pass@k
    train_temperature: float = 1.0
    train_top_p: float = 1.0
    val_temperature: float = 0.1
    val_top_p: float = 0.95
    # The first eval step: None is the closed rule's formula of the GBS; then every `eval_every_steps`.
    first_eval_step: int | None = None
    eval_every_steps: int = 1
    environment: str = "exact"  # "exact": arithmetic answers; "swe": the reference's (not runnable here)
    digits: int = 2  # operand digits of the arithmetic problems
    kind: str = "add"  # which problems (data/arithmetic.py): "add" or "reverse"
    logprob_error_threshold: float | None = LOGPROB_ERROR_THRESHOLD
    # NeMo-RL's `freeze_moe_router` (true in the reference recipe): the MoE routers take no gradient and no
    # optimizer state, so the routing stays the checkpoint's (`GRPO.adapt_model`).
    freeze_moe_router: bool = False


# What `_Rollouts.step_sums` adds up over a step's rollouts, in this order (all ranks' sums are added).
ROLLOUT_SUMS = (
    "reward",
    "completion_tokens",
    "zero_std_groups",
    "truncated",
    "dropped",
    "groups",
    "rollouts",
)


def rollout_figures(sums: list[float]) -> dict[str, float]:
    """The `ttt_rollout_stats` of a step from its global ROLLOUT_SUMS: over the global batch, the mean reward,
    the mean completion length (tokens), and the fractions of zero-std groups (all rewards equal: advantage 0,
    no gradient), of rollouts cut at the length cap and of rollouts dropped from the update (cut, or a
    logprob error)."""
    s = dict(zip(ROLLOUT_SUMS, sums, strict=True))
    rollouts, groups = max(s["rollouts"], 1.0), max(s["groups"], 1.0)
    return {
        "reward": s["reward"] / rollouts,
        "completion_tokens": s["completion_tokens"] / rollouts,
        "zero_std_groups": s["zero_std_groups"] / groups,
        "truncated": s["truncated"] / rollouts,
        "dropped": s["dropped"] / rollouts,
    }


def completion_logprobs(model, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) of each next token of `tokens` `[B, T]` -> `[B, T - 1]` fp32, the
    values of `token_logprobs(model(tokens[:, :-1]), tokens[:, 1:], temperature)`, through the chunked head
    (`head_loss.linear_logprobs`, via the model's per-token cross-entropy): neither the loss, its gradient
    nor the logprob check holds `[tokens, vocab]` logits. Through `forward`, so that DDP and FSDP2's root
    hooks run as for any step."""
    return -model(tokens[:, :-1], tokens[:, 1:], reduction="none", temperature=temperature)


def completion_logprob_parts(
    model: ContextParallel, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, SequenceParts]:
    """`completion_logprobs` under context parallelism: this rank's positions of every row (head-tail,
    the batch padded to 2cp chunks), and the `SequenceParts` that slice the batch's other `[B, T - 1]`
    tensors alike and sum row statistics over the group."""
    values, parts = model.per_token(tokens[:, :-1], tokens[:, 1:], temperature)
    return -values, parts


class _Resolved:
    def __init__(self, paths: list[Path]):
        self.paths = paths

    def files(self) -> list[Path]:
        return list(self.paths)


def _unwrap(model):
    """The module itself under DDP and context-parallel wrappers: decoding calls its methods (`decode`,
    `new_cache`) on whole sequences."""
    while hasattr(model, "module"):
        model = model.module
    return model


class _Rollouts(RunData):
    def __init__(self, tier, train, val, seed, share: Share, device, engine: RolloutEngine, env):
        d = tier.data
        self.tier, self.d, self.train, self.val = tier, d, train, val
        self.G, self.gbs, self.world, self.rank, self.device = (
            d.generations,
            tier.global_batch_size,
            share.world,
            share.rank,
            device,
        )
        self.local, self.offset = share.local, share.offset
        check_groups(tier, self.local, self.world)
        self.seed, self.engine, self.env = seed, engine, env
        self.loss_cfg = LossConfig()
        self.step = 0
        part = share.part(len(val))
        self.val_share, self.val_start = val[part], part.start
        self.last_reward = float("nan")

    # -- the prompts of a step: the file's order, no shuffling (the reference's `data.shuffle: false`) --
    def batch(self, step: int) -> Batch:
        """This rank's rows of the step: global row r answers the step's prompt r // G."""
        first = step * (self.gbs // self.G)
        rows = [(first + (self.offset + i) // self.G) % len(self.train) for i in range(self.local)]
        ids = torch.tensor([arithmetic.prompt_ids(self.train[i]) for i in rows], dtype=torch.long)
        return {"prompt": ids, "index": torch.tensor(rows), "step": torch.full((len(rows),), step)}

    def _row_generators(self, stream: int, step: int, first: int, n: int) -> list[torch.Generator]:
        """One CPU generator per rollout, of global indices first .. first + n - 1 (`stream_seed`): a run is
        repeatable, and a rollout is the same whichever rank (and device) samples it."""
        seeds = [stream_seed(self.seed, stream, step, i) for i in range(first, first + n)]
        return [torch.Generator().manual_seed(s) for s in seeds]

    def _rewards(self, problems, completions) -> torch.Tensor:
        texts = [arithmetic.decode(c) for c in completions]
        outs = self.env.score_many([EnvProblem(p.prompt, answer=p.answer) for p in problems], texts)
        ended = [bool(c) and c[-1] == arithmetic.EOS for c in completions]
        # An answer counts only once the model has ended it: "4" cut at the cap is not "46" unfinished.
        return torch.tensor([o.reward if e else 0.0 for o, e in zip(outs, ended, strict=True)])

    @torch.no_grad()
    def prepare(self, model, batch: Batch) -> Batch:
        """`rollouts`, then the token-level mean's denominator summed over every rank (under cp over the
        first rank of each CP group only: the group's ranks hold the same rollouts)."""
        out = self.rollouts(model, batch)
        n = out["norm"][:1].double()
        if self.world > 1:
            if isinstance(model, ContextParallel) and model.index:
                n.zero_()
            dist.all_reduce(n)
        out["norm"] = n.float().expand(out["norm"].shape[0]).clone()
        return out

    @torch.no_grad()
    def rollouts(self, model, batch: Batch) -> Batch:
        """This rank's rollouts of `batch` as loss-ready rows (module docstring), with `norm` this rank's own
        valid-token count: no collective here, except the forwards of a sharded model (made in lockstep).

        Under context parallelism (`model` a `ContextParallel`) every rank of a CP group decodes its data
        rank's prompts whole, with the same generators (one per rollout), as the forwards of FSDP2
        need anyway; the group's first rank then scores its completions and hands them, their sampler
        log-probabilities and rewards to the others (`SequenceGroup.from_first`), so the group trains on one
        copy however its decodes round. The logprob check then runs in parts (`completion_logprob_parts`).

        Where a group spans several data-parallel ranks their rewards are gathered first (`_group_rewards`:
        an all-reduce of the global batch's rewards, the one collective of its own here)."""
        cp = model if isinstance(model, ContextParallel) else None
        model = _unwrap(model)
        step = int(batch["step"][0])
        prompts = batch["prompt"].tolist()
        problems = [self.train[i] for i in batch["index"].tolist()]
        completions, gen_lps = self.engine.generate(
            model, prompts, max_new_tokens=self.d.max_new_tokens, temperature=self.d.train_temperature,
            top_p=self.d.train_top_p, eos_id=arithmetic.EOS,
            generator=self._row_generators(1, step, self.offset, len(prompts)),
            lockstep=forwards_are_collective(model),
        )  # fmt: skip
        if cp is None:
            rewards = self._rewards(problems, completions)
        else:
            completions, gen_lps, rewards = self._from_first(cp, problems, completions, gen_lps)
        self.last_reward = float(rewards.mean())
        group, at = self._group_rewards(rewards, cp)
        adv = group_advantages(group, self.G)[at : at + len(rewards)]
        B, P = len(prompts), len(prompts[0])
        L = max(1, max(len(c) for c in completions))
        tokens = torch.full((B, P + L), arithmetic.PAD, dtype=torch.long)
        mask = torch.zeros(B, P + L - 1)
        gen = torch.zeros(B, P + L - 1)
        for i, (p, c, lp) in enumerate(zip(prompts, completions, gen_lps, strict=True)):
            tokens[i, :P] = torch.tensor(p)
            if c:
                tokens[i, P : P + len(c)] = torch.tensor(c)
                mask[i, P - 1 : P - 1 + len(c)] = 1.0
                gen[i, P - 1 : P - 1 + len(c)] = lp.float()
        truncated = torch.tensor([not c or c[-1] != arithmetic.EOS for c in completions])
        sample_mask = (~truncated).float()
        tokens, mask, gen = tokens.to(self.device), mask.to(self.device), gen.to(self.device)
        sample_mask = sample_mask.to(self.device)
        if self.d.logprob_error_threshold is not None:
            threshold = self.d.logprob_error_threshold
            if cp is None:
                prev = completion_logprobs(model, tokens, self.d.train_temperature)
                sample_mask = sample_mask * logprob_error_mask(gen, prev, mask, threshold)
            else:
                prev, parts = completion_logprob_parts(cp, tokens, self.d.train_temperature)
                keep = logprob_error_mask(parts.local(gen), prev, parts.local(mask), threshold, parts.rows)
                sample_mask = sample_mask * keep
        n = (mask * sample_mask.unsqueeze(-1)).sum().reshape(1)
        # A split group's figures are counted by the rank holding its first rollout.
        owned = group if at == 0 else group[:0]
        self._sums = self._rollout_sums(rewards, owned, completions, truncated, sample_mask)
        if cp is not None and cp.index:  # the group's figures counted once, by its first rank
            self._sums = torch.zeros_like(self._sums)
        return {
            "tokens": tokens,
            "mask": mask,
            "gen_logp": gen,
            "adv": adv.to(self.device),
            "sample_mask": sample_mask,
            "norm": n.float().expand(B).clone(),
            "rows": torch.full((B,), float(B), device=self.device),
        }

    def _group_rewards(self, rewards: torch.Tensor, cp: ContextParallel | None) -> tuple[torch.Tensor, int]:
        """(the rewards of the whole groups this rank's rollouts belong to, where this rank's rows start among
        them). Whole groups here: its own rewards, no collective. A group split over G / local ranks: the
        global batch's rewards, each rank adding its own at its offset into zeros (under cp only a CP group's
        first rank: the others hold the same rollouts), summed over all ranks in fp64 (exact: one term of each
        row is not zero), and this rank's group cut out, so that every rank of the group computes the
        statistics of all G rewards, as one process does."""
        if self.local % self.G == 0:
            return rewards, 0
        full = torch.zeros(self.gbs, dtype=torch.float64, device=self.device)
        if cp is None or cp.index == 0:
            full[self.offset : self.offset + self.local] = rewards.to(self.device, torch.float64)
        dist.all_reduce(full)
        first = self.offset // self.G * self.G
        return full[first : first + self.G].to("cpu", rewards.dtype), self.offset - first

    def _from_first(self, cp: ContextParallel, problems, completions, gen_lps):
        """The CP group's first rank's completions, their log-probabilities and rewards (scored there only),
        on every rank of the group (`rollouts`)."""
        B, L = len(completions), self.d.max_new_tokens
        toks = torch.full((B, L), -1, dtype=torch.long, device=self.device)
        lps = torch.zeros(B, L, device=self.device)
        rewards = torch.zeros(B, device=self.device)
        if cp.index == 0:
            for i, (c, lp) in enumerate(zip(completions, gen_lps, strict=True)):
                toks[i, : len(c)] = torch.tensor(c, dtype=torch.long)
                lps[i, : len(c)] = lp.float()
            rewards.copy_(self._rewards(problems, completions))
        cp.sequence.from_first(toks, lps, rewards)
        lengths = (toks >= 0).sum(1).tolist()
        toks, lps = toks.cpu(), lps.cpu()
        completions = [toks[i, :n].tolist() for i, n in enumerate(lengths)]
        return completions, [lps[i, :n].clone() for i, n in enumerate(lengths)], rewards.cpu()

    step_key = ROLLOUT_STATS_KEY
    _sums: torch.Tensor | None = None  # of the batch `prepare` made last

    def _rollout_sums(self, rewards, owned, completions, truncated, sample_mask) -> torch.Tensor:
        """This rank's sums of what a GRPO user watches per step (ROLLOUT_SUMS): rewards, completion tokens, groups
        whose rewards are all equal (advantage 0: no gradient), rollouts cut at the length cap, rollouts out of
        the update (cut, or a logprob error), groups, rollouts. `owned`: the rewards of the whole groups this
        rank counts (its own, or a split group's at the rank holding its first rollout). The host's figures
        are known already; the dropped count stays on the device (no sync)."""
        g = owned.view(-1, self.G)
        host = torch.tensor(
            [float(rewards.sum()), float(sum(len(c) for c in completions)),
             float((g == g[:, :1]).all(1).sum()), float(truncated.sum())],
        )  # fmt: skip
        dropped = (sample_mask == 0).sum().reshape(1).to(torch.float32)
        shape = torch.tensor([float(g.shape[0]), float(rewards.numel())])
        return torch.cat([host.to(self.device), dropped, shape.to(self.device)])

    def step_sums(self) -> torch.Tensor | None:
        return self._sums

    def step_figures(self, sums: list[float]) -> dict[str, float]:
        return rollout_figures(sums)

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        """This micro-batch's share of the global token-level loss, scaled so that the harness's mean over
        micro-batches (/ accum) and over ranks (DDP's average) gives exactly sum over the global batch / N."""
        tokens = batch["tokens"]
        if isinstance(model, ContextParallel):
            # This rank's positions of every row; the rows' TIS sums and the loss summed over the group.
            logp, parts = completion_logprob_parts(model, tokens, self.d.train_temperature)
            share = policy_loss(
                logp, parts.local(batch["gen_logp"]), batch["adv"], parts.local(batch["mask"]),
                batch["sample_mask"], batch["norm"][0], cfg=self.loss_cfg, across=parts.rows,
            )  # fmt: skip
            loss = parts.total(share)
        else:
            logp = completion_logprobs(model, tokens, self.d.train_temperature)
            loss = policy_loss(
                logp, batch["gen_logp"], batch["adv"], batch["mask"], batch["sample_mask"], batch["norm"][0],
                cfg=self.loss_cfg,
            )  # fmt: skip
        accum = batch["rows"][0] / tokens.shape[0]
        return loss * accum * self.world

    @torch.no_grad()
    def evaluate(self, model, autocast=None) -> float:
        """pass@k over the fixed validation set (this rank's share, then summed over ranks; under cp each
        group's first rank counts, the group's ranks decoding alike in lockstep)."""
        counted = not (isinstance(model, ContextParallel) and model.index)
        model = _unwrap(model)
        k = self.d.val_generations
        solved = 0.0
        if self.val_share:
            prompts = [arithmetic.prompt_ids(p) for p in self.val_share for _ in range(k)]
            problems = [p for p in self.val_share for _ in range(k)]
            with torch.autocast(
                self.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                completions, _ = self.engine.generate(
                    model, prompts, max_new_tokens=self.d.max_new_tokens, temperature=self.d.val_temperature,
                    top_p=self.d.val_top_p, eos_id=arithmetic.EOS,
                    generator=self._row_generators(2, 0, self.val_start * k, len(prompts)),
                    lockstep=forwards_are_collective(model),
                )  # fmt: skip
            rewards = self._rewards(problems, completions).view(-1, k)
            solved = float((rewards > 0).any(1).sum())
        sums = torch.tensor([solved, float(len(self.val_share))], dtype=torch.float64, device=self.device)
        if self.world > 1:
            sums *= counted
            dist.all_reduce(sums)
        return float(sums[0] / sums[1])

    def figures(self) -> dict[str, float]:
        return {"train_reward_mean": self.last_reward}


class _Synthetic(_Rollouts):
    """Random prompts of the tier's shape for `ttt synth` and the warm-up: rollouts from the (random) model,
    rewards drawn at random (half the rollouts), the same loss. `batch` also carries a loss-ready batch, for
    the warm-up, which calls `loss` without `prepare`."""

    def __init__(self, tier, local_batch, generator, device, engine):
        self.tier, self.d, self.G = tier, tier.data, tier.data.generations
        self.gbs, self.world, self.rank, self.device, self.engine = local_batch, 1, 0, device, engine
        self.local, self.offset, self.loss_cfg, self.gen, self.last_reward = (
            local_batch,
            0,
            LossConfig(),
            generator,
            float("nan"),
        )
        self.d_prompt = 2 * tier.data.digits + 3
        self.seed = 0

    def batch(self, step: int) -> Batch:
        B, P, L = self.local, self.d_prompt, self.d.max_new_tokens
        prompts = torch.randint(0, len(arithmetic.CHARS), (B, P), generator=self.gen, device=self.device)
        tokens = torch.randint(0, arithmetic.VOCAB_SIZE, (B, P + L), generator=self.gen, device=self.device)
        mask = torch.zeros(B, P + L - 1, device=self.device)
        mask[:, P - 1 :] = 1.0
        return {
            "prompt": prompts, "step": torch.full((B,), step, device=self.device),
            "tokens": tokens, "mask": mask, "gen_logp": torch.zeros(B, P + L - 1, device=self.device),
            "adv": torch.randn(B, generator=self.gen, device=self.device),
            "sample_mask": torch.ones(B, device=self.device),
            "norm": torch.full((B,), float(B * L), device=self.device),
            "rows": torch.full((B,), float(B), device=self.device),
        }  # fmt: skip

    def _rewards(self, problems, completions) -> torch.Tensor:
        return (
            torch.rand(len(completions), generator=torch.Generator().manual_seed(len(completions))) < 0.5
        ).float()

    def _group_rewards(self, rewards: torch.Tensor, cp) -> tuple[torch.Tensor, int]:
        # No collective in synth: a split group's other ranks' (random) rewards are this rank's, repeated.
        if self.local % self.G == 0:
            return rewards, 0
        return rewards.repeat(self.G // self.local), 0

    @torch.no_grad()
    def prepare(self, model, batch: Batch) -> Batch:
        self.train = [arithmetic.Problem("", "")] * self.local
        batch = {**batch, "index": torch.zeros(self.local, dtype=torch.long)}
        return super().prepare(model, batch)


class GRPO(Task):
    metric = Metric("validation pass@k (fraction of problems solved)", higher_is_better=True, strict=True)
    settable = {"generations": "num_generations_per_prompt", "max_new_tokens": "max_new_tokens"}
    on_policy = True

    def __init__(self, engine: RolloutEngine | None = None):
        self.engine = engine or TorchRollout()

    def validate(self, tier) -> None:
        d = tier.data
        if tier.global_batch_size % d.generations:
            raise UserError(
                f"--set global_batch_size={tier.global_batch_size}: GBS is prompts x {d.generations} "
                "generations, so it must be a multiple of num_generations_per_prompt"
            )

    def check_share(self, tier, local: int, ranks: int) -> None:
        check_groups(tier, local, ranks)

    def eval_every_steps(self, tier) -> int:
        return tier.data.eval_every_steps

    def adapt_model(self, model, tier, generator, precision: str = "fp32") -> None:
        """Freeze every MoE router where the tier's recipe does (`GRPOData.freeze_moe_router`): the optimizer
        is built over the parameters that require a gradient, so it never holds them."""
        if tier.data.freeze_moe_router:
            for m in model.modules():
                if isinstance(m, MoE):
                    m.router.requires_grad_(False)

    def first_eval_step(self, tier) -> int:
        d = tier.data
        return (
            d.first_eval_step
            if d.first_eval_step is not None
            else reference_first_eval_step(tier.global_batch_size)
        )

    def eval_due(self, tier, step: int) -> bool:
        first = self.first_eval_step(tier)
        return step >= first and (step - first) % self.eval_every_steps(tier) == 0

    def data_name(self, tier) -> str | None:
        d = tier.data
        if d.environment != "exact":
            return None
        return f"arithmetic-{d.kind}-{d.digits}d-{d.train_problems}-{d.val_problems}"

    def data_recipe(self, tier, source: Path) -> DataRecipe | None:
        d = tier.data
        if d.environment != "exact":
            return None
        return DataRecipe(
            self.data_name(tier),
            f"{d.train_problems:,} + {d.val_problems:,} {d.digits}-digit {d.kind} problems",
            call=lambda out: arithmetic.write_problems(
                Path(out), d.digits, d.train_problems, d.val_problems, kind=d.kind
            ),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint: Path | None = None):
        if tier.data.environment != "exact":
            raise UserError(
                f"{tier.data.environment!r} rollouts (the reference's R2E-Gym SWE agent in OpenHands sandboxes) "
                "do not run in timetotrain: the reference tier is for `ttt check`, `ttt plan` and `ttt synth` "
                "(docs/benchmarks/qwen35_397b_grpo.md)"
            )
        return _Resolved(arithmetic.check(Path(data_dir), tier.data.digits, tier.data.kind, verify))

    def open(self, tier, resolved, seed, share, device) -> RunData:
        train_path, val_path = resolved.paths
        train = arithmetic.read(train_path, tier.data.digits)
        val = arithmetic.read(val_path, tier.data.digits)[: tier.eval_samples]
        return _Rollouts(tier, train, val, seed, share, device, self.engine, ExactAnswer())

    def synthetic(self, tier, local_batch, generator, device) -> RunData:
        return _Synthetic(tier, local_batch, generator, device, self.engine)

    def flops_per_sample(self, family, tier) -> float:
        """The training step's model FLOPs of one rollout (forward and backward over prompt + completion); the
        rollout's own decode and the logprob-check forward are not counted."""
        return family.flops_per_token(tier.model, tier.data.seq_len) * tier.data.seq_len

    def sample_items(self, tier) -> tuple[str, int]:
        return "tokens", tier.data.seq_len

    def baseline_loss(self, tier) -> float | None:
        return None

    def plan_phases(self, family, tier, rows: int, act_bytes: int, cp: int = 1) -> dict[str, float]:
        """A GPU's phases beside the step, each with the model states resident: the decode of its rollouts at
        once (each row's cache at the full sequence length; under `cp` every rank of a CP group decodes its
        data rank's cp x `rows` whole, `_Rollouts.rollouts`), and the logprob check's no-grad forward
        through the chunked head (`completion_logprobs`, in parts under cp): the hidden states of its
        `rows` samples' tokens (the final norm's output, fp32 under autocast, and its compute-precision
        copy) and one chunk of logits (compute precision and its fp32 copy)."""
        d, V, dim = tier.data, tier.model.vocab_size, tier.model.dim
        phases = {}
        if family.decode_state_bytes is not None:
            phases["the rollouts' decode"] = (
                cp * rows * family.decode_state_bytes(tier.model, d.seq_len, act_bytes)
            )
        if d.logprob_error_threshold is not None:
            tokens = rows * d.seq_len
            logits = chunk_rows(tokens, V) * V * (act_bytes + (4 if act_bytes < 4 else 0))
            phases["the logprob check"] = tokens * dim * (4 + act_bytes) + logits
        return phases

    def plan_note(self, tier) -> str | None:
        return (
            "activations: the largest of the training step (GRPO's per-token log-probabilities through the "
            "chunked head, one chunk of logits at a time, as a causal LM's loss), the rollouts' decode (each "
            f"GPU's rollouts at once, KV cache and DeltaNet state at {tier.data.seq_len:,} tokens) and the "
            "logprob check's forward (no grad, one chunk of logits); the prefill's own logits and a no-grad "
            "forward's block temporaries are not counted"
        )

    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        """In the order of closed_qwen35_397b_grpo.yaml (its checks read state set by earlier keys), then the
        keys the reference logs beyond the rule file (mlperf_grpo_logging.py), then ours."""
        d, opt = tier.data, bench.optimizer
        return [
            ("global_batch_size", tier.global_batch_size),
            ("max_sequence_length", d.seq_len),
            ("eval_samples", tier.eval_samples),
            ("init_checkpoint_step", 0),
            ("max_steps", tier.max_steps),
            *[kv for kv in opt.log_keys() if kv[0] != "opt_gradient_clip_norm"],
            ("opt_base_learning_rate", tier.lr),
            ("opt_gradient_clip_norm", bench.clip(tier)),
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            ("opt_end_learning_rate", tier.end_lr),
            ("generation_training_rollout_temperature", d.train_temperature),
            ("generation_training_rollout_top_p", d.train_top_p),
            ("generation_validation_rollout_temperature", d.val_temperature),
            ("generation_validation_rollout_top_p", d.val_top_p),
            ("num_prompts_per_step", tier.global_batch_size // d.generations),
            ("num_generations_per_prompt", d.generations),
            ("gradient_accumulation_steps", accum),
            ("train_samples", d.train_problems * d.generations),
            ("generation_backend", self.engine.name),
            ("truncated_importance_sampling_ratio_min", TIS_MIN),
            ("truncated_importance_sampling_ratio", TIS_MAX),
            ("truncated_importance_sampling_type", "seq-mask-tis"),
            ("target_accuracy", tier.target),
            ("ttt_freeze_moe_router", d.freeze_moe_router),  # ours: no rule file names the recipe's switch
        ]
