"""Static decode buffers and the CUDA Graphs that replay the cuda backend's decode step.

A decode step of n sequences (1..8) of `width` rows each (1; or a speculative verify width, the
last token and width - 1 drafts) reads only the first n * width rows of fixed device buffers, so a
graph captured once per (n, attention split bucket, width) replays with new inputs copied into those
buffers. Per step the host fills a pinned staging buffer, copies it in with one asynchronous copy,
replays, and reads the sampled ids back.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

MAX_DECODE_ROWS = 8  # the gemv kernel's row limit, and the engine's lane count


class DecodeState:
    """The fixed device buffers a captured decode step reads and writes (`rows` rows: MAX_DECODE_ROWS,
    times the widest verify width under speculative decoding).

    The step's inputs are one byte buffer, `inputs`: i64 (seeds, steps), f32 (temperature, top_p,
    min_p, presence, frequency), then i32 (ids, positions, kv slots, context_lens, top_k, state slots,
    R each, the decode cu_seqlens 0..R (R + 1) and the block tables [R, max_pages]). The host writes
    them into the numpy views host_i64 / host_f32 / host_i32 of a pinned mirror (after `stage()`),
    and `upload(n)` copies the used prefix in one asynchronous copy (i32 entries [:n]).
    masks: the rows' packed token bitmasks (every bit set without a grammar).
    hidden > 0 (pipeline stages): hidden_in / hidden_out and normed_in / normed_out [rows, hidden],
    the residual rows and normed rows a stage takes from the previous one and leaves for the next.
    """

    def __init__(self, *, vocab: int, heads: int, head_dim: int, max_pages: int, max_parts: int,
                 device: torch.device, rows: int = MAX_DECODE_ROWS, hidden: int = 0,
                 hidden_dtype: torch.dtype = torch.bfloat16) -> None:
        R = self.rows = rows
        self.HEAD = 7 * R + 1  # int32 entries before the block tables
        self.max_pages = max_pages
        self.max_parts = max_parts
        self._i32_at = 8 * 2 * R + 4 * 5 * R  # byte offset of the i32 part (i64 first: aligned)
        nbytes = self._i32_at + 4 * (self.HEAD + R * max_pages)
        self.inputs = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.i64 = self.inputs[:16 * R].view(torch.int64)
        self.f32 = self.inputs[16 * R:self._i32_at].view(torch.float32)
        self.i32 = self.inputs[self._i32_at:].view(torch.int32)
        # the pinned mirror (an asynchronous copy needs page-locked memory) and its numpy views
        self._staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = self._staging.numpy()
        self.host_i64 = host[:16 * R].view(np.int64).reshape(2, R)
        self.host_f32 = host[16 * R:self._i32_at].view(np.float32).reshape(5, R)
        self.host_i32 = host[self._i32_at:].view(np.int32)
        self._uploaded: torch.cuda.Event | None = None  # after the last upload's copy
        v = self.i32
        self.ids, self.positions, self.kv_slots = v[0:R], v[R:2 * R], v[2 * R:3 * R]
        self.context_lens, self.top_k, self.state_slots = v[3 * R:4 * R], v[4 * R:5 * R], v[5 * R:6 * R]
        self.cu_seqlens = v[6 * R:7 * R + 1]
        self.host_i32[6 * R:7 * R + 1] = np.arange(R + 1)  # one row per sequence, fixed
        self.cu_seqlens.copy_(torch.from_numpy(self.host_i32[6 * R:7 * R + 1]))
        self.block_tables = v[self.HEAD:].view(R, max_pages)
        self.temperature, self.top_p, self.min_p, self.presence, self.frequency = self.f32.view(5, R).unbind(0)
        self.seeds, self.steps = self.i64.view(2, R).unbind(0)
        self.counts = torch.zeros(R, vocab, dtype=torch.int32, device=device)  # generated-token counts
        self.masks = torch.full((R, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
        self.logits = torch.empty(R, vocab, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(R, dtype=torch.int32, device=device)
        # split-K attention workspace, viewed per bucket as [n, heads, parts, head_dim] (+ [.., 2])
        self._part_out = torch.empty(R * heads * max_parts * head_dim, dtype=torch.float32, device=device)
        self._part_ml = torch.empty(R * heads * max_parts * 2, dtype=torch.float32, device=device)
        self._heads, self._head_dim = heads, head_dim
        self.hidden_in, self.hidden_out, self.normed_in, self.normed_out = (
            torch.zeros(R if hidden else 0, hidden, dtype=hidden_dtype, device=device) for _ in range(4))

    def stage(self) -> None:
        """Wait until the pinned mirror is free to write (the last upload's copy has run)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self, i32_entries: int) -> None:
        """Copy i64, f32 and i32 entries [:i32_entries] of the mirror in, on the current stream."""
        end = self._i32_at + 4 * i32_entries
        self.inputs[:end].copy_(self._staging[:end], non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def workspace(self, n: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous fp32 views [n, heads, parts, head_dim] and [n, heads, parts, 2]."""
        h, d = self._heads, self._head_dim
        return (self._part_out[:n * h * parts * d].view(n, h, parts, d),
                self._part_ml[:n * h * parts * 2].view(n, h, parts, 2))


class DecodeGraphs:
    """Runs `step(n, parts, width)` (the whole decode step over n sequences of `width` DecodeState
    rows each, attention split into at most `parts` partitions) through CUDA graphs captured on
    first use, one per (n, parts, width).

    Capture follows the usual recipe: one eager run on a side stream (loads every kernel module,
    which capture forbids), then capture into a shared memory pool, then replay. K/V writes are
    idempotent for fixed inputs (the same slots get the same values), but a recurrent state
    advances in place: `preserve(n)` (optional) saves what the step would advance for rows [:n]
    and returns the function that puts it back after the warm-up run.
    """

    def __init__(self, step: Callable[[int, int, int], None], device: torch.device, enabled: bool = True,
                 preserve: Callable[[int], Callable[[], None]] | None = None) -> None:
        self.step = step
        self.preserve = preserve
        self.device = device
        self.enabled = enabled
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._stream = None  # the capture stream, on this device (torch's shared default is one device's)
        self.captures = 0  # graphs captured so far (tests, logs)

    def run(self, n: int, parts: int, width: int = 1) -> None:
        graph = self._graphs.get((n, parts, width))
        with torch.cuda.device(self.device):  # our kernels launch on the current device's stream
            if not self.enabled:
                self.step(n, parts, width)
                return
            if graph is None:
                graph = self._capture(n, parts, width)
            graph.replay()

    def widths(self) -> set[int]:
        """The verify widths captured so far (1: plain decode)."""
        return {w for _, _, w in self._graphs}

    def _capture(self, n: int, parts: int, width: int) -> torch.cuda.CUDAGraph:
        def warm_up() -> None:
            restore = self.preserve(n) if self.preserve is not None else None
            self.step(n, parts, width)
            if restore is not None:
                restore()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        graph, _ = capture(lambda: self.step(n, parts, width), warm_up, self.device, self._pool, self._stream)
        self._graphs[(n, parts, width)] = graph
        self.captures += 1
        return graph


def capture(fn: Callable[[], Any], warm_up: Callable[[], None], device: torch.device, pool: Any,
            stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn's launches as a CUDA graph in `pool` on `stream` -> (the graph, what fn returned: tensors
    from the pool that its replays write). The usual recipe: warm_up() first, eagerly on a side stream
    (it loads every kernel module and makes every first-use check, which a capture forbids)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        warm_up()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's other threads may touch CUDA (stats) while this thread captures.
    # No garbage collection during the capture (torch collects just before it begins): a cycle
    # holding an old runner's graphs, collected here, would destroy them mid-capture, which
    # CUDA forbids and which invalidates this capture.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class PromptInputs:
    """The fixed device buffers a captured prompt forward reads, for one sequence of up to `rows`
    tokens: i32 ids, positions, kv slots [rows] each, cu_seqlens [2], start_pos [1], state slot
    [1] and the block table [1, max_pages], written by the host into a pinned mirror and copied in
    with one asynchronous copy (as DecodeState's)."""

    def __init__(self, rows: int, max_pages: int, device: torch.device) -> None:
        R = self.rows = rows
        self.max_pages = max_pages
        self.i32 = torch.zeros(3 * R + 4 + max_pages, dtype=torch.int32, device=device)
        self._staging = torch.zeros(self.i32.shape, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = self._staging.numpy()
        self._uploaded: torch.cuda.Event | None = None
        v = self.i32
        self.ids, self.positions, self.kv_slots = v[0:R], v[R:2 * R], v[2 * R:3 * R]
        self.cu_seqlens, self.start_pos, self.state_slots = v[3 * R:3 * R + 2], v[3 * R + 2:3 * R + 3], v[3 * R + 3:3 * R + 4]
        self.block_tables = v[3 * R + 4:].view(1, max_pages)

    def load(self, ids: list[int], start_pos: int, pages: list[int], page_size: int, state_slot: int,
             rows: int) -> None:
        """One sequence's chunk (its pages: the block table up to the chunk's end) as the first `rows`
        rows; the rows past it are padding: token 0 at position 0, no K/V write (slot -1)."""
        if self._uploaded is not None:  # the mirror is free once the last upload's copy has run
            self._uploaded.synchronize()
        self.fill(ids, start_pos, pages, page_size, state_slot, rows)
        self.i32.copy_(self._staging, non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def fill(self, ids: list[int], start_pos: int, pages: list[int], page_size: int, state_slot: int,
             rows: int) -> None:
        """load's host half: the chunk into the pinned mirror."""
        R, n, h = self.rows, len(ids), self.host
        pos = np.arange(start_pos, start_pos + n, dtype=np.int64)
        table = np.asarray(pages, dtype=np.int64)
        h[0:n] = ids
        h[n:rows] = 0
        h[R:R + n] = pos
        h[R + n:R + rows] = 0
        h[2 * R:2 * R + n] = table[pos // page_size] * page_size + pos % page_size
        h[2 * R + n:2 * R + rows] = -1
        h[3 * R:3 * R + 4] = (0, n, start_pos, state_slot)
        h[3 * R + 4:3 * R + 4 + len(pages)] = table


class PromptGraphs:
    """A prompt chunk of one sequence (a prefill, a later chunk, a prefix hit's suffix) through CUDA
    graphs captured on first use, one per row bucket: T tokens run as the next multiple of
    `bucket` rows, which the prompt route's matmuls pad to anyway (ops/cuda_ops.block_mm), so a row
    gets the eager forward's bits; the padding rows (PromptInputs.load) write no K/V and lie past
    the sequence's end, where prompt attention skips them. forward(rows) runs the model over the
    first `rows` rows of `inputs` and returns its normed hidden [rows, hidden]. For models whose
    prompt forward is bound by the host's launches (a small model's chunk costs the device less than
    the host takes to launch its ~10 kernels a layer)."""

    def __init__(self, forward: Callable[[int], torch.Tensor], inputs: PromptInputs, bucket: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.inputs = inputs
        self.bucket = bucket
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._stream = None
        self.captures = 0

    def rows(self, n: int) -> int:
        """The bucket a chunk of n tokens runs in (0: none, longer than the inputs hold)."""
        rows = -(-n // self.bucket) * self.bucket
        return rows if 0 < n and rows <= self.inputs.rows else 0

    def run(self, rows: int) -> torch.Tensor:
        """Replay (capturing on first use) the forward over `rows` rows of the loaded inputs -> its
        hidden [rows, hidden], valid until the next run."""
        entry = self._graphs.get(rows)
        if entry is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = torch.cuda.Stream(self.device)
            entry = self._graphs[rows] = capture(lambda: self.forward(rows), lambda: self.forward(rows),
                                                 self.device, self._pool, self._stream)
            self.captures += 1
        graph, hidden = entry
        graph.replay()
        return hidden


class StagedGraphs:
    """The decode step of pipeline stages (engine/stages.py): each stage's DecodeGraphs on its own
    device, replayed in order, `hand_off(i, rows)` passing stage i's residual rows to stage i + 1
    between them (a graph cannot span devices, so the copy runs between the replays)."""

    def __init__(self, stages: list[DecodeGraphs], hand_off: Callable[[int, int], None]) -> None:
        self.stages = stages
        self.hand_off = hand_off

    @property
    def enabled(self) -> bool:
        return self.stages[0].enabled

    @property
    def captures(self) -> int:
        return sum(g.captures for g in self.stages)

    def widths(self) -> set[int]:
        return set().union(*(g.widths() for g in self.stages))

    def run(self, n: int, parts: int, width: int = 1) -> None:
        for i, graphs in enumerate(self.stages):
            if i:
                self.hand_off(i - 1, n * width)
            graphs.run(n, parts, width)
