// llama.cpp block formats read as stored (ninfer/engine/quant_blocks.py documents every layout):
// a weight [N, K] is N rows of K/QK blocks of BLK_BYTES bytes, read in place. Every format splits
// into chunks of 32 consecutive elements (one Q4_K/Q5_K/IQ4_XS sub-block, a Q5_0/Q5_1/IQ4_NL block,
// two 16-element sub-blocks of Q6_K/Q2_K/Q3_K); a chunk decodes into 32 codes q and, per half of 16,
// a scale s and an offset o with w = s * q + o, the same products as gguf-py's reference.
//
//   gemv_blocks:    y[M, N] = x[M, K] @ W^T for M = 1..8 (decode). One warp per output column n;
//                   lane l takes chunks l, l + 32, ... of row n (a warp streams 32 consecutive chunks),
//                   sums s * (q . x) + o * sum(x) per half in fp32 in chunk order, then a fixed
//                   butterfly: row m's result does not depend on M (batch invariance).
//   dequant_blocks: out[r, :] = W[rows[r], :] (rows null: r) as activations, one thread per chunk
//                   (prefill: expand, then cuBLAS; the embedding gather).
// Format codes (compile-time -DBLK_FMT=..., one module per format): 0 q4_k, 1 q5_k, 2 q6_k, 3 q2_k,
// 4 q3_k, 5 q5_0, 6 q5_1, 7 iq4_nl, 8 iq4_xs. Blocks are only as aligned as their size allows
// (q6_k, q3_k, q5_0, iq4_nl: 2 bytes; q2_k: 4; q5_1, iq4_xs: 8; q4_k, q5_k: 16): loads are that wide.
#include "common.cuh"

#ifndef BLK_FMT
#error "compile with -DBLK_FMT=0..8"
#endif

#define GEMV_WARPS 8

#if BLK_FMT == 0
#define QK 256
#define BLK_BYTES 144
#define BLK_ALIGN 16
#elif BLK_FMT == 1
#define QK 256
#define BLK_BYTES 176
#define BLK_ALIGN 16
#elif BLK_FMT == 2
#define QK 256
#define BLK_BYTES 210
#define BLK_ALIGN 2
#elif BLK_FMT == 3
#define QK 256
#define BLK_BYTES 84
#define BLK_ALIGN 4
#elif BLK_FMT == 4
#define QK 256
#define BLK_BYTES 110
#define BLK_ALIGN 2
#elif BLK_FMT == 5
#define QK 32
#define BLK_BYTES 22
#define BLK_ALIGN 2
#elif BLK_FMT == 6
#define QK 32
#define BLK_BYTES 24
#define BLK_ALIGN 8
#elif BLK_FMT == 7
#define QK 32
#define BLK_BYTES 18
#define BLK_ALIGN 2
#elif BLK_FMT == 8
#define QK 256
#define BLK_BYTES 136
#define BLK_ALIGN 8
#else
#error "unknown BLK_FMT"
#endif

// Formats whose halves carry an offset (a min) besides the scale.
#define HAS_OFFSET (BLK_FMT == 0 || BLK_FMT == 1 || BLK_FMT == 3 || BLK_FMT == 6)

// A little-endian 32-bit word at p (p aligned to BLK_ALIGN, and offsets within a block keep it so).
__device__ __forceinline__ u32 ld32(const u8* p) {
#if BLK_ALIGN >= 4
  return *(const u32*)p;
#else
  return (u32)(*(const u16*)p) | ((u32)(*(const u16*)(p + 2)) << 16);
#endif
}

// 8 consecutive words (32 bytes) at p.
__device__ __forceinline__ void ld256(const u8* p, u32* w) {
#if BLK_ALIGN >= 16
  const uint4 a = *(const uint4*)p, b = *(const uint4*)(p + 16);
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
#elif BLK_ALIGN >= 8
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint2 v = *(const uint2*)(p + 8 * i);
    w[2 * i] = v.x; w[2 * i + 1] = v.y;
  }
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = ld32(p + 4 * i);
#endif
}

