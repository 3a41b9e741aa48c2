"""The torch implementation of the ops interface (CPU and CUDA), and its building blocks:
RMSNorm, RoPE, linear weights, paged attention, the Gated DeltaNet pieces (gdn_torch.py).

Numerics follow Hugging Face transformers (the reference the fidelity tests compare against):
RMSNorm reduced in float32, RoPE with the rotate_half convention and float32 angles, attention
through `scaled_dot_product_attention` with the default 1/sqrt(head_dim) scale. In float32 the
model is bit-equal to transformers on the tested prompts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.spec import StateSpec, attention_layers
from ninfer.engine.rope import Rope
from ninfer.engine.ops import gdn_torch
from ninfer.engine.quant import TensorFormat, dequantize, unpack_int4
from ninfer.engine.quant_blocks import INT4_CODED, int4_codes
from ninfer.formats import BLOCK_FORMATS

# At most this many rows take the packed int4 kernel (decode); more rows (prefill) take the
# dense matmul, which is ~4x faster than the packed kernel at 128 rows on CPU.
PACKED_MAX_ROWS = 8
PACKED_GROUP_SIZES = (32, 64, 128, 256)


def packable(fmt: TensorFormat, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this stored format and logical [out, in] shape can take the packed CPU
    kernel (it wants out % 16 == 0 and one of its group sizes); llama.cpp blocks: int4 codes in
    groups of 32 for torch's kernel (INT4_CODED), int8 codes for the native one (any block format)."""
    if fmt.format in BLOCK_FORMATS:
        return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 32 == 0
    if fmt.format not in ("int8", "int4") or fmt.group_size not in PACKED_GROUP_SIZES or len(shape) != 2:
        return False
    if fmt.format == "int8" and not fmt.symmetric:
        return False
    return shape[0] % 16 == 0 and shape[1] % fmt.group_size == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., d] -> float32 `weight * x / rms(x)`, reduced in float32 as transformers does
    (bit-equal to its RMSNorm for float32 inputs); callers cast to the compute dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def rotary_dim(config: ModelConfig) -> int:
    """Dims of each head that RoPE rotates (the first ones; all unless partial_rotary_factor < 1)."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[rotary_dim/2] float32 inverse frequencies of the model's (full-attention) RoPE, scaling included."""
    return Rope.of(rotary_dim(config), config.rope_theta, config.rope_scaling).inv_freq()


