"""Model suspend (--model-suspend): give an idle Engine's memory back and take it again, keeping the
retained conversations so that their prefixes are reused exactly after a resume.

A suspend runs on the Engine's worker between steps and only while nothing is queued, admitted or
running (EngineBusy otherwise; it never cancels work). The runner copies the live KV pages and
recurrent-state slots (those the page and state pools hold: retained conversations; with --spec
mtp the MTP head's pages too) into a host snapshot and gives its memory back; a resume takes it
again, uploads the weights and copies the snapshot back into the same page and slot ids, so the
scheduler's block tables and the prefix cache stay valid untouched. On the cuda backend with CUDA
virtual memory management the runner's device memory sits at fixed addresses (backends/vmm.py,
CudaModelRunner.fix_addresses, done when the model loads with --model-suspend): a suspend releases
the physical memory and keeps the CUDA Graphs, a resume maps fresh memory at the same addresses.
Without VMM (and on the torch backend) a suspend drops the weights and pools and a resume builds
them again. `Residency` is what GET /v1/models/{id}/residency reports.

Where the snapshot lives (--suspend-snapshot): `pageable` host memory allocated at suspend, sized to
what is live and freed after the resume; or `pinned`: a block sized for the whole persistent state
(every KV page and state slot), reserved when the model loads and kept (page-locked when the model
is on a GPU; on the CPU backend the device memory is host memory, so the block is ordinary memory
reserved up front). Where the weights come from at resume (--suspend-weights): the `artifact`
file again, or `host`: a suspend copies the weights into host memory and the resume reads those
instead of the file (at fixed addresses the device's own bytes, copied back as they are; otherwise
the artifact's stored tensors, which the loader reads).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.engine.errors import EngineBusy, SuspendNotSupported

if TYPE_CHECKING:
    from ninfer.engine.engine import Engine


SNAPSHOT_MODES = ("pageable", "pinned")
WEIGHT_MODES = ("artifact", "host")
# caches indexed by KV page id (the scales of an int8 / fp8 KV cache, the MTP head's K/V); the others by state slot
PAGED = ("k", "v", "k_scale", "v_scale", "mtp_k", "mtp_v")


@dataclass(slots=True, frozen=True)
class SuspendOptions:
    """--suspend-snapshot and --suspend-weights."""

    snapshot: str = "pageable"
    weights: str = "artifact"

    def __post_init__(self) -> None:
        from ninfer.errors import ConfigError

        if self.snapshot not in SNAPSHOT_MODES:
            raise ConfigError(f"--suspend-snapshot must be pageable or pinned, got {self.snapshot!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"--suspend-weights must be artifact or host, got {self.weights!r}")


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
    options: SuspendOptions = field(default_factory=SuspendOptions)
    host_reserved_bytes: int = 0  # the pinned snapshot block, held for the life of the model
    snapshot: Any = field(default=None, repr=False)  # the runner's snapshot while suspended
    reserved: Any = field(default=None, repr=False)  # --suspend-snapshot pinned: the block
    weights: Any = field(default=None, repr=False)  # --suspend-weights host: the weights while suspended

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "releasable_device_bytes": self.releasable_bytes,
                "host_snapshot_bytes": self.host_snapshot_bytes, "host_reserved_bytes": self.host_reserved_bytes,
                "suspend_count": self.suspends, "resume_count": self.resumes,
                "last_suspend": self.last_suspend.to_dict() if self.last_suspend else None,
                "last_resume": self.last_resume.to_dict() if self.last_resume else None,
                "last_error": self.last_error}


def configure(engine: Engine, options: SuspendOptions) -> Residency:
    """Worker thread, when the model loads: adopt the options; `pinned` reserves the snapshot block."""
    r = engine.residency
    r.options = options
    runner = engine.runner
    if hasattr(runner, "fix_addresses"):  # before any CUDA Graph is captured over the old addresses
        runner.fix_addresses()
    if options.snapshot == "pinned" and r.reserved is None and hasattr(runner, "suspend_caches"):
        r.reserved = reserve(runner.suspend_caches(), runner.device)
        r.host_reserved_bytes = sum(t.numel() * t.element_size() for ts in r.reserved.values() for t in ts)
    return r


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
    host = r.options.weights == "host"
    try:
        fixed = hasattr(runner, "fix_addresses") and runner.fix_addresses()
        if fixed:  # the weights go to the host, if at all, inside the snapshot
            weights = None
            snapshot, state_bytes, weight_bytes = runner.release_memory(used_pages, used_slots, r.reserved,
                                                                        weights_to_host=host)
        else:
            weights = HostWeights(runner.weights_artifact, runner.device) if host else None
            snapshot, state_bytes, weight_bytes = runner.release_memory(used_pages, used_slots, r.reserved)
    except BaseException:
        r.state = "resident"
        raise
    read = weights.read_bytes if weights is not None else 0
    r.last_suspend = MemoryMove(time.monotonic() - t0, state_bytes, weight_bytes, read)
    r.snapshot, r.weights = snapshot, weights
    held_weights = weights.nbytes if weights is not None else (weight_bytes if fixed and host else 0)
    r.host_snapshot_bytes = state_bytes + held_weights
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
        state_bytes, weight_bytes, read_bytes = engine.runner.restore_memory(r.snapshot, r.weights)
    except Exception as e:
        r.last_error = f"{type(e).__name__}: {e}"
        raise
    r.last_resume = MemoryMove(time.monotonic() - t0, state_bytes, weight_bytes, read_bytes)
    r.snapshot, r.weights, r.host_snapshot_bytes = None, None, 0
    with engine._cv:
        r.state, r.resumes, r.last_error = "resident", r.resumes + 1, None
    return r


class HostWeights:
    """An artifact's stored tensors copied into host memory (--suspend-weights host): what a resume
    reads instead of the file. Same interface as Artifact for the loader (meta, load_parts)."""

    def __init__(self, artifact: Any, device: Any) -> None:
        import torch

        pin = torch.device(device).type == "cuda"
        self.meta = artifact.meta
        self.read_bytes = getattr(artifact, "payload_bytes", 0)  # read from the file at suspend
        # clone: the file's tensors are views of its memory map, which is not a copy in memory
        self._parts = {name: {s: (t.pin_memory() if pin else t.clone()) for s, t in parts.items()}
                       for name, parts in artifact.load_parts("cpu").items()}
        self.nbytes = sum(t.numel() * t.element_size() for parts in self._parts.values() for t in parts.values())
        self.payload_bytes = 0  # a resume from here reads no file

    def load_parts(self, device: Any = "cpu", names: set[str] | None = None) -> dict[str, dict[str, Any]]:
        import torch

        device = torch.device(device)
        chosen = {n: p for n, p in self._parts.items() if names is None or n in names}
        if device.type == "cpu":
            return {name: dict(parts) for name, parts in chosen.items()}
        return {name: {s: t.to(device, non_blocking=True) for s, t in parts.items()}
                for name, parts in chosen.items()}


def reserve(caches: dict[str, list[Any]], device: Any) -> dict[str, list[Any]]:
    """--suspend-snapshot pinned: a host block shaped like every cache (page-locked for a GPU)."""
    import torch

    from ninfer.engine.transfer import indexable

    pin = torch.device(device).type == "cuda"
    return {name: [torch.empty(t.shape, dtype=indexable(t).dtype, device="cpu", pin_memory=pin) for t in tensors]
            for name, tensors in caches.items()}


def take_snapshot(caches: dict[str, list[Any]], pages: list[int], slots: list[int], device: Any,
                  reserved: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Host copies of the live rows of a runner's caches: the PAGED ones by page id (K, V, an int8 /
    fp8 cache's scales, the MTP head's K/V), the others ({"conv": [...], "ssm": [...]}) by state slot. -> {"pages", "slots", name: [host tensors]}.
    With a `reserved` block the rows go to its front, one copy per tensor (no allocation). Float8
    caches move as their bytes (transfer.indexable)."""
    import torch

    from ninfer.engine.transfer import indexable

    host = torch.device("cpu")
    index = {"pages": torch.tensor(pages, dtype=torch.long, device=device),
             "slots": torch.tensor(slots, dtype=torch.long, device=device)}
    snapshot: dict[str, Any] = {"pages": pages, "slots": slots}
    for name, tensors in caches.items():
        ids = index["pages"] if name in PAGED else index["slots"]
        if reserved is None:
            snapshot[name] = [indexable(t).index_select(0, ids).to(host, copy=True) for t in tensors]
            continue
        rows = []
        for t, block in zip(tensors, reserved[name]):
            t, front = indexable(t), block[:len(ids)]
            if t.device.type == "cpu":
                torch.index_select(t, 0, ids, out=front)
            else:
                front.copy_(t.index_select(0, ids), non_blocking=True)
            rows.append(front)
        snapshot[name] = rows
    return snapshot


def restore_snapshot(caches: dict[str, list[Any]], snapshot: dict[str, Any], device: Any) -> int:
    """Copy a snapshot back into freshly allocated caches at the same page and slot ids. -> bytes."""
    import torch

    from ninfer.engine.transfer import indexable

    pinned = torch.device(device).type == "cuda"  # a copy from pageable memory is synchronous anyway
    index = {"pages": torch.tensor(snapshot["pages"], dtype=torch.long, device=device),
             "slots": torch.tensor(snapshot["slots"], dtype=torch.long, device=device)}
    for name, tensors in caches.items():
        ids = index["pages"] if name in PAGED else index["slots"]
        for t, saved in zip(tensors, snapshot[name]):
            indexable(t).index_copy_(0, ids, saved.to(device, non_blocking=pinned))
    return snapshot_bytes(snapshot)


def snapshot_bytes(snapshot: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for name, ts in snapshot.items() if name not in ("pages", "slots")
               for t in ts)
