"""A small model's prompt copies of its quantized weights kept from the load (CudaOps.PROMPT_COPY_BYTES):
a tiny llama's prompt logits bit-equal with every copy kept, with a budget that keeps only some,
and with none (each copy written before its matmul), in int4 (tiled), int8 and Q4_K_M (whole
blocks, a fused qkv of mixed formats), over several prompt forwards with decode steps between them."""
from __future__ import annotations

import pytest
import torch

BF = torch.bfloat16
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, num_hidden_layers=3)


@pytest.mark.parametrize("weights", ["int4", "int8", "q4_k_m"])
def test_prompt_copies_same_logits(weights: str, monkeypatch) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    artifact = SyntheticArtifact("tiny", weights, seed=7)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 300, 7)]

    def run(budget: int) -> tuple[list[torch.Tensor], list[int], int]:
        monkeypatch.setattr(CudaOps, "PROMPT_COPY_BYTES", budget)
        runner = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
        logits = [runner.forward_logits(p) for p in prompts[:2]]
        tokens = greedy(runner, prompts[0], 4)  # decode steps between prompt forwards
        logits.append(runner.forward_logits(prompts[2]))
        return logits, tokens, runner.ops.copies_bytes

    H, I, kv = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_key_value_heads"] * TINY["head_dim"]
    layer = ((H + 2 * kv) * H + H * H + 2 * I * H + H * I) * 2  # qkv, o, gate_up, down in bf16
    inline, inline_tokens, none = run(0)
    kept, kept_tokens, full = run(1 << 30)
    some, some_tokens, part = run(layer + layer // 2)  # the first layer's copies and some of the next
    assert none == 0 and full == TINY["num_hidden_layers"] * layer and layer <= part <= layer + layer // 2
    for other in (kept, some):
        for a, b in zip(other, inline):
            assert torch.equal(a, b)
    assert kept_tokens == some_tokens == inline_tokens
