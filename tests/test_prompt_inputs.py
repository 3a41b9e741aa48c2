"""cuda_graphs.PromptInputs.fill: a prompt chunk's rows as a prompt graph reads them (on CPU: the host
mirror's layout), the padding rows at position 0 with no K/V slot, the sequence's extent in cu_seqlens."""
from __future__ import annotations

import numpy as np
import torch

from ninfer.engine.backends.cuda_graphs import PromptGraphs, PromptInputs


def test_fill_lays_out_a_chunk_and_its_padding() -> None:
    inputs = PromptInputs(rows=16, max_pages=6, device=torch.device("cpu"))
    R, h = 16, inputs.host
    h[:] = 77  # stale values from an earlier chunk
    # a later chunk: 5 tokens at positions 6..10 over pages [4, 2, 9] of 4 slots each, in an 8-row bucket
    inputs.fill([11, 12, 13, 14, 15], 6, [4, 2, 9], 4, -1, 8)
    assert h[0:8].tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert h[R:R + 8].tolist() == [6, 7, 8, 9, 10, 0, 0, 0]
    # position p sits at page table[p // 4], slot p % 4
    assert h[2 * R:2 * R + 8].tolist() == [2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, -1, -1, -1]
    assert h[3 * R:3 * R + 4].tolist() == [0, 5, 6, -1]  # cu_seqlens, start_pos, state slot
    assert h[3 * R + 4:3 * R + 7].tolist() == [4, 2, 9]
    assert (h[8:R] == 77).all()  # rows past the bucket are not the graph's: left as they were
    assert inputs.block_tables.shape == (1, 6) and inputs.cu_seqlens.shape == (2,)


def test_buckets() -> None:
    graphs = PromptGraphs(lambda rows: torch.empty(0), PromptInputs(1024, 4, torch.device("cpu")), 128,
                          torch.device("cpu"))
    assert [graphs.rows(n) for n in (0, 1, 128, 129, 1000, 1024, 1025)] == [0, 128, 128, 256, 1024, 1024, 0]
    assert np.asarray(graphs.inputs.host).dtype == np.int32
