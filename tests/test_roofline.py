"""The roofline accounting of `ninfer bench` (ninfer/engine/roofline.py): bytes and FLOPs per token
per architecture and weight format, against sums written out by hand from each model's shape."""
from __future__ import annotations

import math

import pytest

from ninfer.engine.config import ModelConfig
from ninfer.engine.models import expected_weights
from ninfer.engine.roofline import decode_context, model_cost, roofline_fields, stored_bytes
from ninfer.formats import TensorFormat
from ninfer.kernels.probes import Ceilings

BF16 = TensorFormat("bf16")
INT8 = TensorFormat("int8", 32)
INT4 = TensorFormat("int4", 32, symmetric=True)
INT4A = TensorFormat("int4", 32, symmetric=False)

V, H, I, L, HQ, HKV, D = 1000, 128, 384, 3, 4, 2, 32


def llama(arch: str = "llama", tied: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                       num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, tie_word_embeddings=tied)


def formats(config: ModelConfig, fmt: TensorFormat) -> dict[str, TensorFormat]:
    """`fmt` for every 2-D weight (the embedding included), bf16 for vectors and the conv1d."""
    return {n: (fmt if len(s) == 2 else BF16) for n, s in expected_weights(config).items()}


def layer_matrix_elems() -> int:
    q, kv = HQ * D, HKV * D
    return H * q + 2 * H * kv + q * H + 3 * H * I  # q, k, v, o, gate, up, down


@pytest.mark.parametrize("fmt, bytes_per_elem", [
    (BF16, 2.0),
    (INT8, 1 + 2 / 32),  # int8 values + one fp16 scale per 32
    (INT4, 0.5 + 2 / 32),  # nibbles + fp16 scales
    (INT4A, 0.5 + 4 / 32),  # nibbles + fp16 scales and mins
    (TensorFormat("q4_k"), 144 / 256),  # llama.cpp's Q4_K: 144-byte blocks of 256 weights
])
def test_stored_bytes_per_format(fmt: TensorFormat, bytes_per_elem: float) -> None:
    assert stored_bytes(fmt, (64, 256)) == pytest.approx(64 * 256 * bytes_per_elem)
    assert stored_bytes(BF16, (7,)) == 14


@pytest.mark.parametrize("fmt, per_elem", [(BF16, 2.0), (INT8, 1 + 2 / 32), (INT4A, 0.5 + 4 / 32)])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_weight_bytes_and_flops(fmt: TensorFormat, per_elem: float, tied: bool) -> None:
    c = llama(tied=tied)
    cost = model_cost(c, formats(c, fmt), kv_elem=2)
    vectors = 2 * (L * 2 * H + H)  # two norms per layer and the final norm, bf16
    table = V * H * per_elem  # the embedding table or an untied lm_head, same shape and format
    assert cost.step_weight_bytes == L * layer_matrix_elems() * per_elem + vectors + table
    assert cost.embed_row_bytes == H * per_elem
    assert cost.matmul_flops_per_token == 2 * L * layer_matrix_elems()
    assert cost.head_flops == 2 * V * H
    assert cost.attention_flops_per_key == L * 4 * HQ * D
    assert cost.kv_bytes_per_token == L * 2 * HKV * D * 2
    assert cost.state_bytes == 0 and cost.recurrent_flops_per_token == 0


def test_qwen3_adds_qk_norm_vectors() -> None:
    base = model_cost(llama(), formats(llama(), BF16), kv_elem=2)
    q3 = model_cost(llama("qwen3"), formats(llama("qwen3"), BF16), kv_elem=2)
    assert q3.step_weight_bytes - base.step_weight_bytes == L * 2 * D * 2
    assert q3.matmul_flops_per_token == base.matmul_flops_per_token


def qwen3_5() -> ModelConfig:
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    return ModelConfig(architecture="qwen3_5", vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=8,
                       num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=64, layer_types=kinds,
                       tie_word_embeddings=True, partial_rotary_factor=0.25, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4)


