"""A decode-graph capture survives an old runner's graphs becoming garbage while it captures: the
cycle that holds them must not be collected mid-capture (CUDA forbids destroying a graph during a
capture, which invalidates it). Found as an order-dependent failure of the architecture tests."""
from __future__ import annotations

import gc

import pytest
import torch

from test_architectures_cuda import PAGE, TINY, greedy

pytestmark = pytest.mark.gpu


def test_capture_while_an_old_runners_graphs_become_garbage(monkeypatch) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY, num_hidden_layers=2))
    artifact = SyntheticArtifact("tiny", "f32", seed=5)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()

    def runner() -> CudaModelRunner:
        return CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=torch.float32)

    old = runner()
    expected = greedy(old, prompt, 6)  # captures old's decode graph
    assert old.graphs.captures
    holder = [old]
    old.cycle = old  # only the cycle collector can free it
    del old

    new = runner()
    step, calls = new.graphs.step, []

    def step_dropping_the_old_runner(n: int, parts: int, width: int) -> None:
        calls.append(n)
        if len(calls) == 2:  # inside the capture (the first call is the eager warm-up)
            holder.clear()
        step(n, parts, width)

    new.graphs.step = step_dropping_the_old_runner
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at nearly every allocation
    try:
        assert greedy(new, prompt, 6) == expected
    finally:
        gc.set_threshold(*thresholds)
    assert len(calls) == 2 and new.graphs.captures == 1