class RotaryEmbedding:
    """cos / signed-sin tables [positions, rotary_dim] of one Rope in the attention dtype, grown by
    doubling; the rope's attention factor (yarn) is folded in, as transformers scales cos and sin."""

    __slots__ = ("rope", "dtype", "device", "cos", "sin")

    def __init__(self, rope: Rope, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rope = rope
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, rope.dim, dtype=dtype, device=device)
        self.sin = self.cos
        self._build(positions)

    def _build(self, n: int) -> None:
        # angles in float32 (position * inv_freq), exactly transformers' product, then cast
        freqs = self.rope.angles(n).to(self.device)
        factor = self.rope.attention_factor()
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        # the sign of rotate_half folded in: rotate_half(x) * sin == roll(x, d/2) * [-sin, sin]
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)

    def lookup(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, rotary_dim] (broadcast over heads)."""
        if max_pos >= self.cos.shape[0]:
            n = max(self.cos.shape[0], 1)
            while n <= max_pos:
                n *= 2
            self._build(n)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; HF rotate_half convention (dims i and i + r/2 form a pair) over the
    first r = cos.shape[-1] dims; the rest pass unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(r // 2, dims=-1), signed_sin)
    rot = x[..., :r]
    return torch.cat((torch.addcmul(rot * cos, rot.roll(r // 2, dims=-1), signed_sin), x[..., r:]), dim=-1)


class Linear:
    """y = x @ W^T (+ b). W dense in the compute dtype; optionally also packed for the CPU kernel
    `_weight_int4pack_mm_for_cpu`, used when few rows come in (decode), where reading 4- or 8-bit
    weights instead of 16-bit ones is what decides speed. An int8 weight is packed as two int4
    halves (high and low nibble of q + 128) side by side along the input dim, read in one call on
    the input repeated twice: the kernel sums both halves in float32, one bf16 rounding."""

    __slots__ = ("weight", "bias", "packed", "scales_zeros", "group_size", "repeat")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.packed: torch.Tensor | None = None  # int4 [out, repeat * in] in the kernel's layout
        self.scales_zeros: torch.Tensor | None = None
        self.group_size = 0
        self.repeat = 1  # 2: int8 as two int4 halves, the input given twice

    @property
    def decode_packed(self) -> bool:
        """Whether few-row inputs (decode) read a packed quantized copy instead of the dense weight."""
        return self.packed is not None

    def _attach(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                repeat: int = 1) -> None:
        # q: [out, in] int32 0..15; scales, zeros: [out, in/g]; kernel: w = (q - 8) * scale + zero
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # qScaleAndZeros: [in/g, out, 2] bf16, the layout the CPU kernel wants
        self.scales_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
        self.group_size = group_size
        self.repeat = repeat

    def attach_int8(self, fmt: TensorFormat, parts_list: list[dict[str, torch.Tensor]]) -> None:
        """Keep a packed copy of an int8 (symmetric, groupwise) weight as two int4 halves.
        w = s q and u = q + 128 = 16 hi + lo give w = (hi - 8) 16s + (lo - 8) s + 8s: zeros 0 and
        8s, exact multiples of bf16(s). Inexact only by s rounded to bf16 and the bf16 output."""
        q = torch.cat([p[""] for p in parts_list]).to(torch.int32) + 128  # [out, in] 0..255
        scales = torch.cat([p[".scales"] for p in parts_list]).to(torch.bfloat16).to(torch.float32)
        self._attach(torch.cat((q >> 4, q & 15), dim=1), torch.cat((16.0 * scales, scales), dim=1),
                     torch.cat((torch.zeros_like(scales), 8.0 * scales), dim=1), fmt.group_size, repeat=2)

    def attach_int4(self, fmt: TensorFormat, parts_list: list[dict[str, torch.Tensor]]) -> None:
        """Keep an int4-packed copy of this weight from the artifact's int4 parts (the weights
        fused into this Linear, in order of their rows). Exact up to bf16 rounding of scales and zeros."""
        q = torch.cat([unpack_int4(p[""]) for p in parts_list]).to(torch.int32)  # [out, in] 0..15
        scales = torch.cat([p[".scales"] for p in parts_list]).to(torch.float32)  # [out, in/g]
        if fmt.symmetric:
            zeros = torch.zeros_like(scales)  # w = (q - 8) * s
        else:
            mins = torch.cat([p[".mins"] for p in parts_list]).to(torch.float32)
            zeros = mins + 8.0 * scales  # w = q * s + m = (q - 8) * s + (m + 8 s)
        self._attach(q, scales, zeros, fmt.group_size)

    def attach_blocks(self, fmt: TensorFormat, parts_list: list[dict[str, torch.Tensor]]) -> None:
        """Keep a packed copy of llama.cpp blocks that are int4 codes (q4_k: one packed weight;
        q5_0/q5_1: two, high bit and low nibble; quant_blocks.int4_codes). Exact up to bf16
        rounding of scales and zeros, and each half's bf16 output. Other block formats keep only
        the dense weight here (NativeLinear reads every block format as 4- to 8-bit codes)."""
        if fmt.format not in INT4_CODED:
            return
        halves = [int4_codes(fmt, p[""]) for p in parts_list]  # per part: (q, scales, zeros) per half
        rows = [[torch.cat(t) for t in zip(*(h[i] for h in halves))] for i in range(len(halves[0]))]
        # two halves (q5_0 / q5_1) side by side along the input, read in one call as attach_int8's
        q, scales, zeros = (torch.cat([r[j] for r in rows], dim=1) for j in range(3))
        self._attach(q, scales, zeros, 32, repeat=len(rows))

    def attach_mixed(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]]) -> None:
        """Parts in different quantized formats, fused (a Q4_K_M's q/k in q4_k, v in q6_k or q8_0):
        torch's packed kernel takes one format and group size, so the dense weight serves here
        (NativeLinear reads them as one weight of int8 codes)."""

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [rows, in] -> [rows, out] in out_dtype (default x's dtype)."""
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS and x.dtype == torch.bfloat16:
            xs = x if self.repeat == 1 else torch.cat((x, x), dim=-1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xs, self.packed, self.group_size, self.scales_zeros)
        else:
            y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.to(out_dtype or x.dtype)


@dataclass(slots=True)
class SeqSpan:
    """One sequence's share of a flat token batch."""

    offset: int  # first row of this sequence in the flat batch
    num_tokens: int
    start_pos: int  # position of its first token (tokens before it are already in the cache)
    block_table: torch.Tensor  # [pages covering start_pos + num_tokens] int64 page ids
    contiguous_from: int  # first page id if the pages are consecutive ids, else -1
    verify: bool = False  # a speculative verify row: each query attends as its decode step would


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs besides q/k/v: where each token's K/V goes and each sequence's pages."""

    slot_mapping: torch.Tensor  # [T] int64: page * page_size + pos % page_size
    seqs: list[SeqSpan]
    page_size: int
    max_pos: int  # largest position in the batch (RoPE table size)

    @classmethod
    def build(cls, spans: list[tuple[int, int, list[int]]], page_size: int,
              device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
        """spans: (start_pos, num_tokens, block_table) per sequence, in batch order.
        Returns the metadata and positions [T] int64."""
        seqs: list[SeqSpan] = []
        slots: list[int] = []
        positions: list[int] = []
        offset = 0
        for start_pos, n, block_table in spans:
            end = start_pos + n
            num_pages = -(-end // page_size)
            assert len(block_table) >= num_pages, "block table does not cover the batch's positions"
            pages = block_table[:num_pages]
            for pos in range(start_pos, end):
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
            positions.extend(range(start_pos, end))
            first = pages[0]
            contiguous = first if all(p == first + i for i, p in enumerate(pages)) else -1
            seqs.append(SeqSpan(offset, n, start_pos, torch.tensor(pages, dtype=torch.int64, device=device),
                                contiguous))
            offset += n
        meta = cls(torch.tensor(slots, dtype=torch.int64, device=device), seqs, page_size,
                   max(positions) if positions else 0)
        return meta, torch.tensor(positions, dtype=torch.int64, device=device)


KV_DTYPES = ("auto", "bf16", "int8")  # --kv-dtype on the torch backend (auto: the attention dtype)


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, heads, d] -> (int8 [T, heads, d], fp16 scales [T, heads]): symmetric per token and
    head, x ~ q * scale with scale = amax / 127 (rounded to fp16 first, so q uses the stored scale)."""
    scale = (x.abs().amax(-1).float() / 127).to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(x.float() / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class KVCache:
    """Physical paged KV tensors: per attention layer K and V of [num_pages, page_size, kv_heads, head_dim].

    storage (--kv-dtype): "auto" keeps them in the attention dtype; "bf16" stores bfloat16 (read
    back into the attention dtype); "int8" stores int8 with one fp16 scale per token and head in
    k_scale / v_scale [num_pages, page_size, kv_heads] (about half the bytes of bf16)."""

    __slots__ = ("k", "v", "k_scale", "v_scale", "page_size", "num_pages", "storage")

    def __init__(self, spec: StateSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, storage: str = "auto") -> None:
        if storage not in KV_DTYPES:
            raise ValueError(f"KV storage {storage!r} is not one of {', '.join(KV_DTYPES)}")
        store = {"auto": dtype, "bf16": torch.bfloat16, "int8": torch.int8}[storage]
        shape = (num_pages, page_size, spec.attention.kv_heads, spec.attention.head_dim)
        n = spec.num_attention_layers
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(n)]
        scale_shape = shape[:3]
        quantized = storage == "int8"
        self.k_scale = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(n)] if quantized else []
        self.v_scale = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(n)] if quantized else []
        self.page_size = page_size
        self.num_pages = num_pages
        self.storage = storage

    def tensors(self) -> list[torch.Tensor]:
        """Every page-indexed tensor: K, V, then the int8 scales."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.k_scale[layer], self.v_scale[layer]) if self.k_scale else (None, None)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages src[i] -> dst[i] in every layer (int64 index tensors)."""
        copy_rows(self.tensors(), src, dst)

    @classmethod
    def join(cls, parts: list[KVCache]) -> KVCache:
        """One pool over pipeline stages' pools (each on its stage's device), in layer order."""
        kv = cls.__new__(cls)
        for name in ("k", "v", "k_scale", "v_scale"):
            setattr(kv, name, [t for p in parts for t in getattr(p, name)])
        kv.page_size, kv.num_pages, kv.storage = parts[0].page_size, parts[0].num_pages, parts[0].storage
        return kv

    def layers(self, start: int, stop: int) -> KVCache:
        """The pool of attention layers [start, stop) (a pipeline stage's), sharing the tensors."""
        kv = type(self).__new__(type(self))
        for name in ("k", "v", "k_scale", "v_scale"):
            setattr(kv, name, getattr(self, name)[start:stop])
        kv.page_size, kv.num_pages, kv.storage = self.page_size, self.num_pages, self.storage
        return kv


