"""Choosing the next token from logits, shared by the decode loops (a family's cached `generate` and the
cache-free oracle in tasks/rollout.py) so that both draw the same random numbers in the same order: greedy
at temperature 0, else nucleus (top-p) sampling with `torch.multinomial` from the caller's generator. The
log-probability returned is log_softmax(logits / temperature) at the chosen token, before the top-p cut
(the distribution the policy-gradient ratio compares with), or of the plain logits when greedy."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens `[B]`, their log-probabilities `[B]`) from next-token `logits` `[B, V]` (module docstring)."""
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
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