__device__ __forceinline__ float f16_lo(u32 w) { return f16_to_f32((u16)(w & 0xffffu)); }
__device__ __forceinline__ float f16_hi(u32 w) { return f16_to_f32((u16)(w >> 16)); }
__device__ __forceinline__ u32 byte_of(u32 w, int i) { return (w >> (8 * i)) & 0xffu; }
// A small non-negative integer as a float without an int-to-float conversion: 2^23 + v, minus 2^23.
__device__ __forceinline__ float small_u(u32 v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }

__constant__ float KVALUES[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                  1.f, 13.f, 25.f, 38.f, 53.f, 69.f, 89.f, 113.f};

struct Chunk {
  float q[32];
  float s[2];  // scale of elements 0..15, 16..31
  float o[2];  // offset of each half (0 where the format has none)
};

// 16-element nibbles of 4 words: element j of 32 is byte (j % 16)'s low (j < 16) or high nibble.
__device__ __forceinline__ void nibbles_lohi(const u32* w, float* q, float bias) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(w[j >> 2], j & 3);
    q[j] = small_u(b & 15u) - bias;
    q[j + 16] = small_u(b >> 4) - bias;
  }
}

// q4_k / q5_k's 6-bit scale and min of sub-block j from the 12 scale bytes (words s0, s1, s2).
__device__ __forceinline__ void k_scale_min(u32 s0, u32 s1, u32 s2, int j, float& sc, float& m) {
  if (j < 4) {
    sc = small_u(byte_of(s0, j) & 63u);
    m = small_u(byte_of(s1, j) & 63u);
  } else {
    sc = small_u((byte_of(s2, j - 4) & 15u) | ((byte_of(s0, j - 4) >> 6) << 4));
    m = small_u((byte_of(s2, j - 4) >> 4) | ((byte_of(s1, j - 4) >> 6) << 4));
  }
}

// Chunk c (0 .. K/32 - 1) of a row starting at `row`.
__device__ __forceinline__ void load_chunk(const u8* __restrict__ row, int c, Chunk& ch) {
  constexpr int CPB = QK / 32;  // chunks per block
  const u8* blk = row + (i64)(c / CPB) * BLK_BYTES;
  const int j = c % CPB;
  (void)j;  // unused where a block is one chunk
  ch.o[0] = ch.o[1] = 0.0f;
#if BLK_FMT == 0 || BLK_FMT == 1
  const u32 dd = ld32(blk);
  float sc, m;
  k_scale_min(ld32(blk + 4), ld32(blk + 8), ld32(blk + 12), j, sc, m);
  u32 w[8];
  ld256(blk + (BLK_FMT == 1 ? 48 : 16) + 32 * (j >> 1), w);
  const int shift = 4 * (j & 1);
#if BLK_FMT == 1
  u32 h[8];
  ld256(blk + 16, h);
#endif
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    u32 v = (byte_of(w[l >> 2], l & 3) >> shift) & 15u;
#if BLK_FMT == 1
    v |= ((byte_of(h[l >> 2], l & 3) >> j) & 1u) << 4;
#endif
    ch.q[l] = small_u(v);
  }
  ch.s[0] = ch.s[1] = f16_lo(dd) * sc;
  ch.o[0] = ch.o[1] = -(f16_hi(dd) * m);
#elif BLK_FMT == 2
  // q6_k: h = j / 4, quarter t = j % 4: ql[64h + 32(t%2) + l] >> 4(t/2), qh[32h + l] >> 2t
  const int h = j >> 2, t = j & 3;
  u32 wl[8], wh[8];
  ld256(blk + 64 * h + 32 * (t & 1), wl);
  ld256(blk + 128 + 32 * h, wh);
  const int sl = 4 * (t >> 1), sh = 2 * t;
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const u32 v = ((byte_of(wl[l >> 2], l & 3) >> sl) & 15u) | (((byte_of(wh[l >> 2], l & 3) >> sh) & 3u) << 4);
    ch.q[l] = small_u(v) - 32.0f;
  }
  const float d = f16_lo((u32)(*(const u16*)(blk + 208)));
  const int si = 8 * h + 2 * t;
  ch.s[0] = d * (float)(i8)blk[192 + si];
  ch.s[1] = d * (float)(i8)blk[192 + si + 1];
