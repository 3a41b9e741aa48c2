// Expand groupwise int8 / int4 weights into the activation dtype for the prompt route's matmuls:
// out [N, K] = w exactly as quant.dequantize computes it (fp32 q * s, then + m, each rounded, then
// rounded to the activation dtype). Group sizes are multiples of 32.
//   DQ_FMT 1 int8: w [N, K] int8; 2 int4 sym: w [N, K/2] uint8, (q - 8) * s; 3 int4 asym: q * s + m
// One kernel per layout (launchers.gemv_pack), each mapping threads so that a warp's loads and stores
// are contiguous runs (the expansion writes 2 bytes a weight, ~4x what it reads: stores dominate):
//   dequantize_plain: quant.py's rows; a thread per 8 consecutive k of a row (16-byte stores, a
//     warp's 512 contiguous bytes).
//   dequantize_mma: rows interleaved as the mma gemv reads them (in each 64-byte block, word t of
//     chunk i sits at 16 t + 4 i; chunks of 32 int4 or 16 int8); a thread per 32-k chunk.
//   dequantize_tiles: tiles and reordered scales / mins as the tiled gemv reads them
//     (gemv_tiled.cu), a warp per 512-byte slab: lane l = 4 r + t loads the slab's bytes
//     16 l .. 16 l + 15 (one coalesced load a warp), words 2 c + h: row 16 T + 8 h + r, int4
//     k = 64 j + 32 c + 8 t + e (element e in nibble e / 2 + 4 (e % 2)), stored as 4 runs of 8 (the
//     four lanes t of a row write 64 contiguous bytes); int8 k = 32 j + 8 t + 4 c + e (element e in
//     byte e / 2 + 2 (e % 2)), stored as 2 runs of 8.
#include "common.cuh"

#ifndef DQ_FMT
#error "compile with -DDQ_FMT=1|2|3"
#endif

// A stored code as quant.dequantize expands it: int8 q * s; int4 (q - 8) * s or q * s + m.
__device__ __forceinline__ float dq(u32 q, float s, float m) {
#if DQ_FMT == 1
  return __fmul_rn((float)(i8)(q & 0xffu), s);
#else
  const float v = __fmul_rn((float)(q & 0xfu) - (DQ_FMT == 2 ? 8.0f : 0.0f), s);
  return DQ_FMT == 3 ? __fadd_rn(v, m) : v;
#endif
}

// 8 values into the activation dtype at o (16-byte aligned): one 16-byte store (bf16) or two (fp32)
__device__ __forceinline__ void store8(act* o, const float* v) {
#if ACT_F32
  *(float4*)o = make_float4(v[0], v[1], v[2], v[3]);
  *(float4*)(o + 4) = make_float4(v[4], v[5], v[6], v[7]);
#else
  *(uint4*)o = pack8(v);
#endif
}

extern "C" __global__ void __launch_bounds__(256)
dequantize_plain(const u8* __restrict__ w, const u16* __restrict__ scales, const u16* __restrict__ mins,
                 act* __restrict__ out, int N, int K, int group_size) {
  PDL_ENTRY();
  const int per_row = K / 8;
  const i64 run = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (run >= (i64)N * per_row) return;
  const i64 n = run / per_row;
  const int k0 = (int)(run % per_row) * 8;
  const i64 g = n * (K / group_size) + k0 / group_size;
  const float s = f16_to_f32(scales[g]), m = DQ_FMT == 3 ? f16_to_f32(mins[g]) : 0.0f;
  float v[8];
#if DQ_FMT == 1
  const uint2 a = *(const uint2*)(w + n * K + k0);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = dq((e < 4 ? a.x : a.y) >> ((e & 3) * 8), s, m);
#else
  const u32 word = *(const u32*)(w + n * (K / 2) + k0 / 2);  // element e in nibble e
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = dq(word >> (4 * e), s, m);
#endif
  store8(out + n * K + k0, v);
}

extern "C" __global__ void __launch_bounds__(256)
dequantize_mma(const u8* __restrict__ w, const u16* __restrict__ scales, const u16* __restrict__ mins,
               act* __restrict__ out, int N, int K, int group_size) {
  PDL_ENTRY();
  const int per_row = K / 32;
  const i64 chunk = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (chunk >= (i64)N * per_row) return;
  const i64 n = chunk / per_row;
  const int c = (int)(chunk % per_row), k0 = c * 32;
  const i64 g = n * (K / group_size) + k0 / group_size;
  const float s = f16_to_f32(scales[g]), m = DQ_FMT == 3 ? f16_to_f32(mins[g]) : 0.0f;
  float v[32];
#if DQ_FMT == 1
  // 16-wide chunks j = 2c, 2c + 1: word t of chunk j at 64 (j / 4) + 16 t + 4 (j % 4)
  u32 words[8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = 2 * c + h;
    const u8* blk = w + n * K + (j / 4) * 64 + 4 * (j % 4);
#pragma unroll
    for (int t = 0; t < 4; ++t) words[4 * h + t] = *(const u32*)(blk + 16 * t);
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = dq(words[j >> 2] >> ((j & 3) * 8), s, m);
#else
  const u8* blk = w + n * (K / 2) + (c / 4) * 64 + 4 * (c % 4);
  u32 words[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) words[t] = *(const u32*)(blk + 16 * t);
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = dq(words[j >> 3] >> ((j & 7) * 4), s, m);
#endif
#pragma unroll
  for (int j = 0; j < 32; j += 8) store8(out + n * K + k0 + j, v + j);
}

extern "C" __global__ void __launch_bounds__(256)
dequantize_tiles(const u8* __restrict__ w, const u16* __restrict__ scales, const u16* __restrict__ mins,
                 act* __restrict__ out, int N, int K, int group_size) {
  PDL_ENTRY();
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3, S = K / (DQ_FMT == 1 ? 32 : 64);
  const i64 slab = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (slab >= (i64)(N >> 4) * S) return;
  const i64 T = slab / S;
  const int j = (int)(slab % S);
  const uint4 q4 = *(const uint4*)(w + slab * 512 + 16 * lane);
  const u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
#if DQ_FMT == 1
  const int grp = 32 * j / group_size;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float s = f16_to_f32(scales[((T * (K / group_size) + grp) * 8 + r) * 2 + h]);
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = dq(words[2 * (e >> 2) + h] >> (8 * (((e & 3) >> 1) + 2 * (e & 1))), s, 0.0f);
    store8(out + (16 * T + 8 * h + r) * K + 32 * j + 8 * t, v);
  }
#else
  const int E = group_size == 32 ? 2 : 1;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int grp = (64 * j + 32 * c) / group_size;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // the scale (and min) of row 16 T + 8 h + r, group grp: gemv_tiled.cu's reordering
      const i64 g = ((T * (K / group_size / E) + grp / E) * 8 + r) * 2 * E + 2 * (grp % E) + h;
      const float s = f16_to_f32(scales[g]), m = DQ_FMT == 3 ? f16_to_f32(mins[g]) : 0.0f;
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = dq(words[2 * c + h] >> (4 * ((e >> 1) + 4 * (e & 1))), s, m);
      store8(out + (16 * T + 8 * h + r) * K + 64 * j + 32 * c + 8 * t, v);
    }
  }
#endif
}
