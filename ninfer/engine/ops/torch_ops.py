"""The torch implementation of the ops interface (CPU and CUDA), and its building blocks:
RMSNorm, RoPE, linear weights, paged attention, the Gated DeltaNet pieces (gdn_torch.py).

Numerics follow Hugging Face transformers (the reference the fidelity tests compare against):
RMSNorm reduced in float32, RoPE with the rotate_half convention and float32 angles, attention
through `scaled_dot_product_attention` with the default 1/sqrt(head_dim) scale. In float32 the
model is bit-equal to transformers on the tested prompts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.spec import StateSpec
from ninfer.engine.ops import gdn_torch
from ninfer.engine.quant import TensorFormat, dequantize, unpack_int4

# At most this many rows take the packed int4 kernel (decode); more rows (prefill) take the
# dense matmul, which is ~4x faster than the packed kernel at 128 rows on CPU.
PACKED_MAX_ROWS = 8
PACKED_GROUP_SIZES = (32, 64, 128, 256)


def packable(fmt: TensorFormat, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this stored format and logical [out, in] shape can take the packed CPU
    kernel (it wants out % 16 == 0 and one of its group sizes)."""
    if not fmt.quantized or fmt.group_size not in PACKED_GROUP_SIZES or len(shape) != 2:
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
    """[rotary_dim/2] float32 inverse frequencies; `llama3` scaling as transformers computes it."""
    dim = rotary_dim(config)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by `factor`, short ones kept, the band between interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding:
    """cos / signed-sin tables [positions, rotary_dim] in the attention dtype, grown by doubling."""

    __slots__ = ("inv_freq", "dtype", "device", "cos", "sin")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(config).to(device)
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, rotary_dim(config), dtype=dtype, device=device)
        self.sin = self.cos
        self._build(min(config.max_position_embeddings, 4096))

    def _build(self, n: int) -> None:
        # angles in float32 (position * inv_freq), exactly transformers' product, then cast
        freqs = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        # the sign of rotate_half folded in: rotate_half(x) * sin == roll(x, d/2) * [-sin, sin]
        sin = freqs.sin()
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)

    def lookup(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, rotary_dim] (broadcast over heads)."""
        if max_pos >= self.cos.shape[0]:
            n = self.cos.shape[0]
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


class KVCache:
    """Physical paged KV tensors: per attention layer K and V of [num_pages, page_size, kv_heads, head_dim]."""

    __slots__ = ("k", "v", "page_size", "num_pages")

    def __init__(self, spec: StateSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_pages, page_size, spec.attention.kv_heads, spec.attention.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_attention_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_attention_layers)]
        self.page_size = page_size
        self.num_pages = num_pages

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages src[i] -> dst[i] in every layer (int64 index tensors)."""
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))


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
        for t in (*self.conv, *self.ssm):
            t.index_copy_(0, dst, t.index_select(0, src))

    def zero(self, slots: torch.Tensor) -> None:
        """Reset slots to the state before any token (a sequence starting from position 0)."""
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, slots, 0)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row over a sequence's cached positions, float32: q [heads, d], keys / values
    [ctx, kv_heads, d] (views into the cache) -> [kv_heads, heads / kv_heads, d]. The query heads
    of one kv head are the rows of one small matmul, the cache is read in place: fewer and cheaper
    calls than SDPA at one query (its result within float32 rounding)."""
    kv_heads, d = keys.shape[1], keys.shape[2]
    qg = (q * d ** -0.5).view(kv_heads, -1, d)
    probs = torch.softmax(torch.bmm(qg, keys.permute(1, 2, 0)), dim=-1)  # [kv_heads, group, ctx]
    return torch.bmm(probs, values.transpose(0, 1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Store the batch's K/V in their slots, then attend each sequence over its cached positions.

    q: [T, heads, d]; k, v: [T, kv_heads, d]; caches: [pages, page_size, kv_heads, d].
    Returns [T, heads * d].
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
    ps = meta.page_size
    num_heads = q.shape[1]
    out = torch.empty_like(q) if len(meta.seqs) > 1 else None  # rows of several sequences
    for s in meta.seqs:
        ctx = s.start_pos + s.num_tokens
        if s.contiguous_from >= 0:  # a view, no copy
            base = s.contiguous_from * ps
            keys, values = flat_k[base:base + ctx], flat_v[base:base + ctx]
        else:  # gather the sequence's pages: [pages * page_size, kv_heads, d]
            keys = k_cache.index_select(0, s.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
            values = v_cache.index_select(0, s.block_table).view(-1, num_kv_heads, head_dim)[:ctx]
        if s.num_tokens == 1 and q.dtype == torch.float32:  # decode: the one query sees every cached position
            o = decode_attention(q[s.offset], keys, values)
            if out is None:
                return o.view(1, num_heads * head_dim)
            out[s.offset] = o.view(num_heads, head_dim)
            continue
        qs = q[s.offset:s.offset + s.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, d]
        values = values.transpose(0, 1).unsqueeze(0)
        if s.num_tokens == 1:  # decode (bf16 / fp16 on CUDA)
            o = F.scaled_dot_product_attention(qs, keys, values, enable_gqa=True)
        elif s.start_pos == 0:  # fresh prefill: plain causal
            o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
        else:  # chunk after cached tokens: query i sees keys 0..start_pos + i
            rows = torch.arange(s.num_tokens, device=q.device)[:, None] + s.start_pos
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
        if out is None:  # one sequence is the whole batch
            return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], num_heads * head_dim)
        out[s.offset:s.offset + s.num_tokens] = o.squeeze(0).transpose(0, 1)
    assert out is not None
    return out.reshape(q.shape[0], num_heads * head_dim)



@dataclass(slots=True)
class SeqRows:
    """One sequence's rows of a flat batch, and its recurrent-state slot (-1: none)."""

    offset: int
    num_tokens: int
    state_slot: int


