"""A prompt chunk of one sequence replayed from a CUDA graph (cuda_graphs.PromptGraphs) against the same
chunk launched kernel by kernel (a runner without graphs): the logits and every K/V page bit-equal, for
chunks inside one 128-row bucket and across buckets, a chunked prefill (a start past 0), a graph
replayed for a second sequence, and chunks past the graphs' rows or with a compressed cache taking the
eager path."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.batch import ScheduledBatch

BF = torch.bfloat16
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096, num_hidden_layers=3)


def _runners(weights: str, monkeypatch, **kwargs):
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    artifact = SyntheticArtifact("tiny", weights, seed=3)
    return [CudaModelRunner(artifact, num_pages=192, page_size=16, device="cuda", dtype=BF, cuda_graph=graphs,
                            **kwargs) for graphs in (True, False)]


def _step(runner, tokens: list[int], start: int, pages: list[int], seq_id: int = 1) -> torch.Tensor:
    from test_architectures_cuda import work

    return runner.batch_logits(ScheduledBatch([work(tokens, start, pages, seq_id=seq_id)]))


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_prompt_graph_same_bits_as_eager(weights: str, monkeypatch) -> None:
    graphed, eager = _runners(weights, monkeypatch)
    assert graphed.prompt_graphs is not None and eager.prompt_graphs is None
    g = torch.Generator().manual_seed(5)
    fresh, chunked = list(range(96, 160)), list(range(0, 24))  # 1,024 and 384 positions
    # (tokens, start, pages): fresh sequences inside one bucket, at its edges, across buckets and in
    # the largest bucket, then a chunked prefill (chunks at 0, 200, 350) whose last chunk replays
    # the first bucket's graph
    chunks = [(1, 0, fresh), (7, 0, fresh), (128, 0, fresh), (129, 0, fresh), (300, 0, fresh), (1024, 0, fresh),
              (200, 0, chunked), (150, 200, chunked), (5, 350, chunked)]
    for n, start, pages in chunks:
        tokens = torch.randint(0, 512, (n,), generator=g).tolist()
        a = _step(graphed, tokens, start, pages)
        b = _step(eager, tokens, start, pages)
        assert torch.equal(a, b), (n, start)
    for layer in range(TINY["num_hidden_layers"]):
        assert torch.equal(graphed.k_cache[layer], eager.k_cache[layer])
        assert torch.equal(graphed.v_cache[layer], eager.v_cache[layer])
    buckets = {-(-n // 128) for n, _, _ in chunks}
    assert graphed.prompt_graphs.captures == len(buckets)


def test_prompt_graph_takes_one_sequence_up_to_its_rows(monkeypatch) -> None:
    graphed, _ = _runners("bf16", monkeypatch)
    graphs = graphed.prompt_graphs
    assert graphs.rows(1) == 128 and graphs.rows(1024) == 1024 and graphs.rows(1025) == 0
    _step(graphed, [i % 512 for i in range(1100)], 0, list(range(70)))  # past the graphs' rows: eager
    assert graphs.captures == 0
    from test_architectures_cuda import work

    two = [work(list(range(20)), 0, [0, 1], seq_id=1), work(list(range(30)), 0, [2, 3], seq_id=2)]
    graphed.batch_logits(ScheduledBatch(two))  # two sequences: eager
    assert graphs.captures == 0
    _step(graphed, list(range(20)), 0, [4, 5])
    assert graphs.captures == 1


def test_no_prompt_graphs_for_a_compressed_cache(monkeypatch) -> None:
    graphed, _ = _runners("bf16", monkeypatch, kv_dtype="int8")
    assert graphed.prompt_graphs is None