#elif BLK_FMT == 3
  // q2_k: h = j / 4, t = j % 4: qs[32h + l] >> 2t; scale bytes 8h + 2t (+1)
  const int h = j >> 2, t = j & 3;
  u32 w[8];
  ld256(blk + 16 + 32 * h, w);
#pragma unroll
  for (int l = 0; l < 32; ++l) ch.q[l] = small_u((byte_of(w[l >> 2], l & 3) >> (2 * t)) & 3u);
  const u32 dd = ld32(blk + 80);
  const float d = f16_lo(dd), dmin = f16_hi(dd);
  const u32 sw = ld32(blk + 8 * h + 2 * t - ((2 * t) & 3));  // the word holding scale bytes 8h+2t, +1
  const int sb = (2 * t) & 3;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const u32 s = byte_of(sw, sb + k);
    ch.s[k] = d * small_u(s & 15u);
    ch.o[k] = -(dmin * small_u(s >> 4));
  }
#elif BLK_FMT == 4
  // q3_k: h = j / 4, t = j % 4: ql = qs[32h + l] >> 2t & 3, high bit hmask[l] >> j; sc3(8h + 2t (+1))
  const int h = j >> 2, t = j & 3;
  u32 w[8], hm[8];
  ld256(blk + 32 + 32 * h, w);
  ld256(blk, hm);
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const u32 lo = (byte_of(w[l >> 2], l & 3) >> (2 * t)) & 3u;
    const u32 hb = (byte_of(hm[l >> 2], l & 3) >> j) & 1u;
    ch.q[l] = small_u(lo) - (hb ? 0.0f : 4.0f);
  }
  const float d = f16_lo((u32)(*(const u16*)(blk + 108)));
  const u32 a0 = ld32(blk + 96), a1 = ld32(blk + 100), a2 = ld32(blk + 104);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = 8 * h + 2 * t + k;
    const u32 lowb = byte_of((i & 7) < 4 ? a0 : a1, i & 3);
    const u32 low = (lowb >> (4 * (i >> 3))) & 15u;
    const u32 high = (byte_of(a2, i & 3) >> (2 * (i >> 2))) & 3u;
    ch.s[k] = d * (small_u(low | (high << 4)) - 32.0f);
  }
#elif BLK_FMT == 5 || BLK_FMT == 6
  // q5_0: d@0 qh@2 qs@6; q5_1: d@0 m@2 qh@4 qs@8
  constexpr int OFF = BLK_FMT == 6 ? 4 : 2;
  const u32 qh = ld32(blk + OFF);
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = ld32(blk + OFF + 4 + 4 * i);
#pragma unroll
  for (int l = 0; l < 16; ++l) {
    const u32 b = byte_of(w[l >> 2], l & 3);
    ch.q[l] = small_u((b & 15u) | (((qh >> l) & 1u) << 4));
    ch.q[l + 16] = small_u((b >> 4) | (((qh >> (l + 16)) & 1u) << 4));
  }
  const u32 dd = ld32(blk);
#if BLK_FMT == 5
#pragma unroll
  for (int l = 0; l < 32; ++l) ch.q[l] -= 16.0f;
  ch.s[0] = ch.s[1] = f16_lo(dd);
#else
  ch.s[0] = ch.s[1] = f16_lo(dd);
  ch.o[0] = ch.o[1] = f16_hi(dd);
#endif
#elif BLK_FMT == 7
  // iq4_nl: d@0 qs@2
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = ld32(blk + 2 + 4 * i);
#pragma unroll
  for (int l = 0; l < 16; ++l) {
    const u32 b = byte_of(w[l >> 2], l & 3);
    ch.q[l] = KVALUES[b & 15u];
    ch.q[l + 16] = KVALUES[b >> 4];
  }
  ch.s[0] = ch.s[1] = f16_lo((u32)(*(const u16*)blk));
