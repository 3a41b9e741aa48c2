"""The mma gemv route's int4 weight layout (launchers.gemv_pack): pure torch, no GPU."""
import pytest
import torch

from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelError


def test_interleave_puts_word_t_of_each_chunk_in_lane_t_bytes() -> None:
    fmt = TensorFormat("int4", 32, False)
    parts = quantize(torch.randn(3, 256, generator=torch.Generator().manual_seed(0)), fmt)
    packed = L.gemv_pack("mma", fmt, parts)[""]
    words, pwords = parts[""].view(torch.int32), packed.view(torch.int32)  # [3, 32]: 16 words per 128 k
    for n in range(3):
        for block in range(2):
            for t in range(4):  # lane t's 16 bytes: word t of chunks 0..3 (chunk = 32 k = 4 words)
                for i in range(4):
                    assert pwords[n, 16 * block + 4 * t + i] == words[n, 16 * block + 4 * i + t]


def test_pack_roundtrip_and_what_is_kept() -> None:
    g = torch.Generator().manual_seed(1)
    fmt = TensorFormat("int4", 64, True)
    parts = quantize(torch.randn(5, 384, generator=g), fmt)
    packed = L.gemv_pack("mma", fmt, parts)
    assert not torch.equal(packed[""], parts[""]) and packed[".scales"] is parts[".scales"]
    back = L.gemv_unpack("mma", fmt, packed)
    assert torch.equal(dequantize(fmt, back, torch.float32), dequantize(fmt, parts, torch.float32))
    # widths that are not a multiple of 128, other formats and the warp route keep quant.py's layout
    narrow = quantize(torch.randn(5, 576, generator=g), TensorFormat("int4", 32, True))
    assert L.gemv_pack("mma", TensorFormat("int4", 32, True), narrow)[""] is narrow[""]
    assert L.gemv_pack("warp", fmt, parts)[""] is parts[""]
    i8 = quantize(torch.randn(5, 576, generator=g), TensorFormat("int8", 32))
    p8 = L.gemv_pack("mma", TensorFormat("int8", 32), i8)[""]
    assert torch.equal(p8.view(5, 9, 4, 4, 4).transpose(2, 3).reshape(5, 576), i8[""])
    bf = {"": torch.randn(4, 256, generator=g).bfloat16()}
    assert L.gemv_pack("mma", TensorFormat("bf16"), bf)[""] is bf[""]


def test_route_takes() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    assert L.gemv_route_ok("mma", TensorFormat("int4", 32, False), 576, bf16)
    assert not L.gemv_route_ok("mma", TensorFormat("int4", 32, False), 576, f32)  # fp32 activations
    assert L.gemv_route_ok("mma", TensorFormat("int8", 32), 4096, bf16)
    assert not L.gemv_route_ok("mma", TensorFormat("int8", 32), 576 + 32, bf16)  # int8 K in 64s
    assert not L.gemv_route_ok("mma", TensorFormat("int4", 16, True), 4096, bf16)  # groups in 32s
    assert not L.gemv_route_ok("mma", TensorFormat("int4", 96, True), 4032, bf16)  # powers of two
    assert L.gemv_route_ok("warp", TensorFormat("int8", 32), 4096, f32)
    assert not L.gemv_route_ok("fast", TensorFormat("bf16"), 4096, bf16)


def test_glu_rows_interleave_gate_and_up_in_eights() -> None:
    """Tile T of the fused gate_up gemv: rows 16 T .. 16 T + 7 are gate rows 8 T .., the next 8 the
    same up rows (common.cuh tile_epilogue finds a gate row and its up row in one lane)."""
    gate = torch.arange(24 * 3).view(24, 3)
    up = -gate
    rows = L.glu_rows(gate, up)
    assert rows.shape == (48, 3)
    for t in range(3):
        for r in range(8):
            assert torch.equal(rows[16 * t + r], gate[8 * t + r])
            assert torch.equal(rows[16 * t + 8 + r], up[8 * t + r])
    assert torch.equal(L.glu_rows(gate[:, 0], up[:, 0]), rows[:, 0])  # 1-D parts too
    with pytest.raises(KernelError):
        L.glu_rows(gate[:20], up[:20])
