"""Model suspend (--model-suspend): give an idle Engine's memory back and take it again, keeping the
retained conversations so that their prefixes are reused exactly after a resume.

A suspend runs on the Engine's worker between steps and only while nothing is queued, admitted or
running (EngineBusy otherwise; it never cancels work). The runner copies the live KV pages and
recurrent-state slots (those the page and state pools hold: retained conversations) into a host
snapshot sized to what is live, and drops its weights, its KV pool and its state pool. A resume
reads the weights again from the artifact (--suspend-weights artifact), allocates the pools afresh
and copies the snapshot back into the same page and slot ids, so the scheduler's block tables and
the prefix cache stay valid untouched. `Residency` is what GET /v1/models/{id}/residency reports.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.engine.errors import EngineBusy, SuspendNotSupported

if TYPE_CHECKING:
    from ninfer.engine.engine import Engine


@dataclass(slots=True)
class MemoryMove:
    """What one suspend or resume did."""

    seconds: float
    state_bytes: int  # KV pages and state slots copied (to the snapshot, or back)
    weight_bytes: int  # weights released (suspend) or rebuilt (resume)
    artifact_read_bytes: int  # weight bytes read from the artifact (a resume)

    def to_dict(self) -> dict[str, Any]:
        return {"duration_seconds": self.seconds, "state_bytes": self.state_bytes,
                "weight_bytes": self.weight_bytes, "artifact_read_bytes": self.artifact_read_bytes}


@dataclass(slots=True)
class Residency:
    """The Engine's suspend state and history."""

    state: str = "resident"  # or "suspended"
    releasable_bytes: int = 0  # what a suspend gives back: weights + KV pool + state pool
    host_snapshot_bytes: int = 0  # the snapshot held while suspended
    suspends: int = 0
    resumes: int = 0
    last_suspend: MemoryMove | None = None
    last_resume: MemoryMove | None = None
    last_error: str | None = None
    snapshot: Any = field(default=None, repr=False)  # the runner's snapshot while suspended

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "releasable_device_bytes": self.releasable_bytes,
                "host_snapshot_bytes": self.host_snapshot_bytes, "host_reserved_bytes": 0,
                "suspend_count": self.suspends, "resume_count": self.resumes,
                "last_suspend": self.last_suspend.to_dict() if self.last_suspend else None,
                "last_resume": self.last_resume.to_dict() if self.last_resume else None,
                "last_error": self.last_error}


def check_idle(engine: Engine) -> None:
    """EngineBusy unless nothing is queued, admitted or running (worker thread)."""
    scheduler = engine.scheduler
    busy = []
    if engine._admitted:
        busy.append(f"{engine._admitted} admitted")
    if scheduler.waiting or scheduler.running:
        busy.append("requests scheduled")
    if busy:
        raise EngineBusy(", ".join(busy))


def suspend(engine: Engine) -> Residency:
    """Worker thread: snapshot what is live and release the runner's memory."""
    r = engine.residency
    if r.state == "suspended":
        return r
    runner = engine.runner
    if not hasattr(runner, "release_memory"):
        raise SuspendNotSupported(f"--model-suspend is not supported on the {type(runner).__name__} yet")
    with engine._cv:  # a submit takes the same lock and is refused from here on
        check_idle(engine)
        r.state = "suspending"
    used_pages = sorted(set(range(engine.pool.num_pages)) - set(engine.pool.free_page_ids()))
    used_slots = sorted(set(range(engine.state_pool.num_slots)) - set(engine.state_pool.free_slot_ids())) \
        if engine.state_pool is not None else []
    t0 = time.monotonic()
    try:
        snapshot, state_bytes, weight_bytes = runner.release_memory(used_pages, used_slots)
    except BaseException:
        r.state = "resident"
        raise
    r.last_suspend = MemoryMove(time.monotonic() - t0, state_bytes, weight_bytes, 0)
    r.snapshot, r.host_snapshot_bytes = snapshot, state_bytes
    r.state, r.suspends, r.last_error = "suspended", r.suspends + 1, None
    return r


def resume(engine: Engine) -> Residency:
    """Worker thread: take the memory again and copy the snapshot back. A failure leaves the
    model suspended with its snapshot intact and reports last_error; the next resume retries."""
    r = engine.residency
    if r.state == "resident":
        return r
    t0 = time.monotonic()
    try:
        state_bytes, weight_bytes, read_bytes = engine.runner.restore_memory(r.snapshot)
    except Exception as e:  # noqa: BLE001 - reported, the model stays suspended
        r.last_error = f"{type(e).__name__}: {e}"
        raise
    r.last_resume = MemoryMove(time.monotonic() - t0, state_bytes, weight_bytes, read_bytes)
    r.snapshot, r.host_snapshot_bytes = None, 0
    with engine._cv:
        r.state, r.resumes, r.last_error = "resident", r.resumes + 1, None
    return r


PAGED = ("k", "v", "k_scale", "v_scale")  # caches indexed by page id (the scales of an int8 / fp8 KV cache)


def take_snapshot(caches: dict[str, list[Any]], pages: list[int], slots: list[int], device: Any) -> dict[str, Any]:
    """Host copies of the live rows of a runner's caches: {"k": [...], "v": [...]} (and the int8 /
    fp8 caches' {"k_scale", "v_scale"}) are paged by page id, {"conv": [...], "ssm": [...]} by state
    slot. -> {"pages", "slots", name: [host tensors]}."""
    import torch

    from ninfer.engine.transfer import indexable

    host = torch.device("cpu")
    index = {"pages": torch.tensor(pages, dtype=torch.long, device=device),
             "slots": torch.tensor(slots, dtype=torch.long, device=device)}
    snapshot: dict[str, Any] = {"pages": pages, "slots": slots}
    for name, tensors in caches.items():
        ids = index["pages"] if name in PAGED else index["slots"]
        snapshot[name] = [indexable(t).index_select(0, ids).to(host, copy=True) for t in tensors]
    return snapshot


def restore_snapshot(caches: dict[str, list[Any]], snapshot: dict[str, Any], device: Any) -> int:
    """Copy a snapshot back into freshly allocated caches at the same page and slot ids. -> bytes."""
    import torch

    from ninfer.engine.transfer import indexable

    index = {"pages": torch.tensor(snapshot["pages"], dtype=torch.long, device=device),
             "slots": torch.tensor(snapshot["slots"], dtype=torch.long, device=device)}
    for name, tensors in caches.items():
        ids = index["pages"] if name in PAGED else index["slots"]
        for t, saved in zip(tensors, snapshot[name]):
            indexable(t).index_copy_(0, ids, saved.to(device))
    return snapshot_bytes(snapshot)


def snapshot_bytes(snapshot: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for name, ts in snapshot.items() if name not in ("pages", "slots")
               for t in ts)
