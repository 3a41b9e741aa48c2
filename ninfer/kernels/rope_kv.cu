// RoPE (Hugging Face rotate_half convention) fused with the paged-KV write, with optional
// per-head q/k RMSNorm before the rotation (qwen3).
//   q [T, Hq, D], k/v [T, Hkv, D] act (bf16, or fp32 with ACT_F32); rows may be views of a fused qkv buffer (row strides
//   given; head stride D, element stride 1).
//   cos/sin [max_pos, R/2] fp32; positions [T] int32. Only the first R (rotary_dim, R <= D, R % 4 == 0)
//   dims of a head rotate (partial rotary, qwen3.5); dims R..D-1 pass through (normed, if q/k norms).
//   R == D is plain RoPE.
//   k_cache/v_cache [num_pages, page_size, Hkv, D] act; q_norm/k_norm [D] act; slot_mapping [T] int32, slot =
//   page * page_size + pos % page_size; a negative slot skips the cache write (padding).
// q is rotated in place; rotated k and v go to the cache only.
// Grid: T blocks; each warp takes whole heads (q heads, then k heads, then v heads).
#include "common.cuh"

extern "C" __global__ void rope_kv_write(act* q, const act* __restrict__ k, const act* __restrict__ v,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         const i32* __restrict__ positions, const i32* __restrict__ slot_mapping,
                                         act* __restrict__ k_cache, act* __restrict__ v_cache,
                                         const act* __restrict__ q_norm, const act* __restrict__ k_norm,
                                         int Hq, int Hkv, int D, int R, i64 q_stride, i64 k_stride,
                                         i64 v_stride, float eps) {
  PDL_ENTRY();
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int half = R / 2;
  const int pos = positions[t];
  const i32 slot = slot_mapping[t];
  const float* cr = cos_t + (i64)pos * half;
  const float* sr = sin_t + (i64)pos * half;
  for (int h = warp; h < Hq + 2 * Hkv; h += nwarps) {
    if (h >= Hq + Hkv) {  // v: plain copy into the cache, two activations a lane
      if (slot < 0) continue;
      const int hv = h - Hq - Hkv;
      const act* src = v + t * v_stride + (i64)hv * D;
      act* dst = v_cache + ((i64)slot * Hkv + hv) * D;
      for (int j = lane * 2; j < D; j += 2 * WARP) {
        float f[2];
        load_act<2>(src + j, f);
        store_act<2>(dst + j, f);
      }
      continue;
    }
    const bool is_q = h < Hq;
    if (!is_q && slot < 0) continue;
    const int hh = is_q ? h : h - Hq;
    const act* src = is_q ? q + t * q_stride + (i64)hh * D : k + t * k_stride + (i64)hh * D;
    act* dst = is_q ? q + t * q_stride + (i64)hh * D : k_cache + ((i64)slot * Hkv + hh) * D;
    const act* nw = is_q ? q_norm : k_norm;
    float inv = 1.0f;
    if (nw) {  // per-head RMSNorm over D, fp32, fixed lane order
      float ss = 0.0f;
      for (int j = lane * 2; j < D; j += 2 * WARP) {
        float f[2];
        load_act<2>(src + j, f);
        ss += f[0] * f[0] + f[1] * f[1];
      }
      inv = rsqrtf(warp_sum(ss) / (float)D + eps);
    }
    // A lane owns pairs (j, j+1) of the first half and (j+half, j+1+half) of the second:
    // out[i] = x[i] cos[i] - x[i+half] sin[i];  out[i+half] = x[i+half] cos[i] + x[i] sin[i].
    // All reads of a lane's elements happen before its writes, so rotating q in place is safe.
    for (int j = lane * 2; j < half; j += 2 * WARP) {
      float x[2], y[2];
      load_act<2>(src + j, x);
      load_act<2>(src + j + half, y);
      x[0] *= inv; x[1] *= inv; y[0] *= inv; y[1] *= inv;
      if (nw) {
        float wl[2], wh[2];
        load_act<2>(nw + j, wl);
        load_act<2>(nw + j + half, wh);
        x[0] *= wl[0]; x[1] *= wl[1];
        y[0] *= wh[0]; y[1] *= wh[1];
      }
      const float c0 = cr[j], c1 = cr[j + 1], s0 = sr[j], s1 = sr[j + 1];
      const float lo[2] = {rope_lo(x[0], y[0], c0, s0), rope_lo(x[1], y[1], c1, s1)};
      const float hi[2] = {rope_hi(x[0], y[0], c0, s0), rope_hi(x[1], y[1], c1, s1)};
      store_act<2>(dst + j, lo);
      store_act<2>(dst + j + half, hi);
    }
    for (int j = R + lane * 2; j < D; j += 2 * WARP) {  // the dims past rotary_dim: norm only
      float x[2];
      load_act<2>(src + j, x);
      x[0] *= inv; x[1] *= inv;
      if (nw) {
        float w[2];
        load_act<2>(nw + j, w);
        x[0] *= w[0]; x[1] *= w[1];
      }
      store_act<2>(dst + j, x);
    }
  }
}
