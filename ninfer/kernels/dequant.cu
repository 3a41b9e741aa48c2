// Expand groupwise int8 / int4 weights into the activation dtype for the prompt route's matmuls:
// out [N, K] = w exactly as quant.dequantize computes it (fp32 q * s, then + m, each rounded, then
// rounded to the activation dtype). One thread per 32-wide chunk of a row (group sizes are multiples
// of 32, so a chunk has one scale).
//   DQ_FMT 1 int8: w [N, K] int8; 2 int4 sym: w [N, K/2] uint8, (q - 8) * s; 3 int4 asym: q * s + m
//   DQ_WIDE 1: rows interleaved as the mma gemv reads them (launchers.gemv_pack: in each 64-byte
//   block, word t of chunk i sits at 16 t + 4 i; chunks of 32 int4 or 16 int8)
//   DQ_WIDE 2: int4 tiles and reordered scales / mins as the tiled gemv reads them (gemv_tiled.cu)
#include "common.cuh"

#ifndef DQ_FMT
#error "compile with -DDQ_FMT=1|2|3"
#endif
#ifndef DQ_WIDE
#define DQ_WIDE 0
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
#if DQ_WIDE == 2
  // tile T = n / 16, row 8 h + r of it; slab j = c / 2, chunk c % 2 of it (gemv_tiled.cu's layout)
  const i64 T = n >> 4;
  const int h = (int)(n >> 3) & 1, r = (int)n & 7, E = group_size == 32 ? 2 : 1, grp = k0 / group_size;
  const i64 g = ((T * (K / group_size / E) + grp / E) * 8 + r) * 2 * E + 2 * (grp % E) + h;
#else
  const i64 g = n * (K / group_size) + k0 / group_size;
#endif
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
#if DQ_WIDE == 2
  const u8* blk = w + (T * (K / 64) + c / 2) * 512 + 64 * r + 4 * (2 * (c % 2) + h);  // word t at + 16 t
#pragma unroll
  for (int t = 0; t < 4; ++t) words[t] = *(const u32*)(blk + 16 * t);
#elif DQ_WIDE
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
#if DQ_WIDE == 2
    const int nib = ((j & 7) >> 1) + 4 * (j & 1);  // element e of a word sits in nibble e / 2 + 4 (e % 2)
#else
    const int nib = j & 7;
#endif
    float q = (float)((words[j >> 3] >> (nib * 4)) & 0xfu);
    if (DQ_FMT == 2) q -= 8.0f;
    v[j] = __fmul_rn(q, s);
    if (DQ_FMT == 3) v[j] = __fadd_rn(v[j], m);
  }
#endif
  act* o = out + n * K + k0;
#if ACT_F32
#pragma unroll
  for (int j = 0; j < 32; j += 4) {
    float4 f;
    f.x = v[j]; f.y = v[j + 1]; f.z = v[j + 2]; f.w = v[j + 3];
    *(float4*)(o + j) = f;
  }
#else
#pragma unroll
  for (int j = 0; j < 32; j += 8) *(uint4*)(o + j) = pack8(v + j);
#endif
}