def copy_rows(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rows src[i] -> dst[i] of every tensor; the index tensors follow each tensor's device (the
    pools of pipeline stages live on several)."""
    on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in tensors:
        if t.device not in on:
            on[t.device] = (src.to(t.device), dst.to(t.device))
        s, d = on[t.device]
        t.index_copy_(0, d, t.index_select(0, s))


class RecurrentStates:
    """Per linear-attention layer: conv windows [slots, conv_dim, conv_kernel - 1] (attention dtype)
    and delta-rule states [slots, value_heads, key_dim, value_dim] float32; a slot is one sequence."""

    __slots__ = ("conv", "ssm", "num_slots")

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        r = spec.recurrent
        assert r is not None
        self.conv = [torch.zeros(num_slots, r.conv_dim, r.conv_kernel - 1, dtype=dtype, device=device)
                     for _ in range(spec.num_recurrent_layers)]
        self.ssm = [torch.zeros(num_slots, r.value_heads, r.key_dim, r.value_dim, dtype=torch.float32, device=device)
                    for _ in range(spec.num_recurrent_layers)]
        self.num_slots = num_slots

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src[i] -> dst[i] in every layer (int64 index tensors)."""
        copy_rows([*self.conv, *self.ssm], src, dst)

    def zero(self, slots: torch.Tensor) -> None:
        """Reset slots to the state before any token (a sequence starting from position 0)."""
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, slots.to(t.device), 0)

    @classmethod
    def join(cls, parts: list[RecurrentStates]) -> RecurrentStates:
        """One pool over pipeline stages' pools, in linear-attention layer order."""
        states = cls.__new__(cls)
        states.conv = [t for p in parts for t in p.conv]
        states.ssm = [t for p in parts for t in p.ssm]
        states.num_slots = parts[0].num_slots
        return states

    def layers(self, start: int, stop: int) -> RecurrentStates:
        """The pool of linear-attention layers [start, stop) (a pipeline stage's), sharing the tensors."""
        states = type(self).__new__(type(self))
        states.conv, states.ssm, states.num_slots = self.conv[start:stop], self.ssm[start:stop], self.num_slots
        return states


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row over a sequence's cached positions, float32: q [heads, d], keys / values
    [ctx, kv_heads, d] (views into the cache) -> [kv_heads, heads / kv_heads, d]. The query heads
    of one kv head are the rows of one small matmul, the cache is read in place: fewer and cheaper
    calls than SDPA at one query (its result within float32 rounding)."""
    kv_heads, d = keys.shape[1], keys.shape[2]
    qg = (q * d ** -0.5).view(kv_heads, -1, d)
    probs = torch.softmax(torch.bmm(qg, keys.permute(1, 2, 0)), dim=-1)  # [kv_heads, group, ctx]
    return torch.bmm(probs, values.transpose(0, 1))


def _store(flat: torch.Tensor, flat_scale: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor) -> None:
    if flat_scale is None:
        flat.index_copy_(0, slots, x.to(flat.dtype))
    else:
        qx, scale = int8_quantize(x)
        flat.index_copy_(0, slots, qx)
        flat_scale.index_copy_(0, slots, scale)


def _load(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    # stored K or V [ctx, kv_heads, d] -> the attention dtype (int8: times its per-token-head scale)
    if scale is None:
        return x if x.dtype == dtype else x.to(dtype)
    return x.to(dtype) * scale.to(dtype)[..., None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0, scale: float | None = None,
                    softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Store the batch's K/V in their slots, then attend each sequence over its cached positions.

    q: [T, heads, d]; k, v: [T, kv_heads, d]; caches: [pages, page_size, kv_heads, d] in their
    storage dtype (int8 with k_scale / v_scale [pages, page_size, kv_heads]: the cache is read
    back dequantized, the batch's own K/V included). window > 0: a query at position p sees
    positions p - window + 1 .. p only. scale: of the scores (None: 1/sqrt(d)); softcap > 0:
    scores -> softcap * tanh(score / softcap) before the mask. Returns [T, heads * d].
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_ks = k_scale.view(-1, num_kv_heads) if k_scale is not None else None
    flat_vs = v_scale.view(-1, num_kv_heads) if v_scale is not None else None
    _store(flat_k, flat_ks, k, meta.slot_mapping)
    _store(flat_v, flat_vs, v, meta.slot_mapping)
    ps = meta.page_size
    num_heads = q.shape[1]
    out = torch.empty_like(q) if len(meta.seqs) > 1 else None  # rows of several sequences
    for s in meta.seqs:
        ctx = s.start_pos + s.num_tokens
        ks = vs = None
        if s.contiguous_from >= 0:  # a view, no copy
            base = s.contiguous_from * ps
            keys, values = flat_k[base:base + ctx], flat_v[base:base + ctx]
            if flat_ks is not None:
                ks, vs = flat_ks[base:base + ctx], flat_vs[base:base + ctx]
        else:  # gather the sequence's pages: [pages * page_size, kv_heads, d]
            keys = k_cache.index_select(0, s.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
            values = v_cache.index_select(0, s.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
            if k_scale is not None:
                ks = k_scale.index_select(0, s.block_table).view(-1, num_kv_heads)[:ctx]
                vs = v_scale.index_select(0, s.block_table).view(-1, num_kv_heads)[:ctx]
        # a window drops the keys no query of this span sees (keys first..ctx-1), before an int8
        # cache is dequantized
        first = max(0, s.start_pos + 1 - window) if window else 0
        if first:
            keys, values = keys[first:], values[first:]
            if ks is not None:
                ks, vs = ks[first:], vs[first:]
        keys, values = _load(keys, ks, q.dtype), _load(values, vs, q.dtype)
        if s.verify and s.num_tokens > 1:
            # a speculative verify row: each query exactly as the decode step at its position
            # computes it (another SDPA path for several queries rounds bf16 differently, and a
            # greedy verify must commit what plain decoding would)
            o = torch.empty(s.num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
            for i in range(s.num_tokens):
                pos = s.start_pos + i
                first_i = max(0, pos + 1 - window) if window else 0
                rows = q[s.offset + i:s.offset + i + 1]
                o[i] = _attend(rows, keys[first_i - first:pos + 1 - first], values[first_i - first:pos + 1 - first],
                               pos, first_i, window, scale, softcap)[0]
        else:
            o = _attend(q[s.offset:s.offset + s.num_tokens], keys, values, s.start_pos, first, window, scale, softcap)
        if out is None:  # one sequence is the whole batch
            return o.reshape(q.shape[0], num_heads * head_dim)
        out[s.offset:s.offset + s.num_tokens] = o
    assert out is not None
    return out.reshape(q.shape[0], num_heads * head_dim)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, first: int, window: int,
            scale: float | None, softcap: float) -> torch.Tensor:
    """q [n, heads, d] at positions start_pos.. over keys / values [m, kv_heads, d] at first..
    (causal) -> [n, heads, d]."""
    n, heads, d = q.shape
    if n == 1 and q.dtype == torch.float32 and not window and not softcap and scale is None:
        # decode: the one query sees every cached position
        return decode_attention(q[0], keys, values).view(1, heads, d)
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, m, d]
    values = values.transpose(0, 1).unsqueeze(0)
    if window or softcap:
        o = _masked_attention(qs, keys, values, start_pos, first, window, scale, softcap)
    elif n == 1:  # decode: the one query sees every cached position
        o = F.scaled_dot_product_attention(qs, keys, values, enable_gqa=True, scale=scale)
    elif start_pos == 0:  # fresh prefill: plain causal
        o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True, scale=scale)
    else:  # chunk after cached tokens: query i sees keys 0..start_pos + i
        rows = torch.arange(n, device=q.device)[:, None] + start_pos
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    return o.squeeze(0).transpose(0, 1)


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, first: int,
                      window: int, scale: float | None, softcap: float) -> torch.Tensor:
    """q [1, heads, n, d] at positions start_pos.., keys/values [1, kv_heads, m, d] at first.. ->
    [1, heads, n, d]: causal, within `window` when set, scores soft-capped when `softcap`."""
    n, m = q.shape[2], keys.shape[2]
    rows = torch.arange(n, device=q.device)[:, None] + start_pos
    cols = torch.arange(m, device=q.device)[None, :] + first
    mask = cols <= rows
    if window:
        mask &= cols > rows - window
    if not softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))  # at least fp32
    return torch.matmul(probs.to(q.dtype), values)


@dataclass(slots=True)
class SeqRows:
    """One sequence's rows of a flat batch, and its recurrent-state slot (-1: none)."""

    offset: int
    num_tokens: int
    state_slot: int
    verify: bool = False  # a speculative verify row: recurrent layers step token by token


