"""Our torch models against Hugging Face transformers on the same weights.

Real model: SmolLM2-135M Q4_1 GGUF, transformers loading the same GGUF (f32). Tiny random-weight
llama (untied, llama3 rope scaling) and qwen3 (tied, q/k norm) folders, converted with every
weights format; for quantized formats transformers gets the artifact's dequantized tensors.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from torch_model_helpers import assert_greedy_agrees, hf_from_gguf, hf_greedy, hf_logits, hf_with_weights, ours_greedy

pytest.importorskip("transformers")

# f32 on the same dequantized weights: measured max |Δlogit| exactly 0.0 on SmolLM2 (logits up to
# ~30) and on all eight tiny models (logits ~1); the bound leaves room for other BLAS builds.
F32_LOGIT_TOL = 1e-4
# bf16 compute (the CPU default): measured max |Δlogit| ~1.8 on SmolLM2 (logits span ~±30).
BF16_LOGIT_TOL = 4.0
# A greedy divergence is accepted only where the reference's top-2 logits are this close.
F32_NEAR_TIE = 2 * F32_LOGIT_TOL
BF16_NEAR_TIE = 0.5

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    None,  # the chat template around a question, filled in below
]


GREEDY_STEPS = 32


def scattered_pages(num_seqs: int, pages_per_seq: int) -> list[list[int]]:
    """Non-contiguous, interleaved page tables: seq i gets pages i, i + n, i + 2n, ... reversed."""
    return [[i + num_seqs * j for j in range(pages_per_seq)][::-1] for i in range(num_seqs)]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path, smollm2_artifact: Path):
    """Artifact, prompts (token ids), and transformers' logits and 32 greedy tokens per prompt."""
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    tok = Tokenizer.from_metadata(artifact.meta)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the boiling point of water?"}])
    prompts = [tok.encode(p if p is not None else chat) for p in SMOL_PROMPTS]
    hf = hf_from_gguf(smollm2_gguf)
    ref_logits = [hf_logits(hf, ids) for ids in prompts]
    ref_tokens = [hf_greedy(hf, ids, GREEDY_STEPS) for ids in prompts]
    return artifact, prompts, ref_logits, ref_tokens, hf


def check_greedy(runner: TorchModelRunner, smol, near_tie: float) -> None:
    artifact, prompts, _, ref_tokens, hf = smol
    pages_per_seq = -(-(max(map(len, prompts)) + GREEDY_STEPS) // runner.page_size)
    outs = ours_greedy(runner, prompts, GREEDY_STEPS, scattered_pages(len(prompts), pages_per_seq))
    for ids, ours, ref in zip(prompts, outs, ref_tokens):
        assert_greedy_agrees(ours, ref, hf, ids, near_tie)


@pytest.mark.slow
def test_smollm2_f32_logits_and_greedy_match_transformers(smol) -> None:
    artifact, prompts, ref_logits, _, _ = smol
    runner = TorchModelRunner(artifact, num_pages=24, page_size=16, dtype=torch.float32)
    for ids, ref in zip(prompts, ref_logits):
        assert (runner.forward_logits(ids) - ref).abs().max().item() < F32_LOGIT_TOL
    # the three prompts as lanes of one batch, paged incremental decode on scattered pages
    check_greedy(runner, smol, F32_NEAR_TIE)


@pytest.mark.slow
def test_smollm2_default_dtype_close_to_transformers(smol) -> None:
    """The fast CPU path (bf16, packed int4 decode) stays within bf16 error of the f32 reference."""
    artifact, prompts, ref_logits, _, _ = smol
    runner = TorchModelRunner(artifact, num_pages=24, page_size=16)
    for ids, ref in zip(prompts, ref_logits):
        ours = runner.forward_logits(ids)
        assert (ours - ref).abs().max().item() < BF16_LOGIT_TOL
        # where the top token differs, the reference had a near-tie there
        top2 = ref.topk(2, dim=-1).values
        differs = ours.argmax(-1) != ref.argmax(-1)
        assert ((top2[:, 0] - top2[:, 1])[differs] < BF16_NEAR_TIE).all()
    check_greedy(runner, smol, BF16_NEAR_TIE)


@pytest.fixture(scope="module")
def tiny_artifacts(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from ninfer.engine.convert import convert

    root = tmp_path_factory.mktemp("tiny_ninfer")
    cache: dict[tuple[str, str], Artifact] = {}

    def get(arch: str, weights: str) -> Artifact:
        if (arch, weights) not in cache:
            out = convert(tiny_hf_dirs[arch], root / f"{arch}-{weights}.ninfer", weights=weights, progress=False)
            cache[arch, weights] = Artifact.open(out)
        return cache[arch, weights]

    return get


@pytest.mark.parametrize("weights", ["keep", "bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_match_transformers(arch: str, weights: str, tiny_hf_dirs, tiny_artifacts) -> None:
    artifact = tiny_artifacts(arch, weights)
    hf = hf_with_weights(tiny_hf_dirs[arch], artifact.load_dequantized())
    runner = TorchModelRunner(artifact, num_pages=8, page_size=8, dtype=torch.float32)
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183]
    ours, ref = runner.forward_logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() < F32_LOGIT_TOL
    (ours_tokens,) = ours_greedy(runner, [ids], 16, [[5, 1, 7, 2]])
    assert_greedy_agrees(ours_tokens, hf_greedy(hf, ids, 16), hf, ids, F32_NEAR_TIE)


def test_tiny_llama_rope_scaling_is_exercised(tiny_hf_dirs, tiny_artifacts) -> None:
    """The llama fixture must carry llama3 scaling, and our inverse frequencies equal transformers'."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ninfer.engine.ops.torch_ops import rope_inv_freq

    config = tiny_artifacts("llama", "keep").meta.config
    assert (config.rope_scaling or {}).get("rope_type") == "llama3"
    hf_cfg = transformers.AutoConfig.from_pretrained(str(tiny_hf_dirs["llama"]))
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(config)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, rope_inv_freq(type(config)(**{**config.to_dict(), "rope_scaling": None})))
