"""The torch ops with the native CPU decode kernels (ninfer/kernels/cpu_decode.c) under them.

Batches of at most 8 rows (decode, verify rows, short chunks after cached tokens) take the kernels:
the int4 / int8 matmul alone, and fused with what follows it in the model (SwiGLU; the residual add
and the next RMSNorm), and each query's RoPE, K/V store and attention over the float32 cache, query
by query as its decode step would. That is five calls a llama layer where the torch ops make ~35,
each with its own dispatch and allocation. Everything else (prefill, other formats, windows, int8
KV, q/k norms) is TorchOps as it is. Numerics are the torch route's: bf16 inputs times the
dequantized weight in float32, outputs rounded to bf16 where torch's are.
"""
from __future__ import annotations

import torch

from ninfer.engine.ops.torch_ops import Linear, TorchOps
from ninfer.engine.quant import TensorFormat, int_codes
from ninfer.kernels.cpu_native import INT5, INT6, INT8, MAX_ROWS, CpuKernels, NativeWeight

# the bits of a format's codes (others: 8, read as int8 codes), and the offset that makes signed ones
# unsigned for the 5- / 6-bit kernels (code_offset)
CODE_BITS = {"q2_k": 2, "q3_k": 3, "q4_k": 4, "int4": 4, "q5_0": 5, "q5_1": 5, "q5_k": 5, "q6_k": 6}
CODE_OFFSETS = {"q3_k": 4, "q5_0": 16, "q6_k": 32}


def code_offset(fmt: TensorFormat) -> int:
    """What makes `int_codes`' codes of this format unsigned (a power of two)."""
    return 8 if fmt.format == "int4" and fmt.symmetric else CODE_OFFSETS.get(fmt.format, 0)


