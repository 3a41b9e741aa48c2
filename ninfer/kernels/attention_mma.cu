// Prefill attention on tensor cores (FlashAttention-2 shape): causal attention of new tokens over
// their sequence's paged K/V, bf16 activations, head_dim 64 or 128. Same inputs as the prefill of
// attention.cu:
//   q [T, Hq, D] (token stride q_stride), out [T, Hq, D] (token stride out_stride)
//   k_cache/v_cache [num_pages, page_size, Hkv, D]; block_tables [B, max_pages]
//   token t of sequence b is row t - cu_seqlens[b] of it, at position start[b] + that row, and sees
//   keys 0..its position.
// Grid (query tiles of 64 rows, B, Hq); 4 warps, warp w owns query rows 16 w .. 16 w + 15 of the tile.
// Keys go in tiles of 64 at absolute positions (0, 64, 128, ...): K and V^T of a tile in shared
// memory, S = Q K^T by mma.m16n8k16 (Q as A from registers, K as B), an online softmax per row in
// the base-2 domain, O += P V by mma (P re-packed from S's accumulators as the A operand, V^T as B).
// A row's result depends only on its own position and the keys (fixed tiles, fixed mma order, masked
// keys add exact zeros), so it does not depend on the other rows, the chunking or the batch.
#include "common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=64|128"
#endif
#ifndef GQA
#error "compile with -DGQA=<query heads per kv head>"
#endif
#if ACT_F32
#error "attention_mma takes bf16 activations only"
#endif
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");

#define QT 64                       // query rows per block
#define KT 64                       // keys per tile
#define D HEAD_DIM
#define KS (D + 8)                  // K tile row stride (bf16), padded against bank conflicts
#define VS (KT + 8)                 // V^T tile row stride (bf16)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 ld32(const act* p) { return *(const u32*)p; }

extern "C" __global__ void __launch_bounds__(128)
attention_prefill_mma(const act* __restrict__ q, i64 q_stride, const act* __restrict__ k_cache,
                      const act* __restrict__ v_cache, const i32* __restrict__ block_tables, int max_pages,
                      const i32* __restrict__ cu_seqlens, const i32* __restrict__ start, act* __restrict__ out,
                      i64 out_stride, int Hkv, int page_size, float scale) {
  PDL_ENTRY();
  __shared__ __align__(16) u16 ks[KT * KS];
  __shared__ __align__(16) u16 vts[D * VS];
  const int b = blockIdx.y, h = blockIdx.z, hk = h / GQA;
  const int row0 = cu_seqlens[b], n = cu_seqlens[b + 1] - row0;
  const int q0 = blockIdx.x * QT;
  if (q0 >= n) return;
  const int pos0 = start[b];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int last = min(q0 + QT, n) - 1;  // the tile's last valid row
  // this thread's two rows (g and g + 8 of the warp's 16); rows past n compute as the last row, never stored
  const int ra = min(q0 + warp * 16 + g, last), rb = min(q0 + warp * 16 + g + 8, last);
  const int pa = pos0 + ra, pb = pos0 + rb;
  const float sl2 = scale * LOG2E;

  // Q fragments: k-step s covers dims 16 s .. 16 s + 15
  u32 qf[D / 16][4];
  {
    const act* qa = q + (i64)(row0 + ra) * q_stride + h * D;
    const act* qb = q + (i64)(row0 + rb) * q_stride + h * D;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      qf[s][0] = ld32(qa + 16 * s + 2 * t);
      qf[s][1] = ld32(qb + 16 * s + 2 * t);
      qf[s][2] = ld32(qa + 16 * s + 2 * t + 8);
      qf[s][3] = ld32(qb + 16 * s + 2 * t + 8);
    }
  }
  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;  // running max (base 2) and this thread's part of the sum

  const int n_keys = pos0 + last + 1;
  const i32* table = block_tables + (i64)b * max_pages;
  for (int k0 = 0; k0 < n_keys; k0 += KT) {
    __syncthreads();  // the previous tile is no longer read
    // K tile [KT][D] and V^T [D][KT]: thread i loads 16-byte pieces; keys past n_keys are zeros
    for (int i = threadIdx.x; i < KT * (D / 8); i += 128) {
      const int kk = i / (D / 8), c = (i % (D / 8)) * 8, key = k0 + kk;
      uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
      if (key < n_keys) {
        const i64 slot = (i64)table[key / page_size] * page_size + key % page_size;
        const i64 off = (slot * Hkv + hk) * D + c;
        kv = *(const uint4*)(k_cache + off);
        vv = *(const uint4*)(v_cache + off);
      }
      *(uint4*)(ks + kk * KS + c) = kv;
      const u32 w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        vts[(c + 2 * j) * VS + kk] = (u16)(w[j] & 0xffffu);
        vts[(c + 2 * j + 1) * VS + kk] = (u16)(w[j] >> 16);
      }
    }
    __syncthreads();

    // S = Q K^T for the warp's 16 rows x KT keys: n-tile j = keys 8 j .. 8 j + 7
    float s[KT / 8][4];
