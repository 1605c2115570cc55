"""The environment interface: what GRPO asks of a reward source.

A `Problem` is what the policy is asked (its prompt text) and what the environment checks the answer
against (an expected answer, or unit tests). `Environment.score(problem, completion)` returns an `Outcome`
whose reward is in [0, 1] (the reference's rewards are binary: 1 when the patch passes its tests), never
raising on a bad completion: a completion is untrusted model output, and whatever it does (loops, crashes,
floods, escapes) is a reward of 0 with a reason, within `timeout_s`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str | None = None  # what an exact-answer environment compares with
    tests: str | None = None  # Python unit tests (asserts) a code environment runs the completion against


@dataclass(frozen=True)
class Outcome:
    reward: float
    reason: str = ""  # why the reward is not 1 ("timeout", "wrong answer", "exit 1", ...); "" when it is
    seconds: float = 0.0


class Environment(ABC):
    timeout_s: float = 10.0  # wall-clock limit of one `score`

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> Outcome:
        """The reward of `completion` for `problem`; never raises for anything the completion holds."""

    def score_many(self, problems: list[Problem], completions: list[str]) -> list[Outcome]:
        """Rewards of a batch of rollouts, one per (problem, completion) pair."""
        return [self.score(p, c) for p, c in zip(problems, completions, strict=True)]
