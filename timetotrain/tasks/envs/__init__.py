"""Environments of reinforcement learning with verifiable rewards: a prompt and a completion in, a reward out,
within a time limit (`base.Environment`). `exact.ExactAnswer` compares the completion with a known answer;
`sandbox.CodeRunner` runs it against unit tests in a bubblewrap sandbox (the SWE environment's shape on one
machine)."""

from timetotrain.tasks.envs.base import Environment, Outcome, Problem
from timetotrain.tasks.envs.exact import ExactAnswer
from timetotrain.tasks.envs.sandbox import CodeRunner, Limits, containment

__all__ = ["CodeRunner", "Environment", "ExactAnswer", "Limits", "Outcome", "Problem", "containment"]
