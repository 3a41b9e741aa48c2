// Qwen3.5 hybrid-architecture kernels: the Gated DeltaNet (GDN) linear-attention layer's short
// causal conv and gated delta rule, its gated RMSNorm, and the gated full-attention output gate.
// Activations are `act` (bf16, or fp32 with ACT_F32); math and recurrent states are fp32.
//
// Varlen flat batches: B sequences with their tokens concatenated; sequence b owns token rows
// cu_seqlens[b] .. cu_seqlens[b+1]-1 and state row slots[b] of each state tensor. A slot outside
// [0, S) writes NaN outputs and leaves every state row alone, so the bug shows.
#include "common.cuh"

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// ---------------------------------------------------------------- short causal conv

#ifndef CONV_K
#define CONV_K 4
#endif
#define CONV_CHUNK 64  // tokens a block takes at a time; >= CONV_K - 1, so only a sequence's chunk 0 reads its state

// out[t, c] = silu(sum_j weight[c, j] * in[p - (K-1) + j]) over in = [conv_state[slot] ; this sequence's x],
// then conv_state[slot] = the last K-1 inputs of [conv_state ; x] (oldest first).
//   x [T, C] and out [T, C] act with row strides; weight [C, K] act; conv_state [S, C, K-1] act.
// Grid: (ceil(C / blockDim), B, Z); block (., b, z) takes chunks z, z + Z, .. of sequence b's
// CONV_CHUNK-token chunks, a thread one channel. Only block z = 0 touches the state: its first
// chunk reads the old state and, after its last, it writes the new one, so no block sees a
// half-updated row.
extern "C" __global__ void short_conv(const act* __restrict__ x, const act* __restrict__ weight,
                                      act* __restrict__ conv_state, const i32* __restrict__ cu_seqlens,
                                      const i32* __restrict__ slots, act* __restrict__ out, int C, int S,
                                      i64 x_stride, i64 out_stride) {
  PDL_ENTRY();
  constexpr int K = CONV_K, KS = CONV_K - 1;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int b = blockIdx.y;
  const int seq0 = cu_seqlens[b], n = cu_seqlens[b + 1] - seq0;
  const int slot = slots[b];
  const bool bad_slot = slot < 0 || slot >= S;
  act* st = conv_state + ((i64)(bad_slot ? 0 : slot) * C + c) * KS;
  float w[K];
#pragma unroll
  for (int j = 0; j < K; ++j) w[j] = act_f32(weight[(i64)c * K + j]);
  float old[KS];  // block z = 0: the old state, kept for the write-back of short sequences
  for (int p0 = blockIdx.z * CONV_CHUNK; p0 < n; p0 += gridDim.z * CONV_CHUNK) {
    const int p1 = min(n, p0 + CONV_CHUNK);
    if (bad_slot) {
      for (int p = p0; p < p1; ++p) out[(seq0 + p) * out_stride + c] = to_act(NAN_F);
      continue;
    }
    float win[KS];  // inputs at positions p-(K-1) .. p-1
#pragma unroll
    for (int j = 0; j < KS; ++j) {
      const int pos = p0 - KS + j;  // < 0: from the state, whose entry i holds position i - (K-1)
      win[j] = act_f32(pos < 0 ? st[KS + pos] : x[(seq0 + pos) * x_stride + c]);
    }
    if (p0 == 0) {
#pragma unroll
      for (int j = 0; j < KS; ++j) old[j] = win[j];
    }
    for (int p = p0; p < p1; ++p) {
      const float xv = act_f32(x[(seq0 + p) * x_stride + c]);
      float acc = w[KS] * xv;
#pragma unroll
      for (int j = 0; j < KS; ++j) acc = fmaf(w[j], win[j], acc);
      out[(seq0 + p) * out_stride + c] = to_act(silu_f(acc));
#pragma unroll
      for (int j = 0; j + 1 < KS; ++j) win[j] = win[j + 1];
      win[KS - 1] = xv;
    }
  }
  if (blockIdx.z == 0 && n > 0 && !bad_slot) {
    // new entry i is the input at position n - (K-1) + i: from x, or (fewer than K-1 tokens) the old state
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      const int pos = n - KS + i;
      st[i] = pos >= 0 ? x[(seq0 + pos) * x_stride + c] : to_act(old[KS + pos]);
    }
  }
}

// ---------------------------------------------------------------- gated delta rule

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#define QK_PER_LANE (DK / WARP)  // 2 or 4 consecutive q/k elements a lane loads
#define GDN_ROWS 64                // rows of S a lane keeps in registers (32 measured no faster, decode slower)
#define GDN_SPLIT (DK / GDN_ROWS)  // lanes sharing a column: 1 (DK 64) or 2 (DK 128)
#define GDN_COLS (WARP / GDN_SPLIT)  // columns a warp owns

