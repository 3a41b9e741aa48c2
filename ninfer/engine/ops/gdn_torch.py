"""Pure-torch reference math of a Gated DeltaNet (GDN) layer, as Qwen3.5's linear-attention layers use it.

Numerics follow Hugging Face transformers' `modeling_qwen3_5` (the fidelity reference): the short
convolution is `causal_conv1d_fn` / `causal_conv1d_update` with SiLU, the recurrence is
`torch_chunk_gated_delta_rule` (T > 1, chunks of 64) / `torch_recurrent_gated_delta_rule` (T == 1)
with q and k L2-normalized in the kernel, all in float32, and the output norm is
`Qwen3_5RMSNormGated`. Functions take one sequence at a time ([T, ...], no batch dimension) except
`gated_delta_rule_step`, which advances B decode rows by one token each.

The gated delta rule, per value head, with state S [dk, dv] and log-decay g <= 0:
    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      (write only what S does not already predict)
    o_t = S^T q_t
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked algorithm, as transformers
L2_EPS = 1e-6  # transformers' l2norm eps (inside the rsqrt)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over the concatenation [state; x].

    x: [T, C] one sequence's new inputs; weight: [C, K]; state: [C, K-1], the previous K-1 inputs
    (oldest first; zeros for a fresh sequence). Computed in float32, returned as [T, C] in x's dtype.
    `state` is overwritten in place with the last K-1 inputs of state ++ x, so a sequence fed in
    pieces gives what it gives in one piece.
    """
    T, C = x.shape
    K = weight.shape[1]
    assert K >= 2 and state.shape == (C, K - 1), f"state {tuple(state.shape)} for C={C}, K={K}"
    window = torch.cat([state.float(), x.t().float()], dim=1)  # [C, K-1+T]
    state.copy_(window[:, -(K - 1):])
    out = F.conv1d(window.unsqueeze(0), weight.float().unsqueeze(1), groups=C)  # [1, C, T]
    return F.silu(out[0]).t().contiguous().to(x.dtype)  # [T, C]


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv] projections; A_log, dt_bias: [Hv]. Returns float32 (g, beta), each [T, Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (log-decay, <= 0), beta = sigmoid(b).

    beta is taken in b's dtype before the cast, as transformers does (`b.sigmoid()`); in float32
    that is the same thing.
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return g, beta


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [..., Hk, dk] -> float32 [..., Hv, dk]: L2-normalized, q scaled by dk**-0.5, and each
    key head repeated for its Hv // Hk consecutive value heads."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * q.shape[-1] ** -0.5
    rep = num_v_heads // k.shape[-2]
    assert rep * k.shape[-2] == num_v_heads, f"{num_v_heads} value heads over {k.shape[-2]} key heads"
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k


def _delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token of the recurrence, any leading dims (...). q, k: [..., H, dk]; v: [..., H, dv];
    g, beta: [..., H]; state: float32 [..., H, dk, dv], updated in place. Returns float32 [..., H, dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # [..., H, dv]: S^T k
    delta = (v - predicted) * beta.unsqueeze(-1)  # [..., H, dv]
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))  # rank-1 write k delta^T
    return (q.unsqueeze(-2) @ state).squeeze(-2)  # [..., H, dv]: S^T q


def _chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The recurrence over T tokens in chunks of CHUNK, as transformers' torch_chunk_gated_delta_rule.

    q, k: float32 [T, H, dk] (prepared); v: float32 [T, H, dv]; g, beta: float32 [T, H];
    state: float32 [H, dk, dv], updated in place. Returns float32 [T, H, dv].

    Within a chunk, with G_i the cumulative log-decay from the chunk start to token i and S0 the
    state entering the chunk, the per-token writes u_i = beta_i (v_i - exp(G_i) S0^T k_i
    - sum_{j<i} exp(G_i - G_j) (k_i.k_j) u_j) solve a unit lower-triangular system, so a chunk costs
    a few matmuls; only the S0-dependent part is left for the sequential scan over chunks.
    """
    T, H, dk = k.shape
    C = CHUNK
    pad = (-T) % C  # padded tokens have q = k = v = 0, g = 0, beta = 0: they change nothing

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> contiguous [H, N, C, ...]
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(H, -1, C, *x.shape[2:]).contiguous()

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))  # q, k: [H, N, C, dk]; g: [H, N, C]
    G = g.cumsum(-1)  # [H, N, C]
    future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # [H, N, C, C]: exp(G_i - G_j), the decay from token j to token i (j <= i; 0 above the diagonal)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, C, C]; only its strictly lower part is used
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(system)
    # (I + strictly_lower(system))^-1 once, then two matmuls: half the work of solving for both right-hand sides
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u_free = inverse @ (v * beta.unsqueeze(-1))  # [H, N, C, dv]: the writes if S0 were zero
    k_read = inverse @ (k_beta * G.exp().unsqueeze(-1))  # [H, N, C, dk]: u = u_free - k_read @ S0
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C] attention within the chunk
    q_read = q * G.exp().unsqueeze(-1)  # reads S0 decayed to token i
    # [H, N, dk, C]: keys of the writes, decayed to the chunk end
    k_write = (k * (G[..., -1:] - G).exp().unsqueeze(-1)).transpose(-1, -2).contiguous()
    chunk_decay = G[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out = torch.empty_like(u_free)  # [H, N, C, dv]
    for n in range(q.shape[1]):
        u = u_free[:, n] - k_read[:, n] @ state  # [H, C, dv]
        out[:, n] = q_read[:, n] @ state + intra[:, n] @ u
        state.mul_(chunk_decay[:, n]).add_(k_write[:, n] @ u)
    return out.reshape(H, -1, out.shape[-1])[:, :T].transpose(0, 1)  # [T, H, dv]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over one sequence's T new tokens, starting from `state`.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv] (from gdn_gates); state: float32
    [Hv, dk, dv], updated in place to the state after the last token (zeros for a fresh sequence).
    q and k are L2-normalized and q scaled by dk**-0.5 here. Returns [T, Hv, dv] in v's dtype.
    T == 1 takes the recurrent step, T > 1 the chunked algorithm; both compute in float32.
    """
    T, Hv, dv = v.shape
    assert state.dtype == torch.float32 and state.shape == (Hv, k.shape[-1], dv), f"state {tuple(state.shape)}"
    if T == 0:
        return v.new_empty(0, Hv, dv)
    q, k = _prepare_qk(q, k, Hv)
    if T == 1:
        out = _delta_step(q[0], k[0], v[0].float(), g[0].float(), beta[0].float(), state).unsqueeze(0)
    else:
        out = _chunked_delta_rule(q, k, v.float(), g.float(), beta.float(), state)
    return out.to(v.dtype)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences (decode rows) at once.

    q, k: [B, Hk, dk]; v: [B, Hv, dv]; g, beta: [B, Hv]; states: float32 [B, Hv, dk, dv], row b the
    state of row b's sequence, updated in place. Returns [B, Hv, dv] in v's dtype.
    """
    B, Hv, dv = v.shape
    assert states.dtype == torch.float32 and states.shape == (B, Hv, k.shape[-1], dv), f"{tuple(states.shape)}"
    q, k = _prepare_qk(q, k, Hv)
    return _delta_step(q, k, v.float(), g.float(), beta.float(), states).to(v.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated. x, z: [N, d]; weight: [d]. RMSNorm of x in float32, cast to x's dtype,
    times weight, times silu(z) in float32; returned [N, d] in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    out = out * F.silu(z.float())
    return out.to(dtype)
