"""What an MoE family reports at each eval (`ModelFamily.telemetry`): the tokens each expert received in the
last training forward, per layer, and the spread of the load over the experts."""

from __future__ import annotations

import statistics


def expert_load(per_layer: list[list[int]]) -> tuple[dict, str]:
    """The log figures (`ttt_tokens_per_expert`, `ttt_expert_load`) and the live line's text of the
    `[layers, experts]` token counts."""
    totals = [sum(col) for col in zip(*per_layer, strict=True)]
    mean = statistics.fmean(totals)
    cv = statistics.pstdev(totals) / mean if mean else 0.0
    figures = {
        "ttt_tokens_per_expert": per_layer,
        "ttt_expert_load": {"min": min(totals), "max": max(totals), "cv": cv},
    }
    return figures, f"  experts min {min(totals)} max {max(totals)} CV {cv:.2f}"
