"""The prompt route's copies of quantized weights: expanded one projection ahead on a side stream
(CudaOps.EXPAND_AHEAD), and kept from the load for a small model (CudaOps.PROMPT_COPY_BYTES). A tiny
llama's prompt logits bit-equal with either and with neither (each copy written in line before its
matmul), in int4 (tiled), int8 and Q4_K_M (whole blocks): on the first prompt forward (the order is
learnt) and on later ones (every matmul but the first finds its copy written ahead), also when decode
steps come between them; and with a budget that keeps only some copies."""
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

    monkeypatch.setattr(CudaOps, "AHEAD_MIN_BYTES", 0)  # the tiny model's copies are all small

    def run(ahead: bool, copies: int) -> tuple[list[torch.Tensor], list[int], CudaOps]:
        monkeypatch.setattr(CudaOps, "EXPAND_AHEAD", ahead)
        monkeypatch.setattr(CudaOps, "PROMPT_COPY_BYTES", copies)
        runner = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
        logits = [runner.forward_logits(p) for p in prompts[:2]]
        tokens = greedy(runner, prompts[0], 4)  # decode steps between prompt forwards
        logits.append(runner.forward_logits(prompts[2]))
        return logits, tokens, runner.ops

    inline, inline_tokens, ops = run(False, 0)
    assert ops.expanded_ahead == 0 and ops.copies_bytes == 0
    ahead, ahead_tokens, ops = run(True, 0)
    # 4 prompt matmuls a layer; each forward after the first finds all but its first written ahead
    # (greedy's prompt forward is one of them)
    assert ops.expanded_ahead == 3 * (4 * TINY["num_hidden_layers"] - 1)
    H, I = TINY["hidden_size"], TINY["intermediate_size"]
    layer = (H + 2 * TINY["num_key_value_heads"] * TINY["head_dim"] + H + 2 * I + I) * H * 2  # bf16 bytes
    kept, kept_tokens, ops = run(False, 1 << 30)
    assert ops.copies_bytes == TINY["num_hidden_layers"] * layer
    some, some_tokens, ops = run(True, layer + layer // 2)  # the first layer's copies, some more, the rest in line
    assert layer <= ops.copies_bytes <= layer + layer // 2 and ops.expanded_ahead > 0
    for other in (ahead, kept, some):
        for a, b in zip(other, inline):
            assert torch.equal(a, b)
    assert ahead_tokens == kept_tokens == some_tokens == inline_tokens