class NativeLinear(Linear):
    """A Linear whose quantized decode copy is in the kernels' layout: int4 (our int4, q4_k); the
    other llama.cpp block formats, and fused parts of mixed formats, as the narrowest codes that hold
    them (5-bit: q5_*; 6-bit: q6_k, q2_k, q3_k, q4_k with q6_k; int8 codes: iq4_*, and with our
    int8 / q8_0). Odd shapes fall back to torch's packed layout or the dense weight."""

    __slots__ = ("kernels", "native")

    def __init__(self, kernels: CpuKernels, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.kernels = kernels
        self.native: NativeWeight | None = None

    def _attach(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                repeat: int = 1) -> None:
        if repeat == 1 and NativeWeight.fits(*q.shape, group_size):
            self.native = NativeWeight.int4(q, scales, zeros, group_size)
        else:
            super()._attach(q, scales, zeros, group_size, repeat)

    def attach_int8(self, fmt: TensorFormat, parts_list: list[dict[str, torch.Tensor]]) -> None:
        if not NativeWeight.fits(*self.weight.shape, fmt.group_size):
            return super().attach_int8(fmt, parts_list)
        q = torch.cat([p[""] for p in parts_list])
        # bf16 scales, as the torch route's packed halves keep them
        self.native = NativeWeight.int8(q, torch.cat([p[".scales"] for p in parts_list]), fmt.group_size)

    def attach_blocks(self, fmt: TensorFormat, parts_list: list[dict[str, torch.Tensor]]) -> None:
        if fmt.format == "q4_k" or not self._attach_codes([(fmt, parts) for parts in parts_list]):
            super().attach_blocks(fmt, parts_list)  # q4_k: int4 codes, the fewest bytes

    def attach_mixed(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]]) -> None:
        self._attach_codes(items)

    def _attach_codes(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]]) -> bool:
        """The parts (rows in order, each in its quantized format) as one weight of the narrowest codes
        that hold them all: 5-bit (a scale and zero per 32 inputs), 6-bit (per 16), else int8 (per the
        smallest group of the parts', zeros if any part has them). A format's offset that makes its
        codes unsigned goes into the zero: bf16(scale) * (q + offset) + (zero - offset * bf16(scale)),
        exact in bf16 (the offsets are powers of two, on formats without a zero of their own).
        False where the shape has no layout."""
        codes = [int_codes(fmt, parts) for fmt, parts in items]
        g = min(c[3] for c in codes)
        bits = max(CODE_BITS.get(fmt.format, 8) for fmt, _ in items)
        kind = INT5 if bits <= 5 and g % 32 == 0 else INT6 if bits <= 6 else INT8
        g = {INT5: 32, INT6: 16}.get(kind, g)
        if any(c[3] % g for c in codes) or not NativeWeight.fits(*self.weight.shape, g, INT8):
            return False
        q = torch.cat([c[0] for c in codes])
        scales = torch.cat([s.repeat_interleave(cg // g, dim=1) for _, s, _, cg in codes])
        if kind == INT8:
            zeros = None
            if any(z is not None for _, _, z, _ in codes):
                zeros = torch.cat([(z if z is not None else torch.zeros_like(s)).repeat_interleave(cg // g, dim=1)
                                   for _, s, z, cg in codes])
            self.native = NativeWeight.int8(q, scales, g, zeros)
            return True
        offsets = [code_offset(fmt) for fmt, _ in items]
        q = torch.cat([c[0].to(torch.int32) + off for c, off in zip(codes, offsets)])
        scales = scales.to(torch.bfloat16).float()
        zeros = torch.cat([((z if z is not None else 0) - off * s.to(torch.bfloat16).float()).repeat_interleave(cg // g, dim=1)
                           for (_, s, z, cg), off in zip(codes, offsets)])
        self.native = NativeWeight.wide(q, scales, zeros, kind)
        return True

    @property
    def decode_packed(self) -> bool:
        return self.native is not None or self.packed is not None

    def decodes(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the kernels."""
        return self.native is not None and x.dtype == torch.bfloat16 and x.shape[0] <= MAX_ROWS

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.decodes(x):
            return super().__call__(x, out_dtype)
        wide = out_dtype == torch.float32 and self.bias is None  # float32 holding the bf16-rounded values
        y = self.kernels.linear(x.contiguous(), self.native, torch.float32 if wide else torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias
        return y.to(out_dtype or x.dtype)


class NativeCpuOps(TorchOps):
    """TorchOps on CPU (bf16 weights, float32 attention) with the decode kernels."""

    def __init__(self, config, dtype: torch.dtype, attn_dtype: torch.dtype, device: torch.device,
                 kernels: CpuKernels) -> None:
        super().__init__(config, dtype, attn_dtype, device, pack=True)
        self.kernels = kernels

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return NativeLinear(self.kernels, weight, bias)

    def linear_add_rms_norm(self, x: torch.Tensor, w: Linear, residual: torch.Tensor, norm: torch.Tensor,
                            eps: float, then: Linear | None = None) -> torch.Tensor:
        if isinstance(w, NativeLinear) and w.decodes(x) and w.bias is None and residual.is_contiguous() \
                and norm.is_contiguous():
            return self.kernels.linear_add_rms_norm(x.contiguous(), w.native, residual, norm, eps)
        return super().linear_add_rms_norm(x, w, residual, norm, eps)

    def gated_linear(self, x: torch.Tensor, w: Linear, activation: str = "silu") -> torch.Tensor:
        if activation == "silu" and isinstance(w, NativeLinear) and w.decodes(x) and w.bias is None \
                and w.native.n % 32 == 0:
            return self.kernels.gated_silu(x.contiguous(), w.native)
        return super().gated_linear(x, w, activation)

    def attention(self, layer: int, qkv: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None) -> torch.Tensor:
        ctx, c = self.ctx, self.config
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = ctx.rotary[self.layer_rope[layer]]  # [T, 1, rotary_dim] float32
        native = (q_norm is None and qkv.dtype == torch.bfloat16 and qkv.is_contiguous()
                  and qkv.shape[1] == (heads + 2 * kv_heads) * d and cos.shape[-1] == d and d % 16 == 0
                  and self.attn_dtype == torch.float32 and ctx.kv.storage == "auto"
                  and not self.layers[layer].window and self.scale is None and not c.attn_logit_softcapping
                  and qkv.shape[0] <= MAX_ROWS)
        if not native:
            return super().attention(layer, qkv, q_norm, k_norm)
        out = torch.empty(qkv.shape[0], heads * d, dtype=torch.bfloat16)
        for s in ctx.meta.seqs:
            # query i of a span attends as its own decode step would (a verify row, or a chunk after
            # cached tokens): its K/V stored, then positions 0..start_pos + i
            for i in range(s.num_tokens):
                r = s.offset + i
                self.kernels.attention_decode(qkv[r], heads, kv_heads, cos[r, 0], sin[r, 0], ctx.kv.k[layer],
                                              ctx.kv.v[layer], s.block_table, s.start_pos + i, out[r])
        return out