@dataclass(slots=True)
class TorchContext:
    """What one forward's ops read besides their arguments."""

    meta: AttentionMetadata
    rotary: list[tuple[torch.Tensor, torch.Tensor]]  # per distinct RoPE: cos, signed sin [T, 1, rotary_dim]
    kv: KVCache
    states: RecurrentStates | None
    seqs: list[SeqRows]
    # verify rows of a hybrid model: slot r holds the recurrent state after flat token row r (the
    # runner restores a sequence's working slot from the row of its last accepted input)
    verify_states: RecurrentStates | None = None


class TorchOps:
    """The ops interface in torch. dtype: weights and matmuls; attn_dtype: q/k/v, RoPE, the KV cache
    and conv windows; pack keeps int4/int8 weights packed too, for the CPU decode kernel. The
    residual stream stays float32 whatever the compute dtype (matmul inputs are cast), which keeps
    bf16 runs close to the float32 reference for a few casts."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, attn_dtype: torch.dtype, device: torch.device,
                 pack: bool = False) -> None:
        self.config = config
        self.dtype = dtype
        self.attn_dtype = attn_dtype
        self.device = device
        self.pack = pack
        # per attention layer: its window, and its RoPE among the distinct ones (gemma3 has two)
        self.layers = attention_layers(config)
        ropes = list(dict.fromkeys(a.rope for a in self.layers))
        n = min(config.max_position_embeddings, 4096)
        self.ropes = [RotaryEmbedding(r, n, attn_dtype, device) for r in ropes]
        self.layer_rope = [ropes.index(a.rope) for a in self.layers]
        self.scale = config.query_pre_attn_scalar ** -0.5 if config.query_pre_attn_scalar else None
        self.ctx: TorchContext | None = None

    def context(self, seqs: list[tuple[int, int, list[int], int]], kv: KVCache,
                states: RecurrentStates | None, verify: list[bool] | None = None,
                verify_states: RecurrentStates | None = None) -> TorchContext:
        """seqs: (start_pos, num_tokens, block_table, state_slot) per sequence, in batch order;
        verify: per sequence, whether it is a speculative verify row (see TorchContext)."""
        meta, positions = AttentionMetadata.build([s[:3] for s in seqs], kv.page_size, self.device)
        rotary = [r.lookup(positions, meta.max_pos) for r in self.ropes]
        verify = verify or [False] * len(seqs)
        for m, v in zip(meta.seqs, verify):
            m.verify = v
        rows = [SeqRows(m.offset, m.num_tokens, s[3], v) for m, s, v in zip(meta.seqs, seqs, verify)]
        return TorchContext(meta, rotary, kv, states, rows, verify_states)

    def begin(self, ctx: TorchContext) -> None:
        self.ctx = ctx

    # -- weights ----------------------------------------------------------------------------

    def linear_weight(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]],
                      bias: torch.Tensor | None = None, glu: bool = False, logits: bool = False) -> Linear:
        """One Linear whose rows are the given stored weights stacked in order (a fused projection;
        glu, [gate, up] of a gated MLP for gated_linear, and logits, an lm_head, change nothing here)."""
        weight = torch.cat([dequantize(fmt, parts, self.dtype) for fmt, parts in items])
        lin = self.make_linear(weight.contiguous(), bias.to(self.dtype) if bias is not None else None)
        fmts = {fmt for fmt, _ in items}
        if self.pack and len(fmts) == 1:
            fmt = next(iter(fmts))
            if packable(fmt, tuple(weight.shape)):
                attach = (lin.attach_int4 if fmt.format == "int4" else lin.attach_int8 if fmt.format == "int8"
                          else lin.attach_blocks)
                attach(fmt, [parts for _, parts in items])
        elif self.pack and all(packable(fmt, tuple(weight.shape)) for fmt in fmts):
            lin.attach_mixed(items)  # a Q4_K_M's q/k in q4_k and v in q6_k, fused
        return lin

    def embedding_weight(self, fmt: TensorFormat, parts: dict[str, torch.Tensor], lm_head: bool) -> Linear:
        """The embedding table as a Linear (packed for decode too when it doubles as the lm_head)."""
        return self.linear_weight([(fmt, parts)]) if lm_head else Linear(dequantize(fmt, parts, self.dtype))

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """The Linear that keeps a weight (a subclass may keep other decode copies, see attach_*)."""
        return Linear(weight, bias)

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=torch.float32)

    parameter = vector

    # -- compute ----------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor, w: Linear, scale: float = 1.0) -> torch.Tensor:
        h = F.embedding(ids, w.weight).float()  # [T, hidden] float32 residual
        return h * scale if scale != 1.0 else h

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps).to(self.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        residual += x
        return rms_norm(residual, w, eps).to(self.dtype)

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        return w(x)

    def linear_add_rms_norm(self, x: torch.Tensor, w: Linear, residual: torch.Tensor, norm: torch.Tensor,
                            eps: float, then: Linear | None = None) -> torch.Tensor:
        return self.add_rms_norm(w(x), residual, norm, eps)

    def gated_linear(self, x: torch.Tensor, w: Linear, activation: str = "silu") -> torch.Tensor:
        gate, up = w(x).chunk(2, dim=-1)
        return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(gate)

    def attention(self, layer: int, qkv: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [T, (heads + 2 * kv_heads) * d] (q | k | v, maybe a view of a wider projection) ->
        [T, heads * d]. q and k side by side as [T, heads + kv_heads, d]: one norm and one RoPE for both."""
        ctx, c, adt = self.ctx, self.config, self.attn_dtype
        T, d, heads, kv_heads = qkv.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        qkv = qkv.to(adt)
        qk = qkv[:, :(heads + kv_heads) * d].view(T, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].view(T, kv_heads, d)
        if q_norm is not None:
            qk = rms_norm(qk, None, c.rms_norm_eps)
            qk[:, :heads] *= q_norm
            qk[:, heads:] *= k_norm
            qk = qk.to(adt)
        qk = apply_rotary(qk, *ctx.rotary[self.layer_rope[layer]])
        k_scale, v_scale = ctx.kv.scales(layer)
        return paged_attention(qk[:, :heads], qk[:, heads:], v, ctx.kv.k[layer], ctx.kv.v[layer], ctx.meta,
                               self.layers[layer].window, self.scale, c.attn_logit_softcapping,
                               k_scale, v_scale).to(self.dtype)

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, C] -> causal depthwise conv + SiLU per sequence, from and into its conv window."""
        conv = self.ctx.states.conv[layer]
        out = torch.empty_like(x)
        for s in self.ctx.seqs:
            if s.verify:  # token by token, as decode steps, keeping the window after each
                saved = self.ctx.verify_states.conv[layer]
                for r in range(s.offset, s.offset + s.num_tokens):
                    out[r:r + 1] = gdn_torch.short_conv(x[r:r + 1], weight, conv[s.state_slot])
                    saved[r].copy_(conv[s.state_slot])
                continue
            rows = slice(s.offset, s.offset + s.num_tokens)
            out[rows] = gdn_torch.short_conv(x[rows], weight, conv[s.state_slot])
        return out

    def gated_delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """q, k [T, Hk, dk], v [T, Hv, dv], a, b [T, Hv] -> [T, Hv, dv]: one step for every decode row
        at once, the chunked scan for each prompt, from and into each sequence's state."""
        ssm = self.ctx.states.ssm[layer]
        g, beta = gdn_torch.gdn_gates(a, b, A_log, dt_bias)
        out = torch.empty_like(v)
        single = [s for s in self.ctx.seqs if s.num_tokens == 1 and not s.verify]
        if single:
            rows = torch.tensor([s.offset for s in single], device=q.device)
            slots = torch.tensor([s.state_slot for s in single], device=q.device)
            states = ssm.index_select(0, slots)
            out[rows] = gdn_torch.gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states)
            ssm.index_copy_(0, slots, states)
        verify = [s for s in self.ctx.seqs if s.verify]
        for i in range(max((s.num_tokens for s in verify), default=0)):  # position i of every verify row
            step = [s for s in verify if s.num_tokens > i]
            rows = torch.tensor([s.offset + i for s in step], device=q.device)
            slots = torch.tensor([s.state_slot for s in step], device=q.device)
            states = ssm.index_select(0, slots)
            out[rows] = gdn_torch.gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states)
            ssm.index_copy_(0, slots, states)
            self.ctx.verify_states.ssm[layer].index_copy_(0, rows, states)
        for s in self.ctx.seqs:
            if s.num_tokens > 1 and not s.verify:
                r = slice(s.offset, s.offset + s.num_tokens)
                out[r] = gdn_torch.gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], ssm[s.state_slot])
        return out

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x, z [..., d] -> [..., d]."""
        d = x.shape[-1]
        return gdn_torch.gated_rms_norm(x.reshape(-1, d), z.reshape(-1, d), w, eps).view(x.shape)

    def logits(self, x: torch.Tensor, w: Linear, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> [n, vocab] float32 (into `out` when given)."""
        y = w(x, torch.float32)
        return y if out is None else out.copy_(y)

    def soft_cap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """x -> cap * tanh(x / cap), in place (final logit soft-capping)."""
        return x.div_(cap).tanh_().mul_(cap)