// Per (sequence, value head h), the state S [DK, DV] fp32 runs over the sequence's tokens in order:
//   q, k <- l2norm(q), l2norm(k) (x * rsqrt(sum x^2 + 1e-6)); q *= DK^-0.5
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h]); beta = sigmoid(b)
//   S *= exp(g); delta = (v - k^T S) * beta; S += k delta^T; out = q^T S
// Value head h reads key head h / (Hv / Hk).
//   q, k [T, Hk, DK], v [T, Hv, DV], a, b [T, Hv]: act, row strides given (views of one conv output row);
//   A_log, dt_bias [Hv] fp32; state [S, Hv, DK, DV] fp32; out [T, Hv, DV] act with a row stride.
// Grid: (DV / GDN_COLS, Hv, B), one warp a block. Lane l owns column j = GDN_COLS * blockIdx.x + l % GDN_COLS
// of S, rows part * 64 .. part * 64 + 63 (part = l / GDN_COLS) in registers; with DK 128 a lane's
// column sums combine with its partner's by a shuffle. No barrier beyond __syncwarp around the
// normalized q, k the lanes share through shared memory. Token t+1's inputs load while token t computes.
struct GdnToken {
  float q[QK_PER_LANE], k[QK_PER_LANE], v, a, b;
};

__device__ __forceinline__ void gdn_load(GdnToken& in, int t, int h, int hk, int j, int lane,
                                         const act* __restrict__ q, const act* __restrict__ k,
                                         const act* __restrict__ v, const act* __restrict__ a,
                                         const act* __restrict__ b, i64 q_stride, i64 k_stride, i64 v_stride,
                                         i64 a_stride, i64 b_stride) {
  load_act<QK_PER_LANE>(q + t * q_stride + (i64)hk * DK + lane * QK_PER_LANE, in.q);
  load_act<QK_PER_LANE>(k + t * k_stride + (i64)hk * DK + lane * QK_PER_LANE, in.k);
  in.v = act_f32(v[t * v_stride + (i64)h * DV + j]);
  in.a = act_f32(a[t * a_stride + h]);
  in.b = act_f32(b[t * b_stride + h]);
}

// The sum over the lanes sharing a column (every one of them gets the same value).
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
  for (int o = GDN_COLS; o < WARP; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

extern "C" __global__ void __launch_bounds__(WARP)
gated_delta_rule(const act* __restrict__ q, const act* __restrict__ k, const act* __restrict__ v,
                 const act* __restrict__ a, const act* __restrict__ b, const float* __restrict__ A_log,
                 const float* __restrict__ dt_bias, float* __restrict__ state, const i32* __restrict__ cu_seqlens,
                 const i32* __restrict__ slots, act* __restrict__ out, int Hk, int Hv, int S, i64 q_stride,
                 i64 k_stride, i64 v_stride, i64 a_stride, i64 b_stride, i64 out_stride) {
  PDL_ENTRY();
  __shared__ __align__(16) float sq[DK], sk[DK];
  const int lane = threadIdx.x;
  const int part = lane / GDN_COLS, row0 = part * GDN_ROWS;
  const int j = blockIdx.x * GDN_COLS + lane % GDN_COLS, h = blockIdx.y, seq = blockIdx.z;
  const int hk = h / (Hv / Hk);
  const int t0 = cu_seqlens[seq], t1 = cu_seqlens[seq + 1];
  const int slot = slots[seq];
  if (slot < 0 || slot >= S) {
    for (int t = t0; t < t1; ++t)
      if (part == 0) out[t * out_stride + (i64)h * DV + j] = to_act(NAN_F);
    return;
  }
  float* st = state + (((i64)slot * Hv + h) * DK + row0) * DV + j;
  float s[GDN_ROWS];  // rows row0.. of column j of S
#pragma unroll
  for (int i = 0; i < GDN_ROWS; ++i) s[i] = st[i * DV];
  const float A = -expf(A_log[h]), bias = dt_bias[h];
  const float q_scale = rsqrtf((float)DK);
  const float* sqp = sq + row0;
  const float* skp = sk + row0;
  GdnToken next;
  if (t0 < t1) gdn_load(next, t0, h, hk, j, lane, q, k, v, a, b, q_stride, k_stride, v_stride, a_stride, b_stride);
  for (int t = t0; t < t1; ++t) {
    const GdnToken cur = next;
    if (t + 1 < t1)
      gdn_load(next, t + 1, h, hk, j, lane, q, k, v, a, b, q_stride, k_stride, v_stride, a_stride, b_stride);
    float qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int e = 0; e < QK_PER_LANE; ++e) {
      qq += cur.q[e] * cur.q[e];
      kk += cur.k[e] * cur.k[e];
    }
    const float rq = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, rk = rsqrtf(warp_sum(kk) + 1e-6f);
    __syncwarp();  // every lane is done reading the previous token's sq, sk
#pragma unroll
    for (int e = 0; e < QK_PER_LANE; ++e) {
      sq[lane * QK_PER_LANE + e] = cur.q[e] * rq;
      sk[lane * QK_PER_LANE + e] = cur.k[e] * rk;
    }
    __syncwarp();
    const float x = cur.a + bias;
    const float decay = expf(A * (x > 20.0f ? x : log1pf(expf(x))));  // exp(g); softplus as torch's (threshold 20)
    const float beta = 1.0f / (1.0f + expf(-cur.b));
    // k^T (S * decay) = decay * (k^T S); four partial sums shorten the dependency chain
    float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < GDN_ROWS; i += 4) {
      const float4 k4 = *(const float4*)(skp + i);
      kv[0] = fmaf(k4.x, s[i], kv[0]);
      kv[1] = fmaf(k4.y, s[i + 1], kv[1]);
      kv[2] = fmaf(k4.z, s[i + 2], kv[2]);
      kv[3] = fmaf(k4.w, s[i + 3], kv[3]);
    }
    const float delta = (cur.v - decay * column_sum((kv[0] + kv[1]) + (kv[2] + kv[3]))) * beta;
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < GDN_ROWS; i += 4) {
      const float4 k4 = *(const float4*)(skp + i), q4 = *(const float4*)(sqp + i);
      s[i] = fmaf(s[i], decay, k4.x * delta);
      s[i + 1] = fmaf(s[i + 1], decay, k4.y * delta);
      s[i + 2] = fmaf(s[i + 2], decay, k4.z * delta);
      s[i + 3] = fmaf(s[i + 3], decay, k4.w * delta);
      o[0] = fmaf(q4.x, s[i], o[0]);
      o[1] = fmaf(q4.y, s[i + 1], o[1]);
      o[2] = fmaf(q4.z, s[i + 2], o[2]);
      o[3] = fmaf(q4.w, s[i + 3], o[3]);
    }
    const float o_sum = column_sum((o[0] + o[1]) + (o[2] + o[3]));
    if (part == 0) out[t * out_stride + (i64)h * DV + j] = to_act(o_sum);
  }
