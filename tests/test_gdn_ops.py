"""ninfer.engine.ops.gdn_torch against transformers' Qwen3.5 Gated DeltaNet reference functions.

CPU, float32, fixed seeds, small shapes (Hk=2 key heads, Hv=4 value heads, dk=dv=16, conv K=4,
C=24 channels). transformers' functions take [batch, T, heads, dim] / [batch, C, T]; ours take one
sequence [T, ...] (or B decode rows for the step).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.ops.gdn_torch import (
    gated_delta_rule,
    gated_delta_rule_step,
    gated_rms_norm,
    gdn_gates,
    short_conv,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

HK, HV, DK, DV = 2, 4, 16, 16
K_CONV, C_CONV = 4, 24
ATOL, RTOL = 1e-5, 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def _gdn_inputs(T: int, seed: int, hk: int = HK, hv: int = HV, dk: int = DK, dv: int = DV, slow: bool = False):
    """q, k [T, hk, dk], v [T, hv, dv], realistic gates g, beta [T, hv], and a nonzero state [hv, dk, dv].

    Gates as Qwen3_5GatedDeltaNet's init (A in [0.01, 16]) forget within a few tokens on most heads;
    slow=True takes A in [1e-3, 0.03] so the state carries across chunks and calls."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, dk, generator=gen)
    k = torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    a = torch.randn(T, hv, generator=gen)
    b = torch.randn(T, hv, generator=gen)
    A_log = torch.empty(hv).uniform_(*((1e-3, 0.03) if slow else (0.01, 16)), generator=gen).log()
    dt_bias = torch.rand(hv, generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    state = 0.5 * torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _hf_rule(fn, q, k, v, g, beta, state):
    """Run a transformers gated-delta-rule function on one sequence; returns (out [T, Hv, dv], state)."""
    out, final = fn(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


# ---- short_conv ----------------------------------------------------------------------------------

def _conv_inputs(T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C_CONV, generator=gen)
    weight = torch.randn(C_CONV, K_CONV, generator=gen)
    state = torch.randn(C_CONV, K_CONV - 1, generator=gen)
    return x, weight, state


@pytest.mark.parametrize("T", [1, 2, 5, 33])
def test_short_conv_fresh_matches_causal_conv1d_fn(T):
    x, weight, _ = _conv_inputs(T, seed=1)
    state = torch.zeros(C_CONV, K_CONV - 1)
    out = short_conv(x, weight, state)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    assert out.shape == (T, C_CONV) and out.dtype == x.dtype
    _close(out, ref)
    # the state now holds the last K-1 inputs (zeros in front when T < K-1)
    expected_state = torch.cat([torch.zeros(C_CONV, K_CONV - 1), x.t()], dim=1)[:, -(K_CONV - 1):]
    torch.testing.assert_close(state, expected_state, atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 2, 7])
def test_short_conv_with_state_matches_causal_conv1d_update(T):
    x, weight, state = _conv_inputs(T, seed=2)
    ref_state = state.clone()[None]
    ref = hf.causal_conv1d_update(x.t()[None], ref_state, weight, None, activation="silu")[0].t()
    out = short_conv(x, weight, state)
    _close(out, ref)
    torch.testing.assert_close(state, ref_state[0], atol=0, rtol=0)
    # the state really is used: from a zero state the output differs
    fresh = short_conv(x, weight, torch.zeros_like(state))
    assert (fresh[0] - out[0]).abs().max() > 1e-2


def test_short_conv_in_pieces_equals_one_go():
    x, weight, state0 = _conv_inputs(37, seed=3)
    whole_state = state0.clone()
    whole = short_conv(x, weight, whole_state)
    piece_state = state0.clone()
    pieces = []
    start = 0
    for n in (1, 2, 5, 1, 28):  # includes pieces shorter than K-1
        pieces.append(short_conv(x[start:start + n], weight, piece_state))
        start += n
    assert start == 37
    _close(torch.cat(pieces), whole)
    torch.testing.assert_close(piece_state, whole_state, atol=0, rtol=0)


def test_short_conv_bf16_computes_in_float32():
    x, weight, state = _conv_inputs(9, seed=4)
    xb, wb, sb = x.bfloat16(), weight.bfloat16(), state.bfloat16()
    out = short_conv(xb, wb, sb)
    assert out.dtype == torch.bfloat16 and sb.dtype == torch.bfloat16
    window = torch.cat([state.bfloat16().float(), xb.t().float()], dim=1)
    ref = F.silu(F.conv1d(window[None], wb.float().unsqueeze(1), groups=C_CONV))[0].t().bfloat16()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# ---- gdn_gates -----------------------------------------------------------------------------------

def test_gdn_gates_formula():
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(6, HV, generator=gen), torch.randn(6, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (6, HV)
    # transformers' Qwen3_5GatedDeltaNet.forward, written out
    _close(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias), atol=0, rtol=0)
    _close(beta, b.sigmoid(), atol=0, rtol=0)
    # a hand value: A = 1, a + dt_bias = 0 -> g = -log 2; b = 0 -> beta = 1/2
    g0, b0 = gdn_gates(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.zeros(1))
    assert abs(g0.item() + 0.6931471805599453) < 1e-7 and b0.item() == 0.5
    assert (g <= 0).all()


# ---- gated_delta_rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("T", [2, 7, 64, 65, 150])
def test_gated_delta_rule_matches_hf_chunked(T, slow):
    q, k, v, g, beta, state = _gdn_inputs(T, seed=10 + T, slow=slow)
    ref_out, ref_state = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    out = gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (T, HV, DV) and out.dtype == v.dtype
    _close(out, ref_out)
    _close(state, ref_state)


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("T", [1, 9, 70])
def test_gated_delta_rule_matches_hf_recurrent(T, slow):
    q, k, v, g, beta, state = _gdn_inputs(T, seed=20 + T, slow=slow)
    ref_out, ref_state = _hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    out = gated_delta_rule(q, k, v, g, beta, state)
    _close(out, ref_out)
    _close(state, ref_state)


def test_gated_delta_rule_fresh_state_and_state_matters():
    q, k, v, g, beta, state = _gdn_inputs(40, seed=30, slow=True)
    zero = torch.zeros_like(state)
    ref_out, ref_state = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, zero)
    out = gated_delta_rule(q, k, v, g, beta, zero)
    _close(out, ref_out)
    _close(zero, ref_state)
    # a nonzero initial state changes the output well beyond the tolerance
    with_state = gated_delta_rule(q, k, v, g, beta, state)
    assert (with_state - out).abs().max() > 1e-2


