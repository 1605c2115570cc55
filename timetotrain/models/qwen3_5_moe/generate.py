"""Batched autoregressive decoding for the qwen3_5_moe family: the PyTorch rollout engine GRPO samples from.

`generate(model, prompts, ...)` left-pads the prompts into one block (padding is internal: the caller passes
plain token lists and gets plain token lists back), runs the block through the model once (`Qwen35Moe.decode`, called as `model(tokens, cache=cache)`) (the
prefill: chunked DeltaNet, causal attention under the padding mask) and then one column per step (the recurrent
DeltaNet form, attention over the KV cache). Each row's positions count from its own first real token and its
padding adds nothing to any state, so a row's tokens do not depend on the other rows it is batched with
(tests/test_qwen3_5_moe.py checks it). A row stops after `eos_id` (kept as its last token) or after
`max_new_tokens`; finished rows are dropped from the cache, so later steps compute only the live ones.

Sampling, in fp32: `temperature == 0` is greedy (argmax); otherwise the logits are divided by `temperature`,
`top_p < 1` keeps the smallest set of most probable tokens whose probability reaches `top_p` (the first token
always kept; nucleus sampling), and the token is drawn with `torch.multinomial` from `generator`, or, where
the caller passes one generator per prompt, from the row's own stream (models/common/sampling.py: a row's
draws then do not depend on the rows beside it). The returned log-probability of each token is
`log_softmax(logits / temperature)` at the token (`temperature == 0`: of the plain logits), before the top-p
cut: the distribution a full forward of the same weights gives, which GRPO's importance ratio compares
against.
"""

from __future__ import annotations

import torch

from timetotrain.models.common.sampling import Generators, row_uniforms, sample_next


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: Generators = None,
    pad_id: int = 0,
    all_steps: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Completions of every prompt (module docstring): (token lists, fp32 log-probabilities `[len]` per token, on
    the CPU), in the order of `prompt_ids`. Repeat a prompt G times in `prompt_ids` for G generations of it.
    `pad_id`: the token id the padding columns hold (any valid id: they are masked). `all_steps`: run all
    `max_new_tokens` steps over every row, finished or not (the results are the same: only unfinished rows are
    sampled, so `generator` draws what it draws without `all_steps`): under expert parallelism or FSDP every
    rank must make the same number of forwards, whatever its own rows do."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    P = max(len(p) for p in prompt_ids)
    limit = model.cfg.max_seq_len
    if P + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {P} tokens plus max_new_tokens {max_new_tokens} exceeds max_seq_len {limit}"
        )
    was_training = model.training
    model.eval()
    try:
        return _decode(
            model, prompt_ids, P, max_new_tokens, temperature, top_p, eos_id, generator, pad_id, all_steps
        )
    finally:
        model.train(was_training)


def _decode(model, prompt_ids, P, max_new_tokens, temperature, top_p, eos_id, generator, pad_id, all_steps):
    device = model.embed.weight.device
    B = len(prompt_ids)
    block = torch.full((B, P), pad_id, dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        block[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
    n_pad = torch.tensor([P - len(p) for p in prompt_ids], device=device)
    cache = model.new_cache(n_pad, P + max_new_tokens)
    logits = model(block.to(device), cache=cache)[:, -1]

    completions: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    live = torch.arange(B)  # the original index of each row still in the cache
    u = row_uniforms(generator, B, max_new_tokens, device)  # per-row streams, or None

    def draw(logits, rows, step):  # the tokens of original rows `rows`
        return sample_next(logits, temperature, top_p, generator, None if u is None else u[rows, step])

    done = torch.zeros(B, dtype=torch.bool)  # all_steps: rows past their EOS, whose new tokens are dropped
    for step in range(max_new_tokens):
        if all_steps and bool(done.any()):
            # Only the unfinished rows are sampled, in order, as the early-stopping path samples its live rows.
            todo = (~done).nonzero().squeeze(1).to(device)
            tokens = torch.full((B,), pad_id, dtype=torch.long, device=device)
            lp = torch.zeros(B, device=device)
            if len(todo):
                tokens[todo], lp[todo] = draw(logits[todo], todo, step)
        else:
            tokens, lp = draw(logits, live.to(device), step)
        tokens_cpu, lp_cpu = tokens.cpu(), lp.cpu()
        for j, b in enumerate(live.tolist()):
            if done[b]:
                continue
            completions[b].append(int(tokens_cpu[j]))
            logprobs[b].append(lp_cpu[j])
        if step == max_new_tokens - 1:
            break
        if all_steps:
            done = done | (tokens_cpu == eos_id) if eos_id is not None else done
            logits = model(tokens.unsqueeze(1), cache=cache)[:, -1]
            continue
        going = tokens_cpu != eos_id if eos_id is not None else torch.ones_like(tokens_cpu, dtype=torch.bool)
        if not bool(going.any()):
            break
        if not bool(going.all()):
            rows = going.nonzero().squeeze(1)
            cache.keep(rows.to(device))
            live, tokens = live[rows], tokens[rows.to(device)]
        logits = model(tokens.unsqueeze(1), cache=cache)[:, -1]
    return completions, [torch.stack(lp) for lp in logprobs]
