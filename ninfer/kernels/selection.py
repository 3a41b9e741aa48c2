"""Choosing routes from measured timings: pure functions over {candidate: {point: seconds}},
used by `ninfer calibrate` and tested without a GPU.

A candidate's score is its weighted total relative time over the points (each point's time
divided by that point's best time; weights default to 1), so a slow point does not drown the fast
ones. The default (today's
route) stays unless another candidate beats it by more than MARGIN, so timing noise does not
flip a choice. A candidate missing a point (not supported there) cannot be chosen.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

C = TypeVar("C", bound=Hashable)
MARGIN = 0.03  # a challenger must be this much faster (relative score) than the default
GRAPH_TOLERANCE = 0.05  # padding n rows up to a larger graph may cost at most this much


def scores(table: Mapping[C, Mapping[Hashable, float]],
           weights: Mapping[Hashable, float] | None = None) -> dict[C, float]:
    """Candidate -> weighted total relative time over every point measured for any candidate (inf
    when it misses one or a time is not a positive finite number)."""
    weights = weights or {}
    points = {p for times in table.values() for p in times}
    best = {p: min((t[p] for t in table.values() if _ok(t.get(p))), default=math.inf) for p in points}
    out: dict[C, float] = {}
    for cand, times in table.items():
        if not points or any(not _ok(times.get(p)) for p in points):
            out[cand] = math.inf
        else:
            out[cand] = sum(weights.get(p, 1.0) * times[p] / best[p] for p in points)
    return out


def pick(table: Mapping[C, Mapping[Hashable, float]], default: C, margin: float = MARGIN,
         weights: Mapping[Hashable, float] | None = None) -> C:
    """The candidate with the least score; the default unless another is more than `margin` better."""
    s = scores(table, weights)
    if not s:
        return default
    best = min(s, key=lambda c: (s[c], c != default))
    if default in s and math.isfinite(s[default]) and s[best] * (1 + margin) >= s[default]:
        return default
    if not math.isfinite(s[best]):
        return default
    return best


def pick_first_point(table: Mapping[C, Mapping[Hashable, float]], default: C, first: Hashable,
                     margin: float = MARGIN) -> C:
    """`first` decides: among the candidates within `margin` of the best time at that point, the
    one `pick` chooses over every point (the default when it is among them)."""
    at = {c: t.get(first) for c, t in table.items() if _ok(t.get(first))}
    if not at:
        return pick(table, default, margin)
    best = min(at.values())
    close = {c: table[c] for c, t in at.items() if t <= best * (1 + margin)}
    return pick(close, default if default in close else min(close, key=lambda c: at[c]), margin)


def pick_graph_rows(step_s: Mapping[int, float], tolerance: float = GRAPH_TOLERANCE) -> tuple[int, ...]:
    """The fewest decode row counts to capture graphs for: n rows run in the smallest captured
    count >= n, and that may cost at most `tolerance` more than a graph of exactly n rows. The
    largest count is always captured; counts without a valid time get their own graph."""
    rows = sorted(step_s)
    if not rows:
        raise ValueError("no decode step timings")
    chosen = [rows[-1]]
    for n in reversed(rows[:-1]):
        t, padded = step_s[n], step_s[chosen[-1]]
        if not (_ok(t) and _ok(padded)) or padded > (1 + tolerance) * t:
            chosen.append(n)
    return tuple(sorted(chosen))


def _ok(t: float | None) -> bool:
    return t is not None and math.isfinite(t) and t > 0
