"""Copies between a runner's context pools and host memory: the one mover every tier uses.

A runner exposes its pools through `context_tensors()`: (page-indexed tensors [num_pages, ...],
slot-indexed tensors [num_state_slots, ...]). `read` gathers some pages and state slots into host
tensors, `write` scatters host tensors back into pages and slots.

On CUDA both run on a side stream into and out of pinned host memory. The engine's stream waits
only for the gather (a read) or the scatter (a write) on the device, never on the host, so a
device-to-host copy of an evicted entry overlaps the next forward; the image carries an event
that a reader of its host tensors waits on (SessionImage.wait). The pages a read gathered may be
reallocated at once: the next kernel that writes them is ordered after the gather. The pools of
pipeline stages (--devices) live on several devices: each device's tensors move on a side
stream of that device, and a read's event is then one per device (`Events`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor index_select / index_copy_ take: float8 (fp8 KV codes) viewed as its bytes,
    which those ops do not implement for float8 dtypes."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


class TensorMover:
    """Host <-> device copies of pages and state slots for one runner's pools."""

    def __init__(self, page_tensors: list[torch.Tensor], slot_tensors: list[torch.Tensor],
                 source: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None) -> None:
        # source: the runner's context_tensors, asked at every copy (a resume after a suspend
        # allocates the pools afresh, same layout; holding the old ones would keep a suspended
        # model's pools alive); None: these tensors for good
        self._tensors = ([], []) if source is not None else (page_tensors, slot_tensors)
        self._source = source
        self.device = page_tensors[0].device
        self.cuda = self.device.type == "cuda"
        self._streams: dict[torch.device, Any] = {}  # a side stream per CUDA device of the pools
        self._inflight: list[tuple[Any, list[torch.Tensor]]] = []  # (event, host tensors an h2d copy reads)
        # bytes per page and per state slot, for budgets and gauges
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in page_tensors)
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in slot_tensors) if slot_tensors else 0

    @property
    def page_tensors(self) -> list[torch.Tensor]:
        """The page-indexed pools (float8 codes as bytes: images hold them as uint8)."""
        return [indexable(t) for t in (self._source()[0] if self._source is not None else self._tensors[0])]

    @property
    def slot_tensors(self) -> list[torch.Tensor]:
        return [indexable(t) for t in (self._source()[1] if self._source is not None else self._tensors[1])]

    @classmethod
    def for_runner(cls, runner: Any) -> TensorMover | None:
        """The mover of a runner with `context_tensors()`, else None (no tier can be kept)."""
        get = getattr(runner, "context_tensors", None)
        if get is None:
            return None
        pages, slots = get()
        return cls(list(pages), list(slots), source=get) if pages else None

    def _index(self, ids: list[int], device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device or self.device)

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @staticmethod
    def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[int]]:
        """Positions of the tensors on each device, in order."""
        groups: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.device, []).append(i)
        return groups

    @torch.inference_mode()
    def read(self, pages: list[int], slots: list[int]) -> tuple[list[torch.Tensor], Any]:
        """Host copies of `pages` of every page tensor, then `slots` of every slot tensor, and the
        event they complete at (None on CPU: complete on return)."""
        sources = [(t, pages) for t in self.page_tensors] + [(t, slots) for t in self.slot_tensors]
        if not self.cuda:
            p, s = self._index(pages), self._index(slots)
            return [t.index_select(0, p if ids is pages else s) for t, ids in sources], None
        host: list[Any] = [None] * len(sources)
        events = []
        for device, members in self._by_device([t for t, _ in sources]).items():
            current, stream = torch.cuda.current_stream(device), self._stream(device)
            stream.wait_stream(current)  # the gather sees every write issued before it
            with torch.cuda.stream(stream):
                p, s = self._index(pages, device), self._index(slots, device)
                gathered = [(i, sources[i][0].index_select(0, p if sources[i][1] is pages else s)) for i in members]
                done_gather = torch.cuda.Event()
                done_gather.record(stream)
                for i, g in gathered:
                    h = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    h.copy_(g, non_blocking=True)
                    host[i] = h
                ready = torch.cuda.Event()
                ready.record(stream)
            current.wait_event(done_gather)  # a later write into these pages runs after the gather
            events.append(ready)
        return host, events[0] if len(events) == 1 else Events(events)

    @torch.inference_mode()
    def write(self, pages: list[int], slots: list[int], tensors: list[torch.Tensor]) -> None:
        """Scatter host copies (as `read` returned them) into `pages` and `slots`."""
        targets = [(t, pages) for t in self.page_tensors] + [(t, slots) for t in self.slot_tensors]
        assert len(targets) == len(tensors), "an image for another pool layout"
        for (t, ids), h in zip(targets, tensors):
            assert tuple(h.shape[1:]) == tuple(t.shape[1:]) and h.shape[0] == len(ids) and h.dtype == t.dtype, \
                "an image for another pool layout"
        if not self.cuda:
            p, s = self._index(pages), self._index(slots)
            for (t, ids), h in zip(targets, tensors):
                if len(ids):
                    t.index_copy_(0, p if ids is pages else s, h)
            return
        self._inflight = [(e, k) for e, k in self._inflight if not e.query()]
        for device, members in self._by_device([t for t, _ in targets]).items():
            current, stream = torch.cuda.current_stream(device), self._stream(device)
            stream.wait_stream(current)  # the pages' previous users are done with them
            with torch.cuda.stream(stream):
                p, s = self._index(pages, device), self._index(slots, device)
                for i in members:
                    (t, ids), h = targets[i], tensors[i]
                    if len(ids):
                        t.index_copy_(0, p if ids is pages else s, h.to(device, non_blocking=h.is_pinned()))
                done = torch.cuda.Event()
                done.record(stream)
            current.wait_event(done)  # the forward that reads them runs after the scatter
            self._inflight.append((done, tensors))  # keep the host memory alive until the copy ran

    def image_bytes(self, n_pages: int, n_slots: int) -> int:
        return n_pages * self.page_bytes + n_slots * self.slot_bytes


class Events:
    """The events of a read over several devices' pools, waited on together."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()

    def query(self) -> bool:
        return all(e.query() for e in self.events)
