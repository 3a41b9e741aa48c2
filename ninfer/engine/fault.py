"""Fault injection for the exit-status tests: make a started Engine fail Engine-wide, as a broken
scheduler invariant would (the worker fails every request in flight and refuses new ones; it never
recovers). Only `ninfer serve` reaches it, through NINFER_INJECT_ENGINE_FAULT=N."""
from __future__ import annotations

from typing import Any


class InjectedFault(RuntimeError):
    """The injected Engine-wide failure."""


def fail_after_batches(engine: Any, batches: int) -> None:
    """Wrap the engine's scheduler so that scheduling batch number `batches` + 1 raises InjectedFault
    on the worker (outside the per-step recovery, so the whole Engine fails)."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    seen = {"batches": 0}

    def failing_schedule(*args: Any, **kwargs: Any) -> Any:
        batch = schedule(*args, **kwargs)
        if batch is not None:
            if seen["batches"] >= batches:
                raise InjectedFault(f"injected Engine failure after {batches} batches (NINFER_INJECT_ENGINE_FAULT)")
            seen["batches"] += 1
        return batch

    scheduler.schedule = failing_schedule
