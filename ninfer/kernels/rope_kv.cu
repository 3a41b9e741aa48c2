// RoPE (Hugging Face rotate_half convention) fused with the paged-KV write, with optional
// per-head q/k RMSNorm before the rotation (qwen3).
//   q [T, Hq, D], k/v [T, Hkv, D] bf16; rows may be views of a fused qkv buffer (row strides
//   given; head stride D, element stride 1).
//   cos/sin [max_pos, D/2] fp32; positions [T] int32.
//   k_cache/v_cache [num_pages, page_size, Hkv, D] bf16; slot_mapping [T] int32, slot =
//   page * page_size + pos % page_size; a negative slot skips the cache write (padding).
// q is rotated in place; rotated k and v go to the cache only.
// Grid: T blocks; each warp takes whole heads (q heads, then k heads, then v heads).
#include "common.cuh"

extern "C" __global__ void rope_kv_write(u16* q, const u16* __restrict__ k, const u16* __restrict__ v,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         const i32* __restrict__ positions, const i32* __restrict__ slot_mapping,
                                         u16* __restrict__ k_cache, u16* __restrict__ v_cache,
                                         const u16* __restrict__ q_norm, const u16* __restrict__ k_norm,
                                         int Hq, int Hkv, int D, i64 q_stride, i64 k_stride, i64 v_stride,
                                         float eps) {
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int half = D / 2;
  const int pos = positions[t];
  const i32 slot = slot_mapping[t];
  const float* cr = cos_t + (i64)pos * half;
  const float* sr = sin_t + (i64)pos * half;
  for (int h = warp; h < Hq + 2 * Hkv; h += nwarps) {
    if (h >= Hq + Hkv) {  // v: plain copy into the cache, 4 bytes a lane
      if (slot < 0) continue;
      const int hv = h - Hq - Hkv;
      const u32* src = (const u32*)(v + t * v_stride + (i64)hv * D);
      u32* dst = (u32*)(v_cache + ((i64)slot * Hkv + hv) * D);
      for (int j = lane; j < half; j += WARP) dst[j] = src[j];
      continue;
    }
    const bool is_q = h < Hq;
    if (!is_q && slot < 0) continue;
    const int hh = is_q ? h : h - Hq;
    const u16* src = is_q ? q + t * q_stride + (i64)hh * D : k + t * k_stride + (i64)hh * D;
    u16* dst = is_q ? q + t * q_stride + (i64)hh * D : k_cache + ((i64)slot * Hkv + hh) * D;
    const u16* nw = is_q ? q_norm : k_norm;
    float inv = 1.0f;
    if (nw) {  // per-head RMSNorm over D, fp32, fixed lane order
      float ss = 0.0f;
      for (int j = lane * 2; j < D; j += 2 * WARP) {
        const u32 w2 = *(const u32*)(src + j);
        const float a = bf16_lo(w2), b = bf16_hi(w2);
        ss += a * a + b * b;
      }
      inv = rsqrtf(warp_sum(ss) / (float)D + eps);
    }
    // A lane owns pairs (j, j+1) of the first half and (j+half, j+1+half) of the second:
    // out[i] = x[i] cos[i] - x[i+half] sin[i];  out[i+half] = x[i+half] cos[i] + x[i] sin[i].
    // All reads of a lane's elements happen before its writes, so rotating q in place is safe.
    for (int j = lane * 2; j < half; j += 2 * WARP) {
      const u32 lo = *(const u32*)(src + j);
      const u32 hi = *(const u32*)(src + j + half);
      float x0 = bf16_lo(lo) * inv, x1 = bf16_hi(lo) * inv;
      float y0 = bf16_lo(hi) * inv, y1 = bf16_hi(hi) * inv;
      if (nw) {
        const u32 wl = *(const u32*)(nw + j);
        const u32 wh = *(const u32*)(nw + j + half);
        x0 *= bf16_lo(wl); x1 *= bf16_hi(wl);
        y0 *= bf16_lo(wh); y1 *= bf16_hi(wh);
      }
      const float c0 = cr[j], c1 = cr[j + 1], s0 = sr[j], s1 = sr[j + 1];
      *(u32*)(dst + j) = pack_bf16x2(x0 * c0 - y0 * s0, x1 * c1 - y1 * s1);
      *(u32*)(dst + j + half) = pack_bf16x2(y0 * c0 + x0 * s0, y1 * c1 + x1 * s1);
    }
  }
}
