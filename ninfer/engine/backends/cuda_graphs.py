"""Static decode buffers and the CUDA Graphs that replay the cuda backend's decode step.

A decode step of n rows (1..8) reads only the first n rows of fixed device buffers, so a graph
captured once per (n, attention split bucket) replays with new inputs copied into those buffers.
Per token the host fills three small staging arrays, copies them in, replays, and reads the
sampled ids back.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_DECODE_ROWS = 8  # the gemv kernel's row limit, and the engine's lane count


@dataclass(slots=True)
class Activations:
    """Per-row scratch of one forward, in the activation dtype (bf16 or fp32); row counts may
    exceed the rows in use (padding)."""

    residual: torch.Tensor  # [rows, hidden]: the residual stream
    x: torch.Tensor  # [rows, hidden]: normed input of the next projection
    qkv: torch.Tensor  # [rows, (heads + 2 * kv_heads) * head_dim]
    attn: torch.Tensor  # [rows, heads * head_dim]
    proj: torch.Tensor  # [rows, hidden]: o_proj and down outputs
    gate_up: torch.Tensor  # [rows, 2 * intermediate]
    act: torch.Tensor  # [rows, intermediate]
    positions: torch.Tensor  # [rows] int32
    slots: torch.Tensor  # [rows] int32: page * page_size + pos % page_size

    @classmethod
    def allocate(cls, rows: int, hidden: int, qkv: int, attn: int, inter: int, device: torch.device,
                 positions: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> Activations:
        # Zeroed where a padded row is a matmul input, so padding stays finite.
        bf = dict(dtype=dtype, device=device)
        return cls(torch.empty(rows, hidden, **bf), torch.zeros(rows, hidden, **bf), torch.empty(rows, qkv, **bf),
                   torch.zeros(rows, attn, **bf), torch.empty(rows, hidden, **bf),
                   torch.empty(rows, 2 * inter, **bf), torch.zeros(rows, inter, **bf), positions, slots)


class DecodeState:
    """The fixed device buffers a captured decode step reads and writes (MAX_DECODE_ROWS rows).

    i32 holds, in order: ids, positions, slots, context_lens, top_k (8 each) and the block
    tables [8, max_pages]; f32 holds temperature, top_p, min_p, presence, frequency; i64 holds
    seeds and steps. Each is filled by one host->device copy of its used prefix.
    """

    HEAD = 5 * MAX_DECODE_ROWS  # int32 entries before the block tables

    def __init__(self, *, hidden: int, qkv: int, attn: int, inter: int, vocab: int, heads: int, head_dim: int,
                 max_pages: int, max_parts: int, device: torch.device, dtype: torch.dtype) -> None:
        R = MAX_DECODE_ROWS
        self.max_pages = max_pages
        self.max_parts = max_parts
        self.i32 = torch.zeros(self.HEAD + R * max_pages, dtype=torch.int32, device=device)
        self.f32 = torch.zeros(5 * R, dtype=torch.float32, device=device)
        self.i64 = torch.zeros(2 * R, dtype=torch.int64, device=device)
        v = self.i32
        self.ids, self.context_lens, self.top_k = v[0:R], v[3 * R:4 * R], v[4 * R:5 * R]
        self.block_tables = v[self.HEAD:].view(R, max_pages)
        self.temperature, self.top_p, self.min_p, self.presence, self.frequency = self.f32.view(5, R).unbind(0)
        self.seeds, self.steps = self.i64.view(2, R).unbind(0)
        self.act = Activations.allocate(R, hidden, qkv, attn, inter, device, v[R:2 * R], v[2 * R:3 * R], dtype)
        self.counts = torch.zeros(R, vocab, dtype=torch.int32, device=device)  # generated-token counts
        self.logits = torch.empty(R, vocab, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(R, dtype=torch.int32, device=device)
        # split-K attention workspace, viewed per bucket as [n, heads, parts, head_dim] (+ [.., 2])
        self._part_out = torch.empty(R * heads * max_parts * head_dim, dtype=torch.float32, device=device)
        self._part_ml = torch.empty(R * heads * max_parts * 2, dtype=torch.float32, device=device)
        self._heads, self._head_dim = heads, head_dim

    def workspace(self, n: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous fp32 views [n, heads, parts, head_dim] and [n, heads, parts, 2]."""
        h, d = self._heads, self._head_dim
        return (self._part_out[:n * h * parts * d].view(n, h, parts, d),
                self._part_ml[:n * h * parts * 2].view(n, h, parts, 2))


class DecodeGraphs:
    """Runs `step(n, parts)` (the whole decode step over DecodeState rows [:n], attention split
    into at most `parts` partitions) through CUDA graphs captured on first use, one per (n, parts).

    Capture follows the usual recipe: one eager run on a side stream (loads every kernel module,
    which capture forbids), then capture into a shared memory pool, then replay. The step is
    idempotent for fixed inputs (it rewrites the same K/V slots with the same values), so the
    warm-up and the first replay computing the same step twice is harmless.
    """

    def __init__(self, step: Callable[[int, int], None], device: torch.device, enabled: bool = True) -> None:
        self.step = step
        self.device = device
        self.enabled = enabled
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0  # graphs captured so far (tests, logs)

    def run(self, n: int, parts: int) -> None:
        if not self.enabled:
            self.step(n, parts)
            return
        graph = self._graphs.get((n, parts))
        if graph is None:
            graph = self._capture(n, parts)
        graph.replay()

    def _capture(self, n: int, parts: int) -> torch.cuda.CUDAGraph:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.step(n, parts)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may touch CUDA (stats) while this thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.step(n, parts)
        self._graphs[(n, parts)] = graph
        self.captures += 1
        return graph
