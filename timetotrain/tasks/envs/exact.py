"""The exact-answer verifier: reward 1 when the completion's answer equals the expected one.

The completion's answer is its text up to the first newline, with surrounding whitespace removed (the decode
stops at EOS; anything a model adds after a first line is not its answer). No evaluation of the text, so no
time limit is needed beyond the comparison itself."""

from __future__ import annotations

import time

from timetotrain.tasks.envs.base import Environment, Outcome, Problem


def answer_of(completion: str) -> str:
    return completion.split("\n", 1)[0].strip()


class ExactAnswer(Environment):
    timeout_s = 1.0

    def score(self, problem: Problem, completion: str) -> Outcome:
        t0 = time.monotonic()
        if problem.answer is None:
            raise ValueError("ExactAnswer needs problems with an answer")
        ok = answer_of(completion) == problem.answer.strip()
        return Outcome(1.0 if ok else 0.0, "" if ok else "wrong answer", time.monotonic() - t0)