@pytest.mark.parametrize("slow", [False, True])
def test_gated_delta_rule_one_call_equals_pieces_equals_steps(slow):
    T = 150
    q, k, v, g, beta, state0 = _gdn_inputs(T, seed=40, slow=slow)
    s_whole = state0.clone()
    whole = gated_delta_rule(q, k, v, g, beta, s_whole)

    s_pieces = state0.clone()
    first = gated_delta_rule(q[:100], k[:100], v[:100], g[:100], beta[:100], s_pieces)
    second = gated_delta_rule(q[100:], k[100:], v[100:], g[100:], beta[100:], s_pieces)
    _close(torch.cat([first, second]), whole)
    _close(s_pieces, s_whole)

    s_steps = state0.clone()
    steps = [
        gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s_steps) for t in range(T)
    ]
    _close(torch.cat(steps), whole)
    _close(s_steps, s_whole)


def test_gated_delta_rule_head_grouping_is_consecutive():
    # With Hv // Hk = 2, value heads 0 and 1 read key head 0: feeding key head 0 twice as an Hk = Hv
    # problem gives the same result; interleaving (0, 1, 0, 1) would not.
    q, k, v, g, beta, state = _gdn_inputs(12, seed=50)
    s_grouped, s_full = state.clone(), state.clone()
    grouped = gated_delta_rule(q, k, v, g, beta, s_grouped)
    full = gated_delta_rule(q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), v, g, beta, s_full)
    _close(grouped, full)
    s_tiled = state.clone()
    tiled = gated_delta_rule(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v, g, beta, s_tiled)
    assert (tiled - grouped).abs().max() > 1e-2


def test_gated_delta_rule_bf16_io():
    q, k, v, g, beta, state = _gdn_inputs(20, seed=60)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref_out, ref_state = _hf_rule(hf.torch_chunk_gated_delta_rule, qb, kb, vb, g, beta, state)
    out = gated_delta_rule(qb, kb, vb, g, beta, state)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    _close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)  # one bf16 rounding of the output
    _close(state, ref_state)


# ---- gated_delta_rule_step -----------------------------------------------------------------------

def test_step_batched_equals_per_sequence():
    B = 5
    rows = [_gdn_inputs(1, seed=70 + i) for i in range(B)]
    q, k, v, g, beta, states = (torch.cat([r[j] if j < 5 else r[j][None] for r in rows]) for j in range(6))
    assert q.shape == (B, HK, DK) and states.shape == (B, HV, DK, DV)
    ref_states = states.clone()
    out = gated_delta_rule_step(q, k, v, g, beta, states)
    assert out.shape == (B, HV, DV)
    for b in range(B):
        s = ref_states[b].clone()
        one = gated_delta_rule(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], s)
        _close(out[b], one[0])
        _close(states[b], s)
        hf_out, hf_state = _hf_rule(
            hf.torch_recurrent_gated_delta_rule, q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1],
            ref_states[b],
        )
        _close(out[b], hf_out[0])
        _close(states[b], hf_state)


def test_step_decodes_a_sequence_like_the_chunked_call():
    T = 30
    q, k, v, g, beta, state0 = _gdn_inputs(T, seed=80, slow=True)
    s_whole = state0.clone()
    whole = gated_delta_rule(q, k, v, g, beta, s_whole)
    states = state0.clone()[None]
    outs = [
        gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], states) for t in range(T)
    ]
    _close(torch.cat(outs), whole)
    _close(states[0], s_whole)


# ---- gated_rms_norm ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_hf(dtype):
    gen = torch.Generator().manual_seed(90)
    x = torch.randn(12, DV, generator=gen).to(dtype)
    z = torch.randn(12, DV, generator=gen).to(dtype)
    norm = hf.Qwen3_5RMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(DV, generator=gen))
        ref = norm(x, z)
    out = gated_rms_norm(x, z, norm.weight.detach(), 1e-6)
    assert out.dtype == dtype and out.shape == (12, DV)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# ---- timing (printed, not asserted) --------------------------------------------------------------

def test_timing_record(capsys):
    T, hk, hv, d = 512, 16, 32, 128
    q, k, v, g, beta, state = _gdn_inputs(T, seed=100, hk=hk, hv=hv, dk=d, dv=d)
    gated_delta_rule(q[:64], k[:64], v[:64], g[:64], beta[:64], state.clone())  # warm-up
    times = []
    for _ in range(3):
        s = state.clone()
        t0 = time.perf_counter()
        gated_delta_rule(q, k, v, g, beta, s)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    t_hf = time.perf_counter() - t0
    with capsys.disabled():
        print(
            f"\ngated_delta_rule T={T} Hk={hk} Hv={hv} dk=dv={d} CPU ({torch.get_num_threads()} threads): "
            f"best {min(times) * 1e3:.1f} ms of {[round(t * 1e3, 1) for t in times]}; "
            f"transformers torch_chunk_gated_delta_rule {t_hf * 1e3:.1f} ms"
        )
