"""The rollout engine: where GRPO's completions come from.

An engine maps prompts (token lists) to completions and the sampler's log-probability of each completion token.
Rollouts are colocated: the engine samples from the very module that trains, between optimizer steps, so the
policy that generates is the policy that is trained (no weight transfer). The engine is an interface so that a
GPU host can plug in an inference server later; the PyTorch one is the default and the one the tests pin.

`TorchRollout(generate)` wraps a family's decode loop with the signature of
`timetotrain.models.qwen3_5_moe.generate.generate` (KV cache and recurrent state); `naive_generate` is a
cache-free decode for any model that maps tokens `[B, T]` to logits `[B, T, V]` (a full forward per new token:
slow, obviously right, the oracle the cached decode is checked against).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from timetotrain.models.common.sampling import Generators, row_uniforms, sample_next

Generate = Callable[..., tuple[list[list[int]], list[torch.Tensor]]]


class RolloutEngine(Protocol):
    def generate(
        self,
        model,
        prompt_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        eos_id: int | None,
        generator: Generators,
        lockstep: bool = False,
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(completions, fp32 log-probabilities `[len]` of each completion's tokens), in prompt order; a
        completion ends after `eos_id` (kept) or at `max_new_tokens`. `generator`: one for the batch, or one
        per prompt (each row then draws from its own stream alone: models/common/sampling.py). `lockstep`: the
        model's forwards are collectives (FSDP2's all-gathers, expert all-to-alls), so every rank must make the
        same number of them, whenever its own rows end."""


@torch.no_grad()
def naive_generate(
    model,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: Generators = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Decode without a cache: prompts of one length at a time, the whole sequence through the model at each
    new token. Draws the random numbers in the order `generate` of qwen3_5_moe does for prompts of one
    length (one multinomial per step over the live rows), or, with one generator per prompt, each row's
    from its own stream as `generate` does whatever the lengths."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = [[] for _ in prompt_ids]
    lps: list[list[float]] = [[] for _ in prompt_ids]
    u = row_uniforms(generator, len(prompt_ids), max_new_tokens, device)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        by_len.setdefault(len(p), []).append(i)
    for rows in by_len.values():
        seqs = torch.tensor([prompt_ids[i] for i in rows], dtype=torch.long, device=device)
        live = list(range(len(rows)))
        for t in range(max_new_tokens):
            logits = model(seqs[live])[:, -1]
            ours = None if u is None else u[[rows[r] for r in live], t]
            tok, lp = sample_next(logits, temperature, top_p, generator, ours)
            nxt = torch.zeros(len(rows), 1, dtype=torch.long, device=device)
            nxt[live, 0] = tok
            seqs = torch.cat([seqs, nxt], 1)
            still = []
            for j, r in enumerate(live):
                out[rows[r]].append(int(tok[j]))
                lps[rows[r]].append(float(lp[j]))
                if eos_id is None or int(tok[j]) != eos_id:
                    still.append(r)
            live = still
            if not live:
                break
    model.train(was_training)
    return out, [torch.tensor(x, dtype=torch.float32) for x in lps]


class TorchRollout:
    """The default engine: a PyTorch decode loop on the training module itself (colocated)."""

    name = "pytorch"

    def __init__(self, generate: Generate = naive_generate):
        self._generate = generate

    def generate(
        self, model, prompt_ids, *, max_new_tokens, temperature, top_p, eos_id, generator, lockstep=False
    ):
        # In lockstep every rank decodes all `max_new_tokens` steps (the family's `all_steps`: the same
        # completions, finished rows' new tokens dropped). A vote across ranks at each step would stop once
        # every rank is done; it is not written, as the model's decode holds no collective of its own.
        steps = {"all_steps": True} if lockstep else {}
        return self._generate(
            model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            eos_id=eos_id, generator=generator, **steps,
        )  # fmt: skip
