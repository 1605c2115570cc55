"""Choosing the next token from logits, shared by the decode loops (a family's cached `generate` and the
cache-free oracle in tasks/rollout.py) so that both draw the same random numbers in the same order: greedy
at temperature 0, else nucleus (top-p) sampling with `torch.multinomial` from the caller's generator. The
log-probability returned is log_softmax(logits / temperature) at the chosen token, before the top-p cut
(the distribution the policy-gradient ratio compares with), or of the plain logits when greedy.

Per-row streams: a caller may pass one generator per prompt row instead of one for the batch (GRPO, whose
rollout of a global generation index must be the same whichever rank, and beside whichever rows, decodes
it). Each row's generator then draws the row's uniforms for every step at once (`row_uniforms`), and
its token at step t is the inverse CDF of its (top-p cut) distribution at its t-th uniform: what a row
draws depends on its generator alone, never on how many rows were sampled before it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# One generator for the whole batch (or None: torch's default), or one per prompt row (module docstring).
Generators = torch.Generator | Sequence[torch.Generator] | None


def row_uniforms(generator: Generators, rows: int, steps: int, device) -> torch.Tensor | None:
    """`[rows, steps]` uniforms in [0, 1), row i's drawn from `generator[i]` (on its own device), where
    `generator` is one per row; None where it is one generator or None (`torch.multinomial` draws)."""
    if generator is None or isinstance(generator, torch.Generator):
        return None
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for {rows} rows: pass one per row")
    return torch.stack([torch.rand(steps, generator=g, device=g.device) for g in generator]).to(device)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens `[B]`, their log-probabilities `[B]`) from next-token `logits` `[B, V]` (module docstring).
    `uniforms` `[B]`: each row's draw of this step from its own stream (`row_uniforms`), used instead of
    `generator`."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    logp = (logits / temperature).log_softmax(dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more probable tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if uniforms is None:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        # Inverse CDF: the first token whose cumulative mass passes u x total. A zero-mass token (cut by
        # top-p) adds nothing, so it is never chosen; u x total is kept below the total (fp32 rounding), so
        # no row runs past its last token of mass.
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        x = torch.minimum(
            uniforms.to(cdf).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
        )
        tokens = torch.searchsorted(cdf, x, right=True).squeeze(1)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
