"""The prompt route's expansion one projection ahead on a side stream (CudaOps.EXPAND_AHEAD): a tiny
llama's prompt logits bit-equal with it and without it, in int4 (tiled), int8 and Q4_K_M (whole
blocks), on the first prompt forward (the order is learnt) and on later ones (every matmul but the
first finds its copy written ahead), also when a decode step comes between them."""
from __future__ import annotations

import pytest
import torch

BF = torch.bfloat16
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, num_hidden_layers=3)


@pytest.mark.parametrize("weights", ["int4", "int8", "q4_k_m"])
def test_expand_ahead_same_logits(weights: str, monkeypatch) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    artifact = SyntheticArtifact("tiny", weights, seed=7)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 300, 7)]

    def run(ahead: bool) -> tuple[list[torch.Tensor], list[int], int]:
        monkeypatch.setattr(CudaOps, "EXPAND_AHEAD", ahead)
        runner = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
        logits = [runner.forward_logits(p) for p in prompts[:2]]
        tokens = greedy(runner, prompts[0], 4)  # decode steps between prompt forwards
        logits.append(runner.forward_logits(prompts[2]))
        return logits, tokens, runner.ops.expanded_ahead

    ahead, ahead_tokens, used = run(True)
    inline, inline_tokens, unused = run(False)
    # 4 prompt matmuls a layer; each forward after the first finds all but its first written ahead
    # (greedy's prompt forward is one of them)
    assert unused == 0 and used == 3 * (4 * TINY["num_hidden_layers"] - 1)
    for a, b in zip(ahead, inline):
        assert torch.equal(a, b)
    assert ahead_tokens == inline_tokens