def test_qwen3_5_kv_bytes_from_attention_layers_state_from_recurrent_layers() -> None:
    c = qwen3_5()
    cost = model_cost(c, formats(c, BF16), kv_elem=2, state_elem=2)
    # 2 attention layers: K and V of 2 kv heads x 64 dims, bf16
    assert cost.kv_bytes_per_token == 2 * 2 * HKV * 64 * 2
    # 6 linear-attention layers: conv window [conv_dim, 3] bf16 + delta-rule state [4, 32, 16] fp32
    conv_dim = 2 * (2 * 32) + 4 * 16
    assert cost.state_bytes == 6 * (conv_dim * 3 * 2 + 4 * 32 * 16 * 4)
    assert cost.recurrent_flops_per_token == 6 * 7 * 4 * 32 * 16
    assert cost.attention_flops_per_key == 2 * 4 * HQ * 64
    # a decoded token reads its K/V context and reads and writes its state
    one = cost.decode_bytes_per_token(context=100)
    assert one == cost.step_weight_bytes + cost.embed_row_bytes + 100 * cost.kv_bytes_per_token + 2 * cost.state_bytes
    # the matmuls include the conv1d (2 per element) and the gated q_proj (2 x q rows)
    q, kv, value_dim = HQ * 64, HKV * 64, 4 * 16
    linear = conv_dim * H + value_dim * H + 2 * 4 * H + conv_dim * 4 + H * value_dim
    full = 2 * q * H + 2 * kv * H + H * q
    assert cost.matmul_flops_per_token == 2 * (6 * (linear + 3 * H * I) + 2 * (full + 3 * H * I))


def test_concurrency_shares_the_weight_read() -> None:
    cost = model_cost(llama(), formats(llama(), INT4A), kv_elem=2)
    one, eight = cost.decode_bytes_per_token(50, 1), cost.decode_bytes_per_token(50, 8)
    assert one - eight == pytest.approx(cost.step_weight_bytes * 7 / 8)


def test_prompt_flops_count_causal_pairs() -> None:
    cost = model_cost(llama(), formats(llama(), BF16), kv_elem=2)
    n, start = 5, 3
    pairs = sum(start + i + 1 for i in range(n))
    want = n * cost.matmul_flops_per_token + pairs * cost.attention_flops_per_key + cost.head_flops
    assert cost.prompt_flops(n, start) == want


def test_decode_context_is_the_mean_of_the_timed_steps() -> None:
    for prompt, n in [(1, 4), (1, 128), (300, 17)]:
        contexts = [pos + 1 for pos in range(prompt, prompt + n - 1)]
        assert decode_context(prompt, n) == pytest.approx(sum(contexts) / len(contexts))


def test_roofline_fields_ratios() -> None:
    cost = model_cost(llama(), formats(llama(), BF16), kv_elem=2)
    limits = Ceilings(device="test", read_gbs=100.0, matmul_tflops=2.0, matmul_dtype="bfloat16")
    tg = roofline_fields(cost, n_prompt=0, n_gen=9, n_depth=0, concurrency=1, tokens_per_s=1000.0, ceilings=limits)
    per_token = cost.decode_bytes_per_token(decode_context(1, 9))
    assert tg["bytes_per_token"] == round(per_token)
    assert tg["achieved_gbs"] == pytest.approx(per_token * 1000 / 1e9)
    assert tg["bandwidth_ratio"] == pytest.approx(tg["achieved_gbs"] / 100.0)
    pp = roofline_fields(cost, n_prompt=64, n_gen=0, n_depth=0, concurrency=1, tokens_per_s=5000.0, ceilings=None)
    assert pp["achieved_tflops"] == pytest.approx(cost.prompt_flops(64) / 64 * 5000 / 1e12)
    assert "matmul_ratio" not in pp and "ceilings" not in pp
    assert math.isclose(pp["flops_per_token"], cost.prompt_flops(64) / 64, abs_tol=1)