#pragma unroll
  for (int i = 0; i < GDN_ROWS; ++i) st[i * DV] = s[i];
}

// ---------------------------------------------------------------- gated RMSNorm, sigmoid gate

// Rows of width D: row (t, h) of a tensor starts at t * s0 + h * s1 (a 2-D [T, D] tensor is H = 1).

// out = weight * rmsnorm(x) * silu(z) per row; fp32. x, z, out [T, H, D] act; weight [D] act.
// Grid: ceil(T * H / 4) blocks of 4 warps, a warp a row; 4 activations a lane at a time.
extern "C" __global__ void gated_rms_norm(const act* __restrict__ x, const act* __restrict__ z,
                                          const act* __restrict__ weight, act* __restrict__ out, int T, int H,
                                          int D, i64 x_s0, i64 x_s1, i64 z_s0, i64 z_s1, i64 out_s0, i64 out_s1,
                                          float eps) {
  PDL_ENTRY();
  const int lane = threadIdx.x & 31;
  const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= (i64)T * H) return;
  const i64 t = row / H, h = row % H;
  const act* xr = x + t * x_s0 + h * x_s1;
  const act* zr = z + t * z_s0 + h * z_s1;
  act* orow = out + t * out_s0 + h * out_s1;
  float ss = 0.0f;
  for (int e = lane * 4; e < D; e += 4 * WARP) {
    float f[4];
    load_act<4>(xr + e, f);
    ss += f[0] * f[0] + f[1] * f[1] + f[2] * f[2] + f[3] * f[3];
  }
  const float inv = rsqrtf(warp_sum(ss) / (float)D + eps);
  for (int e = lane * 4; e < D; e += 4 * WARP) {
    float f[4], g[4], w[4];
    load_act<4>(xr + e, f);
    load_act<4>(zr + e, g);
    load_act<4>(weight + e, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = w[i] * (f[i] * inv) * silu_f(g[i]);
    store_act<4>(orow + e, f);
  }
}

// out = x * sigmoid(gate), elementwise over [T, H, D] views; out may be x. Grid-stride, 4 a thread.
extern "C" __global__ void sigmoid_gate(const act* x, const act* __restrict__ gate, act* out, int T, int H, int D,
                                        i64 x_s0, i64 x_s1, i64 g_s0, i64 g_s1, i64 out_s0, i64 out_s1) {
  PDL_ENTRY();
  const int nvec = D / 4;
  const i64 total = (i64)T * H * nvec;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const i64 row = idx / nvec;
    const int e = (int)(idx % nvec) * 4;
    const i64 t = row / H, h = row % H;
    float f[4], g[4];
    load_act<4>(x + t * x_s0 + h * x_s1 + e, f);
    load_act<4>(gate + t * g_s0 + h * g_s1 + e, g);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = f[i] / (1.0f + expf(-g[i]));
    store_act<4>(out + t * out_s0 + h * out_s1 + e, f);
  }
}
