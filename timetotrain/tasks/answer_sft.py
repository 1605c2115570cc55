"""Supervised fine-tuning on the answers of verifiable problems: the off-the-clock base of a GRPO tiny tier.

The reference starts GRPO from a capable pretrained checkpoint; a laptop tier cannot, so `ttt base` trains
a small model briefly on the task format (prompt -> answer, EOS), enough for a non-zero reward at the first
rollouts and not so much that GRPO has nothing to do. The loss is the cross-entropy of the answer tokens
(and the EOS) only; the prompt is context. The evaluation is the same loss on the validation problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from timetotrain.data import arithmetic
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task, evaluate_ratio


@dataclass(frozen=True)
class AnswerData:
    digits: int
    train_problems: int
    val_problems: int
    kind: str = "add"

    @property
    def width(self) -> int:
        """BOS, two operands, '+', '=', the longest answer and EOS."""
        return 1 + 2 * self.digits + 2 + arithmetic.answer_digits(self.digits, self.kind) + 1


def _rows(problems, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens `[N, width]`, labels `[N, width - 1]`: the answer and EOS, -100 elsewhere)."""
    toks = torch.full((len(problems), width), arithmetic.PAD, dtype=torch.long)
    labels = torch.full((len(problems), width - 1), -100, dtype=torch.long)
    for i, p in enumerate(problems):
        prompt, answer = arithmetic.prompt_ids(p), arithmetic.answer_ids(p)
        seq = prompt + answer
        toks[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(answer)
    return toks, labels


class _Answers(RunData):
    def __init__(self, train, val, width, gbs, share: Share, device):
        self.tokens, self.labels = _rows(train, width)
        self.val = _rows([val[i] for i in share.strided(len(val))], width)
        self.gbs, self.local, self.offset = gbs, share.local, share.offset
        self.world, self.device = share.world, device

    def batch(self, step: int) -> Batch:
        n = len(self.tokens)
        idx = torch.arange(step * self.gbs + self.offset, step * self.gbs + self.offset + self.local) % n
        return {"tokens": self.tokens[idx], "labels": self.labels[idx]}

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return model(batch["tokens"][:, :-1], labels=batch["labels"], reduction=reduction)

    def evaluate(self, model, autocast=None) -> float:
        toks, labels = self.val[0].to(self.device), self.val[1].to(self.device)

        def fn(m, _):
            return m(toks[:, :-1], labels=labels, reduction="sum"), (labels != -100).sum()

        return evaluate_ratio(model, [None], fn, self.device, self.world, autocast)


class _RandomAnswers(_Answers):
    def __init__(self, width, local, generator, device):
        self.width, self.local, self.gen, self.device = width, local, generator, device

    def batch(self, step: int) -> Batch:
        toks = torch.randint(
            0, len(arithmetic.CHARS), (self.local, self.width), generator=self.gen, device=self.device
        )
        return {"tokens": toks, "labels": toks[:, 1:].clone()}


class _Resolved:
    def __init__(self, paths):
        self.paths = paths

    def files(self):
        return list(self.paths)


class AnswerSFT(Task):
    metric = Metric("validation answer cross-entropy", higher_is_better=False)

    def data_name(self, tier) -> str:
        d = tier.data
        return f"arithmetic-{d.kind}-{d.digits}d-{d.train_problems}-{d.val_problems}"

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        """The problems the GRPO tier reads too (the same name: one prepared folder serves both)."""
        d = tier.data
        return DataRecipe(
            self.data_name(tier),
            f"{d.train_problems:,} + {d.val_problems:,} {d.digits}-digit {d.kind} problems",
            call=lambda out: arithmetic.write_problems(
                Path(out), d.digits, d.train_problems, d.val_problems, kind=d.kind
            ),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        return _Resolved(arithmetic.check(Path(data_dir), tier.data.digits, tier.data.kind, verify))

    def open(self, tier, resolved, seed, share, device) -> RunData:
        d = tier.data
        train = arithmetic.read(resolved.paths[0], d.digits)
        val = arithmetic.read(resolved.paths[1], d.digits)[: tier.eval_samples]
        return _Answers(train, val, d.width, tier.global_batch_size, share, device)

    def synthetic(self, tier, local_batch, generator, device) -> RunData:
        return _RandomAnswers(tier.data.width, local_batch, generator, device)

    def flops_per_sample(self, family, tier) -> float:
        return family.flops_per_token(tier.model, tier.data.width) * tier.data.width

    def sample_items(self, tier) -> tuple[str, int]:
        return "tokens", tier.data.width

    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        return [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            ("opt_base_learning_rate", tier.lr),
            *bench.optimizer.log_keys(),
            ("train_samples", tier.data.train_problems),
            ("eval_samples", tier.eval_samples),
        ]
