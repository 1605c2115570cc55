"""Strict JSON for every `--json` output and every JSON file ttt writes for other programs to read.

RFC 8259 has no NaN or Infinity; Python's json module writes them anyway, and `python -m json.tool`, jq and
JavaScript's JSON.parse then reject the whole document. A figure that is not a number is written as null,
and the object holding it says why in `<key>_reason` (unless the writer already gave a reason there).
A list has no room for a reason: its non-finite entries become null alone.
"""

from __future__ import annotations

import json
import math


def _why(v: float) -> str:
    return f"not a finite number ({v!r} has no JSON form)"


def strict(obj):
    """A copy of a JSON-able structure in which every non-finite float is None, with its reason."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[k] = strict(v)
            if isinstance(v, float) and not math.isfinite(v):
                out.setdefault(f"{k}_reason", _why(v))
        return out
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """json.dumps of `strict(obj)`, refusing any NaN or Infinity that would still get through (a key)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)
