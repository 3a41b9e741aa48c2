// Expand groupwise int8 / int4 weights into the activation dtype for the prompt route's matmuls:
// out [N, K] = w exactly as quant.dequantize computes it (fp32 q * s, then + m, each rounded, then
// rounded to the activation dtype). dequantize_rows: one thread per 32-wide chunk of a row (group
// sizes are multiples of 32, so a chunk has one scale).
//   DQ_FMT 1 int8: w [N, K] int8; 2 int4 sym: w [N, K/2] uint8, (q - 8) * s; 3 int4 asym: q * s + m
//   DQ_WIDE 1: rows interleaved as the mma gemv reads them (launchers.gemv_pack: in each 64-byte
//   block, word t of chunk i sits at 16 t + 4 i; chunks of 32 int4 or 16 int8)
// dequantize_tiles: int4 tiles and reordered scales / mins as the tiled gemv reads them
// (gemv_tiled.cu), one warp per 512-byte slab: lane l = 4 r + t loads the slab's bytes 16 l .. 16 l + 15
// (the warp's load one coalesced 512 bytes), words 2 c + h: row 16 T + 8 h + r, k = 64 j + 32 c + 8 t + e
// (element e in nibble e / 2 + 4 (e % 2)), and stores them as 4 runs of 8 (the four lanes t of a row
// write 64 contiguous bytes; dequantize_rows' thread a chunk read each sector in quarters and stored
// 16 bytes every 64).
#include "common.cuh"

#ifndef DQ_FMT
#error "compile with -DDQ_FMT=1|2|3"
#endif

// 8 values into the activation dtype at o (16-byte aligned): one 16-byte store (bf16) or two (fp32)
__device__ __forceinline__ void store8(act* o, const float* v) {
#if ACT_F32
  *(float4*)o = make_float4(v[0], v[1], v[2], v[3]);
  *(float4*)(o + 4) = make_float4(v[4], v[5], v[6], v[7]);
#else
  *(uint4*)o = pack8(v);
#endif
}
#ifndef DQ_WIDE
#define DQ_WIDE 0  // dequantize_rows: 0 plain rows, 1 the mma gemv's interleave
#endif

extern "C" __global__ void __launch_bounds__(256)
dequantize_rows(const u8* __restrict__ w, const u16* __restrict__ scales, const u16* __restrict__ mins,
                act* __restrict__ out, int N, int K, int group_size) {
  PDL_ENTRY();
  const int per_row = K / 32;
  const i64 chunk = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (chunk >= (i64)N * per_row) return;
  const i64 n = chunk / per_row;
  const int c = (int)(chunk % per_row), k0 = c * 32;
  const i64 g = n * (K / group_size) + k0 / group_size;
  const float s = f16_to_f32(scales[g]);
  float v[32];
#if DQ_FMT == 1
#if DQ_WIDE
  // 16-wide chunks j = 2c, 2c + 1: word t of chunk j at 64 (j / 4) + 16 t + 4 (j % 4)
  u32 words[8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = 2 * c + h;
    const u8* blk = w + n * K + (j / 4) * 64 + 4 * (j % 4);
#pragma unroll
    for (int t = 0; t < 4; ++t) words[4 * h + t] = *(const u32*)(blk + 16 * t);
  }
#else
  const uint4* p = (const uint4*)(w + n * K + k0);
  const uint4 a = p[0], b = p[1];
  const u32 words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#endif
#pragma unroll
  for (int j = 0; j < 32; ++j) v[j] = __fmul_rn((float)(i8)((words[j >> 2] >> ((j & 3) * 8)) & 0xffu), s);
#else
  const u8* row = w + n * (K / 2);
  u32 words[4];
#if DQ_WIDE
  const u8* blk = row + (c / 4) * 64 + 4 * (c % 4);
#pragma unroll
  for (int t = 0; t < 4; ++t) words[t] = *(const u32*)(blk + 16 * t);
#else
  const uint4 q4 = *(const uint4*)(row + c * 16);
  words[0] = q4.x; words[1] = q4.y; words[2] = q4.z; words[3] = q4.w;
#endif
  const float m = DQ_FMT == 3 ? f16_to_f32(mins[g]) : 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    float q = (float)((words[j >> 3] >> ((j & 7) * 4)) & 0xfu);
    if (DQ_FMT == 2) q -= 8.0f;
    v[j] = __fmul_rn(q, s);
    if (DQ_FMT == 3) v[j] = __fadd_rn(v[j], m);
  }
#endif
  act* o = out + n * K + k0;
#pragma unroll
  for (int j = 0; j < 32; j += 8) store8(o + j, v + j);
}

#if DQ_FMT != 1
extern "C" __global__ void __launch_bounds__(256)
dequantize_tiles(const u8* __restrict__ w, const u16* __restrict__ scales, const u16* __restrict__ mins,
                 act* __restrict__ out, int N, int K, int group_size) {
  PDL_ENTRY();
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3, S = K >> 6;
  const i64 slab = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (slab >= (i64)(N >> 4) * S) return;
  const i64 T = slab / S;
  const int j = (int)(slab % S), E = group_size == 32 ? 2 : 1;
  const uint4 q4 = *(const uint4*)(w + slab * 512 + 16 * lane);
  const u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
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
      for (int e = 0; e < 8; ++e) {
        float q = (float)((words[2 * c + h] >> (4 * ((e >> 1) + 4 * (e & 1)))) & 0xfu);
        if (DQ_FMT == 2) q -= 8.0f;
        v[e] = __fmul_rn(q, s);
        if (DQ_FMT == 3) v[e] = __fadd_rn(v[e], m);
      }
      store8(out + (16 * T + 8 * h + r) * K + 64 * j + 32 * c + 8 * t, v);
    }
  }
}
#endif