@dataclass(slots=True)
class TorchContext:
    """What one forward's ops read besides their arguments."""

    meta: AttentionMetadata
    cos: torch.Tensor  # [T, 1, rotary_dim]
    sin: torch.Tensor
    kv: KVCache
    states: RecurrentStates | None
    seqs: list[SeqRows]


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
        self.rope = RotaryEmbedding(config, attn_dtype, device)
        self.ctx: TorchContext | None = None

    def context(self, seqs: list[tuple[int, int, list[int], int]], kv: KVCache,
                states: RecurrentStates | None) -> TorchContext:
        """seqs: (start_pos, num_tokens, block_table, state_slot) per sequence, in batch order."""
        meta, positions = AttentionMetadata.build([s[:3] for s in seqs], kv.page_size, self.device)
        cos, sin = self.rope.lookup(positions, meta.max_pos)
        rows = [SeqRows(m.offset, m.num_tokens, s[3]) for m, s in zip(meta.seqs, seqs)]
        return TorchContext(meta, cos, sin, kv, states, rows)

    def begin(self, ctx: TorchContext) -> None:
        self.ctx = ctx

    # -- weights ----------------------------------------------------------------------------

    def linear_weight(self, items: list[tuple[TensorFormat, dict[str, torch.Tensor]]],
                      bias: torch.Tensor | None = None) -> Linear:
        """One Linear whose rows are the given stored weights stacked in order (a fused projection)."""
        weight = torch.cat([dequantize(fmt, parts, self.dtype) for fmt, parts in items])
        lin = Linear(weight.contiguous(), bias.to(self.dtype) if bias is not None else None)
        fmts = {fmt for fmt, _ in items}
        if self.pack and len(fmts) == 1:
            fmt = next(iter(fmts))
            if packable(fmt, tuple(weight.shape)):
                attach = lin.attach_int4 if fmt.format == "int4" else lin.attach_int8
                attach(fmt, [parts for _, parts in items])
        return lin

    def embedding_weight(self, fmt: TensorFormat, parts: dict[str, torch.Tensor], lm_head: bool) -> Linear:
        """The embedding table as a Linear (packed for decode too when it doubles as the lm_head)."""
        return self.linear_weight([(fmt, parts)]) if lm_head else Linear(dequantize(fmt, parts, self.dtype))

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=torch.float32)

    parameter = vector

    # -- compute ----------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor, w: Linear) -> torch.Tensor:
        return F.embedding(ids, w.weight).float()  # [T, hidden] float32 residual

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps).to(self.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        residual += x
        return rms_norm(residual, w, eps).to(self.dtype)

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        return w(x)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

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
        qk = apply_rotary(qk, ctx.cos, ctx.sin)
        return paged_attention(qk[:, :heads], qk[:, heads:], v, ctx.kv.k[layer], ctx.kv.v[layer], ctx.meta).to(self.dtype)

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, C] -> causal depthwise conv + SiLU per sequence, from and into its conv window."""
        conv = self.ctx.states.conv[layer]
        out = torch.empty_like(x)
        for s in self.ctx.seqs:
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
        single = [s for s in self.ctx.seqs if s.num_tokens == 1]
        if single:
            rows = torch.tensor([s.offset for s in single], device=q.device)
            slots = torch.tensor([s.state_slot for s in single], device=q.device)
            states = ssm.index_select(0, slots)
            out[rows] = gdn_torch.gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states)
            ssm.index_copy_(0, slots, states)
        for s in self.ctx.seqs:
            if s.num_tokens > 1:
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