#elif BLK_FMT == 8
  // iq4_xs: d@0 scales_h@2 scales_l@4 qs@8; sub-block j's 16 bytes at 8 + 16j
  const u32 w0 = ld32(blk), sl = ld32(blk + 4);
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = ld32(blk + 8 + 16 * j + 4 * i);
#pragma unroll
  for (int l = 0; l < 16; ++l) {
    const u32 b = byte_of(w[l >> 2], l & 3);
    ch.q[l] = KVALUES[b & 15u];
    ch.q[l + 16] = KVALUES[b >> 4];
  }
  const u32 ls = ((byte_of(sl, j >> 1) >> (4 * (j & 1))) & 15u) | (((w0 >> (16 + 2 * j)) & 3u) << 4);
  ch.s[0] = ch.s[1] = f16_lo(w0) * (small_u(ls) - 32.0f);
#endif
}

template <int M>
__device__ __forceinline__ void gemv_blocks_impl(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w,
                                                 void* __restrict__ y, i64 y_stride, int N, int K, int y_f32) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  const u8* row = w + (i64)n * (K / QK) * BLK_BYTES;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  const int chunks = K / 32;
  for (int c = lane; c < chunks; c += 32) {
    Chunk ch;
    load_chunk(row, c, ch);
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float xf[16];
        load_act<8>(x + m * x_stride + c * 32 + half * 16, xf);
        load_act<8>(x + m * x_stride + c * 32 + half * 16 + 8, xf + 8);
        float dot = 0.0f, xsum = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          dot = fmaf(ch.q[half * 16 + j], xf[j], dot);
          if (HAS_OFFSET) xsum += xf[j];
        }
        acc[m] = fmaf(dot, ch.s[half], acc[m]);
        if (HAS_OFFSET) acc[m] = fmaf(xsum, ch.o[half], acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float r = warp_sum(acc[m]);
    if (lane == 0) {
      if (y_f32) ((float*)y)[m * y_stride + n] = r;
      else ((act*)y)[m * y_stride + n] = to_act(r);
    }
  }
}

// Grid: ceil(N / GEMV_WARPS) blocks of GEMV_WARPS * 32 threads.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_blocks(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, void* __restrict__ y, i64 y_stride,
            int M, int N, int K, int y_f32) {
  switch (M) {
#define GEMV_CASE(MM) \
    case MM: gemv_blocks_impl<MM>(x, x_stride, w, y, y_stride, N, K, y_f32); break;
    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#undef GEMV_CASE
    default: break;
  }
}

// out [R, K] (row stride out_stride) = rows of W; rows [R] int32 or null (row r = W row r). One
// thread per chunk: grid ceil(R * K / 32 / 256) blocks of 256 threads. w = fmaf(s, q, o), rounded
// once to the activation dtype.
extern "C" __global__ void __launch_bounds__(256)
dequant_blocks(const u8* __restrict__ w, const i32* __restrict__ rows, act* __restrict__ out, i64 out_stride,
               int R, int N, int K) {
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K / 32;
  if (idx >= (i64)R * chunks) return;
  const int r = (int)(idx / chunks), c = (int)(idx % chunks);
  int src = rows ? rows[r] : r;
  if (src < 0 || src >= N) src = 0;  // out-of-range ids read row 0 rather than stray memory
  Chunk ch;
  load_chunk(w + (i64)src * (K / QK) * BLK_BYTES, c, ch);
  float f[32];
#pragma unroll
  for (int l = 0; l < 32; ++l) f[l] = fmaf(ch.s[l >> 4], ch.q[l], ch.o[l >> 4]);
  act* o = out + (i64)r * out_stride + c * 32;
#pragma unroll
  for (int l = 0; l < 32; l += 8) store_act<8>(o + l, f + l);
}
