"""Launchers for gdn.cu: the Qwen3.5 Gated DeltaNet layer's short conv, gated delta rule and gated
RMSNorm, and the gated full-attention output gate.

Same contract as launchers.py: the KernelCompiler first, every argument checked (dtypes, shapes,
strides, alignment, device) before a launch on the current torch stream, outputs written into
the tensors given. Varlen flat batches: B sequences' tokens concatenated, cu_seqlens [B+1] int32
bounding each one's rows, slots [B] int32 naming its row of every state tensor (distinct slots:
two sequences on one row race). States are fp32 except the conv state, which holds inputs (act).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ninfer.kernels.compiler import F32, I32, I64, KernelError, ptr
from ninfer.kernels.launchers import F32_DT, I32_DT, _act, _check

if TYPE_CHECKING:
    from ninfer.kernels.compiler import KernelCompiler

CONV_THREADS = 128
CONV_CHUNK = 64  # gdn.cu: tokens a short_conv block takes at a time
GDN_ROWS = 64  # gdn.cu: rows of a state column one lane keeps
MAX_CONV_K = 8
GDN_HEAD_DIMS = (64, 128)
WARP = 32
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


def _seqs(kc: KernelCompiler, cu_seqlens: torch.Tensor, slots: torch.Tensor) -> int:
    """B, after checking cu_seqlens [B+1] and slots [B] (int32, contiguous, on the device)."""
    _check(slots, "slots", I32_DT, [None], kc.device)
    B = slots.shape[0]
    if B > MAX_GRID_YZ:
        raise KernelError(f"{B} sequences in one launch; at most {MAX_GRID_YZ}")
    _check(cu_seqlens, "cu_seqlens", I32_DT, [B + 1], kc.device)
    return B


def _aligned(t: torch.Tensor, name: str, n: int) -> None:
    """Rows (every stride but the last) and the start of t fall on n-activation boundaries."""
    if t.data_ptr() % (n * t.element_size()) or any(s % n for s in t.stride()[:-1]):
        raise KernelError(f"{name} must start and have rows on {n}-element boundaries, got strides {t.stride()}")


def _rows_of(t: torch.Tensor, name: str, D: int) -> tuple[int, int]:
    """(token stride, head stride) of a [T, D] or [T, H, D] view with unit element stride, rows not overlapping."""
    if t.stride(-1) != 1:
        raise KernelError(f"{name} must have a unit last stride, got strides {t.stride()}")
    H = t.shape[1] if t.dim() == 3 else 1
    s0, s1 = t.stride(0), (t.stride(1) if t.dim() == 3 else D)
    if (H > 1 and s1 < D) or (t.shape[0] > 1 and s0 < (H - 1) * s1 + D):
        raise KernelError(f"{name} rows overlap: strides {t.stride()}")
    return s0, s1


def short_conv(kc: KernelCompiler, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
               cu_seqlens: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """Depthwise causal conv + SiLU per sequence, over [conv_state[slot] ; its tokens], in fp32.

    x, out [T, C] (row strides may exceed C; out must not overlap x); weight [C, K] (K in 2..8);
    conv_state [S, C, K-1]: the sequence's previous K-1 inputs, oldest first, replaced by the last
    K-1 inputs of [state ; tokens] (a sequence of n < K-1 tokens keeps K-1-n old ones). All act
    (bf16 or fp32, the same).
    """
    T, C = x.shape
    K = weight.shape[1] if weight.dim() == 2 else 0
    defines = {"CONV_K": K, **_act(x.dtype, "x")}
    B = _seqs(kc, cu_seqlens, slots)
    _check(x, "x", x.dtype, [T, C], kc.device, contiguous=False)
    _check(out, "out", x.dtype, [T, C], kc.device, contiguous=False)
    _check(weight, "weight", x.dtype, [C, K], kc.device)
    _check(conv_state, "conv_state", x.dtype, [None, C, K - 1], kc.device)
    if not 2 <= K <= MAX_CONV_K:
        raise KernelError(f"conv width {K} must be in 2..{MAX_CONV_K}")
    for name, t in (("x", x), ("out", out)):
        if T > 1 and t.stride(0) < C:
            raise KernelError(f"{name} rows overlap: strides {t.stride()}")
    if T and x.data_ptr() < out.data_ptr() + out.stride(0) * T * out.element_size() and \
            out.data_ptr() < x.data_ptr() + x.stride(0) * T * x.element_size():
        raise KernelError("out must not overlap x (other blocks still read x's tail)")
    # blocks a sequence: its CONV_CHUNK-token chunks go round-robin over them. Sequence lengths
    # stay on the device, so size for the average with room for skew: 1 for decode, all for one prefill.
    chunks = math.ceil(T / CONV_CHUNK)
    per_seq = min(chunks, max(1, math.ceil(2 * chunks / max(B, 1))))
    if per_seq > MAX_GRID_YZ:
        raise KernelError(f"{T} tokens make too many conv chunks ({per_seq} > {MAX_GRID_YZ})")
    if T and B:
        kc.kernel("gdn.cu", "short_conv", defines).launch(
            (math.ceil(C / CONV_THREADS), B, per_seq), (CONV_THREADS, 1, 1),
            [ptr(x), ptr(weight), ptr(conv_state), ptr(cu_seqlens), ptr(slots), ptr(out), I32(C),
             I32(conv_state.shape[0]), I64(x.stride(0)), I64(out.stride(0))])


def gated_delta_rule(kc: KernelCompiler, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                     cu_seqlens: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """The gated delta rule over each sequence's tokens in order, from and back into state[slot].

    q, k [T, Hk, dk], v [T, Hv, dv], a, b [T, Hv]: act, token strides free (views of one conv
    output row and one projection row), heads packed; A_log, dt_bias [Hv] fp32; state
    [S, Hv, dk, dv] fp32; out [T, Hv, dv] act (token stride free). dk, dv in (64, 128); value head
    h reads key head h // (Hv // Hk). Per token, in fp32: q, k l2-normalized (eps 1e-6), q scaled by
    dk^-0.5, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); state = state * exp(g);
    state += k (beta (v - k^T state))^T; out = q^T state.
    """
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    act = q.dtype
    defines = {"DK": dk, "DV": dv, **_act(act, "q")}
    B = _seqs(kc, cu_seqlens, slots)
    if dk not in GDN_HEAD_DIMS or dv not in GDN_HEAD_DIMS:
        raise KernelError(f"key/value head dims {dk}/{dv} not supported {GDN_HEAD_DIMS}")
    if Hk <= 0 or Hv % Hk:
        raise KernelError(f"{Hv} value heads must be a whole multiple of {Hk} key heads")
    for name, t, heads, d in (("q", q, Hk, dk), ("k", k, Hk, dk), ("v", v, Hv, dv), ("out", out, Hv, dv)):
        _check(t, name, act, [T, heads, d], kc.device, contiguous=False)
        if t.stride(1) != d or (T > 1 and t.stride(0) < heads * d):
            raise KernelError(f"{name} must have packed heads and non-overlapping rows, got strides {t.stride()}")
    for name, t in (("q", q), ("k", k)):
        _aligned(t, name, dk // WARP)  # a lane loads dk/32 consecutive elements at once
    for name, t in (("a", a), ("b", b)):
        _check(t, name, act, [T, Hv], kc.device, contiguous=False)
    _check(A_log, "A_log", F32_DT, [Hv], kc.device)
    _check(dt_bias, "dt_bias", F32_DT, [Hv], kc.device)
    _check(state, "state", F32_DT, [None, Hv, dk, dv], kc.device)
    if B:
        kc.kernel("gdn.cu", "gated_delta_rule", defines).launch(
            (dv // (WARP // (dk // GDN_ROWS)), Hv, B), (WARP, 1, 1),  # a warp owns 32 / (dk / 64) columns
            [ptr(q), ptr(k), ptr(v), ptr(a), ptr(b), ptr(A_log), ptr(dt_bias), ptr(state), ptr(cu_seqlens),
             ptr(slots), ptr(out), I32(Hk), I32(Hv), I32(state.shape[0]), I64(q.stride(0)), I64(k.stride(0)),
             I64(v.stride(0)), I64(a.stride(0)), I64(b.stride(0)), I64(out.stride(0))])


def _rows_args(kc: KernelCompiler, tensors: tuple[tuple[str, torch.Tensor], ...]) -> tuple[int, int, int, list[I64]]:
    """T, H, D and the (token, head) strides of same-shaped [T, D] or [T, H, D] act views, 4-aligned."""
    first = tensors[0][1]
    shape = list(first.shape)
    if first.dim() not in (2, 3):
        raise KernelError(f"{tensors[0][0]} must be [T, D] or [T, H, D], got {shape}")
    T, D = shape[0], shape[-1]
    H = shape[1] if first.dim() == 3 else 1
    if D % 4:
        raise KernelError(f"row width {D} must be a multiple of 4")
    strides: list[I64] = []
    for name, t in tensors:
        _check(t, name, first.dtype, shape, kc.device, contiguous=False)
        _aligned(t, name, 4)
        strides += [I64(s) for s in _rows_of(t, name, D)]
    return T, H, D, strides


def gated_rms_norm(kc: KernelCompiler, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                   eps: float) -> None:
    """out = weight * rmsnorm(x) * silu(z) over the last dim, fp32 math.

    x, z, out: [N, d] or [T, H, d] (token and head strides free and may differ; e.g. z a view of a
    fused projection row); weight [d]; all act (bf16 or fp32, the same); d % 4 == 0.
    """
    defines = _act(x.dtype, "x")
    T, H, D, strides = _rows_args(kc, (("x", x), ("z", z), ("out", out)))
    _check(weight, "weight", x.dtype, [D], kc.device, align16=True)
    rows = T * H
    if rows:
        kc.kernel("gdn.cu", "gated_rms_norm", defines).launch(
            (math.ceil(rows / 4), 1, 1), (4 * WARP, 1, 1),
            [ptr(x), ptr(z), ptr(weight), ptr(out), I32(T), I32(H), I32(D), *strides, F32(eps)])


def sigmoid_gate(kc: KernelCompiler, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
    """out = x * sigmoid(gate), elementwise (the gated attention output; out may be x).

    x, gate, out: [T, W] or [T, H, D] (token and head strides free; e.g. gate the second half of
    each head of q_proj's [T, H, 2D] output); all act (bf16 or fp32, the same); W or D % 4 == 0.
    """
    defines = _act(x.dtype, "x")
    T, H, D, strides = _rows_args(kc, (("x", x), ("gate", gate), ("out", out)))
    n = T * H * D // 4
    if n:
        kc.kernel("gdn.cu", "sigmoid_gate", defines).launch(
            (min(math.ceil(n / 256), 132 * 16), 1, 1), (256, 1, 1),
            [ptr(x), ptr(gate), ptr(out), I32(T), I32(H), I32(D), *strides])