#pragma unroll
    for (int j = 0; j < KT / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      const u16* kr = ks + (8 * j + g) * KS + 2 * t;
#pragma unroll
      for (int st = 0; st < D / 16; ++st)
        mma16816(s[j], qf[st][0], qf[st][1], qf[st][2], qf[st][3], *(const u32*)(kr + 16 * st),
                 *(const u32*)(kr + 16 * st + 8));
    }
    // scale into base 2, mask keys past each row's position, row maxima (a quad holds a row)
    float mxa = NEG_INF, mxb = NEG_INF;
#pragma unroll
    for (int j = 0; j < KT / 8; ++j) {
      const int key = k0 + 8 * j + 2 * t;
      s[j][0] = key <= pa ? s[j][0] * sl2 : NEG_INF;
      s[j][1] = key + 1 <= pa ? s[j][1] * sl2 : NEG_INF;
      s[j][2] = key <= pb ? s[j][2] * sl2 : NEG_INF;
      s[j][3] = key + 1 <= pb ? s[j][3] * sl2 : NEG_INF;
      mxa = fmaxf(mxa, fmaxf(s[j][0], s[j][1]));
      mxb = fmaxf(mxb, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
      mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, x));
      mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, x));
    }
    const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);  // finite: key 0 <= every position
    const float ca = exp2f(ma - na), cb = exp2f(mb - nb);   // ma == -inf on the first tile: 0
    ma = na;
    mb = nb;
    la *= ca;
    lb *= cb;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d][0] *= ca; o[d][1] *= ca;
      o[d][2] *= cb; o[d][3] *= cb;
    }
    // P = exp2(S - m) as bf16 A fragments, O += P V^T-tiles; key step u = n-tiles 2 u, 2 u + 1
#pragma unroll
    for (int u = 0; u < KT / 16; ++u) {
      float p[8];
      p[0] = exp2f(s[2 * u][0] - na); p[1] = exp2f(s[2 * u][1] - na);
      p[2] = exp2f(s[2 * u][2] - nb); p[3] = exp2f(s[2 * u][3] - nb);
      p[4] = exp2f(s[2 * u + 1][0] - na); p[5] = exp2f(s[2 * u + 1][1] - na);
      p[6] = exp2f(s[2 * u + 1][2] - nb); p[7] = exp2f(s[2 * u + 1][3] - nb);
      const u32 a0 = pack_bf16x2(p[0], p[1]), a1 = pack_bf16x2(p[2], p[3]);
      const u32 a2 = pack_bf16x2(p[4], p[5]), a3 = pack_bf16x2(p[6], p[7]);
      // the sum uses the rounded probabilities the mma multiplies
      la += bf16_lo(a0) + bf16_hi(a0) + bf16_lo(a2) + bf16_hi(a2);
      lb += bf16_lo(a1) + bf16_hi(a1) + bf16_lo(a3) + bf16_hi(a3);
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const u16* vr = vts + (8 * d + g) * VS + 16 * u + 2 * t;
        mma16816(o[d], a0, a1, a2, a3, *(const u32*)vr, *(const u32*)(vr + 8));
      }
    }
  }
#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    la += __shfl_xor_sync(0xffffffffu, la, x);
    lb += __shfl_xor_sync(0xffffffffu, lb, x);
  }
  const float ia = 1.0f / la, ib = 1.0f / lb;
  const int wa = q0 + warp * 16 + g, wb = wa + 8;  // rows as owned (ra/rb clamp them)
  act* oa = out + (i64)(row0 + wa) * out_stride + h * D + 2 * t;
  act* ob = out + (i64)(row0 + wb) * out_stride + h * D + 2 * t;
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
    if (wa < n) *(u32*)(oa + 8 * d) = pack_bf16x2(o[d][0] * ia, o[d][1] * ia);
    if (wb < n) *(u32*)(ob + 8 * d) = pack_bf16x2(o[d][2] * ib, o[d][3] * ib);
  }
}
