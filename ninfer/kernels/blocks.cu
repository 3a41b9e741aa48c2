// llama.cpp block formats read as stored (ninfer/engine/quant_blocks.py documents every layout):
// a weight [N, K] is N rows of K/QK blocks of BLK_BYTES bytes, read in place. Every format splits
// into chunks of 32 consecutive elements (one Q4_K/Q5_K/IQ4_XS sub-block, a Q5_0/Q5_1/IQ4_NL block,
// two 16-element sub-blocks of Q6_K/Q2_K/Q3_K); a chunk decodes into 32 codes q and, per half of 16,
// a scale s and an offset o with w = s * q + o, the same products as gguf-py's reference.
//
//   gemv_blocks:    y[M, N] = x[M, K] @ W^T for M = 1..8 (decode). One warp per output column n;
//                   lane l takes chunks l, l + 32, ... of row n (a warp streams 32 consecutive chunks),
//                   sums s * (q . x) + o * sum(x) per half in fp32 in chunk order, then a fixed
//                   butterfly: row m's result does not depend on M (batch invariance). x is staged
//                   in shared memory as fp32 with per-half sums (computed once per block, not per column).
//   dequant_blocks: out[r, :] = W[rows[r], :] (rows null: r) as activations, one thread per chunk
//                   (prefill: expand, then cuBLAS; the embedding gather).
// Format codes (compile-time -DBLK_FMT=..., one module per format): 0 q4_k, 1 q5_k, 2 q6_k, 3 q2_k,
// 4 q3_k, 5 q5_0, 6 q5_1, 7 iq4_nl, 8 iq4_xs. Blocks are only as aligned as their size allows
// (q6_k, q3_k, q5_0, iq4_nl: 2 bytes; q2_k: 4; q5_1, iq4_xs: 8; q4_k, q5_k: 16): loads are that wide.
#include "common.cuh"
#if GEMV_HWOUT || GEMV_RSCALE
#error "GEMV_HWOUT and GEMV_RSCALE take gemv_tiled.cu"
#endif

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

// The four bytes of v (codes 0..255) as floats minus `bias`: one byte permute builds the float
// 2^23 + byte, one add takes 2^23 + bias off (exact: everything stays below 2^24).
__device__ __forceinline__ void bytes4(u32 v, float bias, float* q) {
  const float off = 8388608.0f + bias;
  q[0] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540)) - off;
  q[1] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7541)) - off;
  q[2] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7542)) - off;
  q[3] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7543)) - off;
}

// Bits 0..3 of b spread to bit `at` of bytes 0..3 (at <= 4).
__device__ __forceinline__ u32 spread4(u32 b, int at) { return ((b & 15u) * (0x00204081u << at)) & (0x01010101u << at); }

// The iq4 code book, looked up per byte in shared memory (16 floats in 16 banks: no conflicts).
__device__ __forceinline__ void table4(u32 v, const float* kv, float* q) {
  q[0] = kv[v & 15u]; q[1] = kv[(v >> 8) & 15u]; q[2] = kv[(v >> 16) & 15u]; q[3] = kv[v >> 24];
}

struct Chunk {
  float q[32];
  float s[2];  // scale of elements 0..15, 16..31
  float o[2];  // offset of each half (0 where the format has none)
};

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

// Codes are bytes: element value = s * (byte - BIAS) + o (iq4: s * KVALUES[byte] + o).
#if BLK_FMT == 2
#define BIAS 32
#elif BLK_FMT == 4
#define BIAS 4
#elif BLK_FMT == 5
#define BIAS 16
#else
#define BIAS 0
#endif
#define IQ4 (BLK_FMT == 7 || BLK_FMT == 8)

// Four consecutive elements e0 .. e0 + 3 (e0 % 4 == 0) of chunk c of a row: their codes as the
// bytes of `v`, and the scale and offset of their half (e0 / 16) of the chunk.
struct Quad {
  u32 v;
  float s, o;
};

__device__ __forceinline__ Quad load_quad(const u8* __restrict__ row, int c, int e0) {
  constexpr int CPB = QK / 32;  // chunks per block
  const u8* blk = row + (i64)(c / CPB) * BLK_BYTES;
  const int j = c % CPB;
  (void)j;  // unused where a block is one chunk
  const int half = e0 >> 4;
  (void)half;
  Quad r;
  r.o = 0.0f;
#if BLK_FMT == 0 || BLK_FMT == 1
  // element l: byte l of the 32 at qs + 32 (j / 2), nibble j % 2 (q5_k: bit j of qh[l] on top)
  const u32 dd = ld32(blk);
  float sc, m;
  k_scale_min(ld32(blk + 4), ld32(blk + 8), ld32(blk + 12), j, sc, m);
  r.v = (ld32(blk + (BLK_FMT == 1 ? 48 : 16) + 32 * (j >> 1) + e0) >> (4 * (j & 1))) & 0x0F0F0F0Fu;
#if BLK_FMT == 1
  r.v |= ((ld32(blk + 16 + e0) >> j) & 0x01010101u) << 4;
#endif
  r.s = f16_lo(dd) * sc;
  r.o = -(f16_hi(dd) * m);
#elif BLK_FMT == 2
  // q6_k: h = j / 4, quarter t = j % 4: ql[64h + 32(t%2) + l] >> 4(t/2), qh[32h + l] >> 2t; scale 8h + 2t + half
  const int h = j >> 2, t = j & 3;
  const u32 lo = (ld32(blk + 64 * h + 32 * (t & 1) + e0) >> (4 * (t >> 1))) & 0x0F0F0F0Fu;
  const u32 hi = (ld32(blk + 128 + 32 * h + e0) >> (2 * t)) & 0x03030303u;
  r.v = lo | (hi << 4);
  r.s = f16_lo((u32)(*(const u16*)(blk + 208))) * (float)(i8)blk[192 + 8 * h + 2 * t + half];
#elif BLK_FMT == 3
  // q2_k: h = j / 4, t = j % 4: qs[32h + l] >> 2t; scale byte 8h + 2t + half (low: scale, high: min)
  const int h = j >> 2, t = j & 3;
  r.v = (ld32(blk + 16 + 32 * h + e0) >> (2 * t)) & 0x03030303u;
  const u32 dd = ld32(blk + 80);
  const u32 sv = blk[8 * h + 2 * t + half];
  r.s = f16_lo(dd) * small_u(sv & 15u);
  r.o = -(f16_hi(dd) * small_u(sv >> 4));
#elif BLK_FMT == 4
  // q3_k: h = j / 4, t = j % 4: ql = qs[32h + l] >> 2t & 3, high bit hmask[l] >> j; code ql + 4 hb
  // (value code - 4); scale sc3(8h + 2t + half)
  const int h = j >> 2, t = j & 3;
  r.v = ((ld32(blk + 32 + 32 * h + e0) >> (2 * t)) & 0x03030303u) | (((ld32(blk + e0) >> j) & 0x01010101u) << 2);
  const int i = 8 * h + 2 * t + half;
  const u32 low = (blk[96 + (i & 7)] >> (4 * (i >> 3))) & 15u;
  const u32 high = (blk[104 + (i & 3)] >> (2 * (i >> 2))) & 3u;
  r.s = f16_lo((u32)(*(const u16*)(blk + 108))) * (small_u(low | (high << 4)) - 32.0f);
#elif BLK_FMT == 5 || BLK_FMT == 6
  // q5_0: d@0 qh@2 qs@6; q5_1: d@0 m@2 qh@4 qs@8. Element l < 16: low nibble of byte l, l >= 16:
  // high nibble of byte l - 16; bit l of qh on top.
  constexpr int OFF = BLK_FMT == 6 ? 4 : 2;
  r.v = ((ld32(blk + OFF + 4 + (e0 & 15)) >> (4 * half)) & 0x0F0F0F0Fu) | spread4(ld32(blk + OFF) >> e0, 4);
  const u32 dd = ld32(blk);
  r.s = f16_lo(dd);
#if BLK_FMT == 6
  r.o = f16_hi(dd);
#endif
#elif BLK_FMT == 7 || BLK_FMT == 8
  // iq4_nl: d@0 qs@2 (one block, one chunk); iq4_xs: d@0 scales_h@2 scales_l@4, sub-block j's
  // 16 bytes at 8 + 16j. Element l < 16: low nibble of byte l, l >= 16: high nibble of byte l - 16.
  const u8* qs = blk + (BLK_FMT == 7 ? 2 : 8 + 16 * j);
  r.v = (ld32(qs + (e0 & 15)) >> (4 * half)) & 0x0F0F0F0Fu;
#if BLK_FMT == 7
  r.s = f16_lo((u32)(*(const u16*)blk));
#else
  const u32 w0 = ld32(blk), sl = ld32(blk + 4);
  const u32 ls = ((byte_of(sl, j >> 1) >> (4 * (j & 1))) & 15u) | (((w0 >> (16 + 2 * j)) & 3u) << 4);
  r.s = f16_lo(w0) * (small_u(ls) - 32.0f);
#endif
#endif
  return r;
}

// A quad's codes as floats (code - BIAS, or the iq4 code book's value; kv: the code book).
__device__ __forceinline__ void quad_floats(u32 v, const float* kv, float* q) {
#if IQ4
  table4(v, kv, q);
#else
  bytes4(v, (float)BIAS, q);
#endif
}

// Chunk c (0 .. K/32 - 1) of a row starting at `row`, as 32 floats and a scale and offset per half.
__device__ __forceinline__ void load_chunk(const u8* __restrict__ row, int c, Chunk& ch, const float* kv) {
#pragma unroll
  for (int e0 = 0; e0 < 32; e0 += 4) {
    const Quad qd = load_quad(row, c, e0);
    quad_floats(qd.v, kv, ch.q + e0);
    ch.s[e0 >> 4] = qd.s;
    ch.o[e0 >> 4] = qd.o;
  }
}

__constant__ float KVALUES[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                  1.f, 13.f, 25.f, 38.f, 53.f, 69.f, 89.f, 113.f};
__device__ __forceinline__ void init_code_book(float* kv) {
  if (IQ4 && threadIdx.x < 16) kv[threadIdx.x] = KVALUES[threadIdx.x];
}

// The gemv stages x in shared memory as fp32, TILE chunks (of 32) at a time for all M rows, with
// each 16-element half's sum: a lane then reads its chunk's activations with four 16-byte loads
// per half (rows padded to XPAD floats: conflict-free) and the offsets need no sums of their own.
#define TILE 32
#define XPAD 36

template <int M>
__device__ __forceinline__ void gemv_blocks_impl(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w,
                                                 void* __restrict__ y, i64 y_stride, int N, int K, int y_f32,
                                                 float* xs, float* xsum, const float* kv) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  const bool active = n < N;
  const u8* row = w + (i64)(active ? n : 0) * (K / QK) * BLK_BYTES;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  const int chunks = K / 32;
  for (int c0 = 0; c0 < chunks; c0 += TILE) {
    // stage: task = (row m, half h of the tile's 2 * TILE halves): 16 activations, their sum
    __syncthreads();  // the previous tile is read
    for (int task = threadIdx.x; task < M * 2 * TILE; task += GEMV_WARPS * 32) {
      const int m = task / (2 * TILE), h = task % (2 * TILE);
      const int k = (c0 * 32) + h * 16;
      if (k < K) {
        float f[16];
        load_act<8>(x + m * x_stride + k, f);
        load_act<8>(x + m * x_stride + k + 8, f + 8);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) sum += f[i];
        float* dst = xs + (m * TILE + (h >> 1)) * XPAD + (h & 1) * 16;
#pragma unroll
        for (int i = 0; i < 16; i += 4) *(float4*)(dst + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
        xsum[m * 2 * TILE + h] = sum;
      }
    }
    __syncthreads();
    const int c = c0 + lane;
    if (active && c < chunks) {
      Chunk ch;
      load_chunk(row, c, ch, kv);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float* xr = xs + (m * TILE + lane) * XPAD;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < 16; i += 4) {
            const float4 v = *(const float4*)(xr + half * 16 + i);
            dot = fmaf(ch.q[half * 16 + i], v.x, dot);
            dot = fmaf(ch.q[half * 16 + i + 1], v.y, dot);
            dot = fmaf(ch.q[half * 16 + i + 2], v.z, dot);
            dot = fmaf(ch.q[half * 16 + i + 3], v.w, dot);
          }
          acc[m] = fmaf(dot, ch.s[half], acc[m]);
          if (HAS_OFFSET) acc[m] = fmaf(xsum[m * 2 * TILE + 2 * lane + half], ch.o[half], acc[m]);
        }
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float r = warp_sum(acc[m]);
    if (lane == 0) {
      if (y_f32) ((float*)y)[m * y_stride + n] = r;
      else ((act*)y)[m * y_stride + n] = to_act(r);
    }
  }
}

// Grid: ceil(N / GEMV_WARPS) blocks of GEMV_WARPS * 32 threads; dynamic shared memory
// (M * TILE * XPAD + M * 2 * TILE + 16) floats (M = 1: 4.9 KB, M = 8: 39 KB).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_blocks(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, void* __restrict__ y, i64 y_stride,
            int M, int N, int K, int y_f32) {
  PDL_ENTRY();
  extern __shared__ __align__(16) float smem[];
  float* xs = smem;
  float* xsum = xs + M * TILE * XPAD;
  float* kv = xsum + M * 2 * TILE;
  init_code_book(kv);  // made visible by the first tile's barrier
  switch (M) {
#define GEMV_CASE(MM) \
    case MM: gemv_blocks_impl<MM>(x, x_stride, w, y, y_stride, N, K, y_f32, xs, xsum, kv); break;
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
  PDL_ENTRY();
  __shared__ float kv[16];
  init_code_book(kv);
  if (IQ4) __syncthreads();
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int chunks = K / 32;
  if (idx >= (i64)R * chunks) return;
  const int r = (int)(idx / chunks), c = (int)(idx % chunks);
  int src = rows ? rows[r] : r;
  if (src < 0 || src >= N) src = 0;  // out-of-range ids read row 0 rather than stray memory
  Chunk ch;
  load_chunk(w + (i64)src * (K / QK) * BLK_BYTES, c, ch, kv);
  float f[32];
#pragma unroll
  for (int l = 0; l < 32; ++l) f[l] = fmaf(ch.s[l >> 4], ch.q[l], ch.o[l >> 4]);
  act* o = out + (i64)r * out_stride + c * 32;
#pragma unroll
  for (int l = 0; l < 32; l += 8) store_act<8>(o + l, f + l);
}

#if !ACT_F32
// ---- gemv_blocks_mma: the same product on tensor cores (bf16 activations) ----------------------------
// One block of MMA_WARPS warps owns 16 output columns n0 .. n0 + 15; its warps split the chunks of K
// (warp v takes chunks v, v + MMA_WARPS, ...). Per chunk and half, one mma.m16n8k16: A = 16 weight
// rows x the half's 16 codes (bf16, exact: codes are small integers), B = those 16 k x 8 activation
// rows (rows past M are zero). Lane (g = lane / 4, t = lane % 4) decodes elements 16 half + 4t .. +3
// of weight rows g and g + 8 (one load_quad each) and loads the same 4 activations of row g, so the
// mma's k slots 2t, 2t+1, 2t+8, 2t+9 are those elements in order for A and B alike. The half's scale
// multiplies the mma result; offsets take sum(x) over the half from a second mma with A = ones. fp32
// accumulation; column m depends only on x row m, and the warps' sums are added in warp order: batch
// invariant, like gemv_blocks.
#define MMA_WARPS 8  // mma16816: common.cuh

// A quad's codes as bf16 pairs (code 0, code 1) and (code 2, code 3), values exact: a code byte
// (< 128) under 0x4300 is the bf16 128 + code, and one bf16x2 fma takes 128 + BIAS off; iq4 codes
// index the code book (bf16 bits in shared memory).
__device__ __forceinline__ void quad_bf16(u32 v, const u16* kv16, u32 off2, u32& p01, u32& p23) {
#if IQ4
  (void)off2;
  p01 = (u32)kv16[v & 15u] | ((u32)kv16[(v >> 8) & 15u] << 16);
  p23 = (u32)kv16[(v >> 16) & 15u] | ((u32)kv16[v >> 24] << 16);
#else
  (void)kv16;
  constexpr u32 ONE2 = 0x3F803F80u;  // (1, 1)
  const u32 a = __byte_perm(v, 0u, 0x4140) | 0x43004300u, b = __byte_perm(v, 0u, 0x4342) | 0x43004300u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p01) : "r"(a), "r"(ONE2), "r"(off2));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p23) : "r"(b), "r"(ONE2), "r"(off2));
#endif
}

// Grid: ceil(N / 16) blocks of MMA_WARPS * 32 threads.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)
gemv_blocks_mma(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, void* __restrict__ y,
                i64 y_stride, int M, int N, int K, int y_f32 NORM_PARAMS) {
  PDL_ENTRY();
  __shared__ u16 kv16[16];
  if (IQ4 && threadIdx.x < 16) kv16[threadIdx.x] = f32_to_bf16(KVALUES[threadIdx.x]);
  if (IQ4) __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  const i64 row_bytes = (i64)(K / QK) * BLK_BYTES;
  const u8* w0 = w + (i64)min(n0 + g, N - 1) * row_bytes;  // rows past N: read, never stored
  const u8* w1 = w + (i64)min(n0 + g + 8, N - 1) * row_bytes;
  const bool has_x = g < M;
  const act* xr = x + (has_x ? g : 0) * x_stride;
  const u16 off = f32_to_bf16(-(128.0f + (float)BIAS));
  const u32 off2 = (u32)off | ((u32)off << 16);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int chunks = K / 32;
  for (int c = warp; c < chunks; c += MMA_WARPS) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int e0 = 16 * half + 4 * t;
      const Quad qa = load_quad(w0, c, e0), qb = load_quad(w1, c, e0);
      u32 a0, a1, a2, a3;
      quad_bf16(qa.v, kv16, off2, a0, a2);
      quad_bf16(qb.v, kv16, off2, a1, a3);
      const uint2 xv = has_x ? *(const uint2*)(xr + c * 32 + e0) : make_uint2(0u, 0u);
      float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma16816(cc, a0, a1, a2, a3, xv.x, xv.y);
      acc[0] = fmaf(cc[0], qa.s, acc[0]);
      acc[1] = fmaf(cc[1], qa.s, acc[1]);
      acc[2] = fmaf(cc[2], qb.s, acc[2]);
      acc[3] = fmaf(cc[3], qb.s, acc[3]);
      if (HAS_OFFSET) {
        constexpr u32 ONES = 0x3F803F80u;
        float cx[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // sum of the half's x per column (the same for every row)
        mma16816(cx, ONES, ONES, ONES, ONES, xv.x, xv.y);
        acc[0] = fmaf(cx[0], qa.o, acc[0]);
        acc[1] = fmaf(cx[1], qa.o, acc[1]);
        acc[2] = fmaf(cx[2], qb.o, acc[2]);
        acc[3] = fmaf(cx[3], qb.o, acc[3]);
      }
    }
  }
  tile_epilogue<MMA_WARPS>(acc, MMA_WARPS, n0, N, M, y, y_stride, y_f32 NORM_ARGS);  // common.cuh
}
#endif

// ---- gemv_blocks_tile: the mma product over whole blocks, for the formats decode reads most -----------
// (q4_k, q6_k: a Q4_K_M file's every weight at widths that are multiples of 256; q5_k: a Q5_K_M file's;
// q5_0, q5_1: what llama.cpp's quantize puts where a width is not a multiple of 256, and Q5_0 / Q5_1
// files; iq4_nl, iq4_xs: IQ4 files). Same contract and outputs as gemv_blocks_mma (bf16 activations,
// M = 1..8, fp32 accumulation, batch invariant), built for bandwidth: one block of TILE_WARPS warps owns
// 16 output rows n0 .. n0 + 15 and its warps split the row into units of TILE_QK elements (warp v takes
// units v, v + TILE_WARPS, ...): one block of a 256-element format, TILE_BLOCKS blocks of a 32-element
// one (the launcher's choice, from K). Per unit a lane loads its share of rows g and g + 8 once, with
// the widest loads the format's alignment allows (q4_k / q5_k: the 16-byte header, then 8 code bytes
// from each 32-byte group; q6_k: 4-byte words, two 2-byte-aligned halves where a block starts 2 mod 4;
// q5_0, iq4_nl: likewise; q5_1, iq4_xs: 4-byte words), decodes the scales of both rows once per block,
// and then runs TILE_QK / 16 mma.m16n8k16 (A = 16 rows x 16 k of codes, B = those 16 k x 8 activation rows) in which
// every k shares one scale, so the scale applies to the mma result in fp32:
//   q4_k: lane t holds bytes 8t .. 8t + 7 of each 32-byte group; their low nibbles are elements
//         8t .. 8t + 7 of sub-block 2G, the high ones of 2G + 1: two mmas per sub-block. A nibble
//         placed at mantissa bits 3..6 under exponent 2^4 is the bf16 16 + q (exact; one shift and one
//         and/or per pair of codes), so the mma sums (16 + q) x, and acc += s * mma + (o - 16 s) * sum(x),
//         sum(x) per sub-block by an mma with A = ones (o = -dmin m, the sub-block's offset).
//   q5_k: q4_k's lanes and mmas, and the lane's 8 bytes of qh (bit j: sub-block j's fifth bit); a
//         code's 5 bits are made a byte (nibble | qh bit << 4), and a byte permute puts a code byte
//         under 0x43: the bf16 128 + q (exact), so acc += s * mma + (o - 128 s) * sum(x).
//   q5_0, q5_1: lane t holds bytes 4t .. 4t + 3 of a block's 16 code bytes and qh >> 4t: low nibbles
//         (and qh bits 0..3) are elements 4t .. 4t + 3, high nibbles (qh bits 16..19) 16 + 4t .. + 3:
//         two mmas per block, one scale; codes as q5_k's; q5_1's offset m as q5_k's, q5_0's -16 d
//         folded into the second mma (A = -144 in place of ones: TILE_FOLD).
//   iq4_nl, iq4_xs: lanes and mmas as q5_0's (iq4_xs: per 32-element sub-block); byte permutes look
//         the code book's bf16 values up in registers (low and high bytes apart: three permutes per
//         four codes and table), so A is KVALUES[q] and no offset is needed.
//   q6_k: lane t holds bytes 4t .. 4t + 3 of each 16-byte run of ql and qh; one ql word and one qh word
//         give 4 codes of each of two 32-element quarters; code bytes under exponent 2^6 are the bf16
//         64 + q, and one bf16x2 fma takes 96 off (q - 32, exact). One mma per 16-element scale group.
// In every mma a lane's four codes of a row are elements e, e + 1, e + 2, e + 3 (tile_elem), paired
// (e, e + 2) for k slots 2t, 2t + 1 and (e + 1, e + 3) for 2t + 8, 2t + 9 (all but q4_k and q6_k:
// (e, e + 1) and (e + 2, e + 3), TILE_PAIRS), and the activations are paired the same way (tile_b).
// The per-lane pieces (tile_load, tile_scales, tile_a, tile_b) also compile for the host, where
// tests/test_blocks_host.py runs them for all 32 lanes against gguf-py.
#if BLK_FMT == 0 || BLK_FMT == 1 || BLK_FMT == 2 || BLK_FMT == 5 || BLK_FMT == 6 || BLK_FMT == 7 || BLK_FMT == 8
#define TILE_FMT 1
#define TILE_WARPS 8       // warps per block that split K (host emulation; the kernel takes 8 or 16)
#define TILE_MAX_WARPS 16
#ifndef TILE_PREFETCH
#define TILE_PREFETCH 0
#endif
#ifndef TILE_BLOCKS
#define TILE_BLOCKS (QK == 256 ? 1 : 8)  // format blocks per unit (32-element formats: blocks.tile_blocks)
#endif
#if QK == 256 && TILE_BLOCKS != 1
#error "a 256-element format's unit is one block"
#endif
#if (BLK_FMT == 5 || BLK_FMT == 7) && TILE_BLOCKS % 2
#error "q5_0 / iq4_nl units are an even number of blocks (4-byte aligned)"
#endif
#define TILE_QK (QK * TILE_BLOCKS)          // elements per unit
#define TILE_BYTES (BLK_BYTES * TILE_BLOCKS)  // bytes per unit and row
#define TILE_NM (TILE_QK / 16)              // mmas per unit
#if BLK_FMT == 0
#define TILE_GROUP 2  // consecutive mmas that share a scale
#define TILE_NW 8     // code words per row and lane
#define TILE_NH 4     // header words per row
#elif BLK_FMT == 1
#define TILE_GROUP 2
#define TILE_NW 10  // 8 of qs, 2 of qh
#define TILE_NH 4
#elif BLK_FMT == 2
#define TILE_GROUP 1
#define TILE_NW 12
#define TILE_NH 5
#elif BLK_FMT == 8
#define TILE_GROUP 2
#define TILE_NW 8  // the lane's word of each sub-block's 16 code bytes
#define TILE_NH 2  // d and scales_h, scales_l
#else
#define TILE_GROUP 2
#define TILE_NW ((BLK_FMT == 7 ? 1 : 2) * TILE_BLOCKS)  // per block: the lane's qs word (q5: and qh >> 4t)
#define TILE_NH TILE_BLOCKS                             // per block: d (q5_1: d, m)
#endif
#define TILE_NG (TILE_NM / TILE_GROUP)  // scale groups per unit
// What an A element holds besides the code (q4_k 16 + q, the 5-bit formats 128 + q, q6_k q - 32, iq4
// the code book's value), and whether a scale group adds an offset (then sum(x) by the ones mma). q5_0's
// offset is the same multiple of d in every block (w = d (128 + q - 144)), so its second mma adds
// -144 x into the codes' own sums instead (TILE_FOLD; A = TILE_ONES).
#define TILE_A0 (BLK_FMT == 0 ? 16 : BLK_FMT == 2 || IQ4 ? 0 : 128)
#define TILE_FOLD (BLK_FMT == 5)
#define TILE_OFFSET (BLK_FMT != 2 && !IQ4 && !TILE_FOLD)
#define TILE_ONES (TILE_FOLD ? 0xC310C310u : 0x3F803F80u)  // bf16 pairs (-144, -144) or (1, 1)
// Whether a lane's k slots 2t, 2t + 1 (and 2t + 8, 2t + 9) hold elements e, e + 1 (e + 2, e + 3), as
// byte permutes build them, rather than e, e + 2 (e + 1, e + 3) as q4_k's and q6_k's shifts do.
#define TILE_PAIRS (BLK_FMT != 0 && BLK_FMT != 2)
// Constants tile_a takes in registers (tile_consts): q4_k / q6_k a code pair's mantissa bits; the
// 5-bit formats the byte 0x43 (the high byte of the bf16 128 + q) for the byte permute; iq4 the code
// book as bf16, low bytes (4 words) and high bytes (4 words), and the byte permute 0x32103210.
#define TILE_NK (IQ4 ? 9 : 1)

#ifndef BLOCKS_HOST  // the host stand-in (tests/kernels_host/common.cuh) has its own
__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
#endif

// 4-byte words of a block that starts 2-byte aligned (q6_k), at 4-byte multiples `off` into it: base is
// the block's start rounded down to 4 bytes and sh 0 or 16 (the rounding in bits). Where sh is 16 a
// second aligned load and a funnel shift give the word; offsets are constants after unrolling.
__device__ __forceinline__ u32 ld32_at(const u32* base, int sh, int off) {
  const u32 lo = __ldg(base + off / 4);
  return sh ? __funnelshift_r(lo, __ldg(base + off / 4 + 1), 16) : lo;
}

// The 4 bytes at byte `off` (even, a constant after unrolling) of a 4-byte aligned unit: one load, or
// two and a funnel shift where off is 2 mod 4 (q5_0's 22-byte blocks).
__device__ __forceinline__ u32 unit_word(const u32* u, int off) {
  return (off & 2) ? __funnelshift_r(__ldg(u + off / 4), __ldg(u + off / 4 + 1), 16) : __ldg(u + off / 4);
}

// v in a register the compiler keeps: `zero` is 0 at run time (derived from a kernel argument), so v
// is not a constant to ptxas, which otherwise rebuilds a constant register before every use (an
// and/or with two constants needs one of them in a register; so does the mma's A = ones).
__device__ __forceinline__ u32 opaque(u32 v, u32 zero) { return v | zero; }

// tile_a's register constants (TILE_NK), opaque through `zero`.
__device__ __forceinline__ void tile_consts(u32 zero, u32* kc) {
#if IQ4
  // KVALUES as bf16: c2fe c2d0 c2a6 c282 c244 c20c c1b0 c120 3f80 4150 41c8 4218 4254 428a 42b2 42e2
  constexpr u32 BOOK[9] = {0x82A6D0FEu, 0x20B00C44u, 0x18C85080u, 0xE2B28A54u,   // low bytes, entries 0..15
                           0xC2C2C2C2u, 0xC1C1C2C2u, 0x4241413Fu, 0x42424242u,   // high bytes
                           0x32103210u};
#pragma unroll
  for (int j = 0; j < 9; ++j) kc[j] = opaque(BOOK[j], zero);
#else
  kc[0] = opaque(BLK_FMT == 0 ? 0x00780078u : BLK_FMT == 2 ? 0x007E007Eu : 0x00000043u, zero);
#endif
}

// The code-book bytes of the four codes in the nibbles of sel's low 16 bits, from the 16-byte table t
// (entries 0..7 in t[0], t[1], 8..15 in t[2], t[3]): sel3 = sel & 0x7777 picks within each half, and
// pick = 0x3210 with bit 2 of nibble n set where code n is 8 or more picks the half.
__device__ __forceinline__ u32 book4(const u32* t, u32 sel3, u32 pick) {
  return __byte_perm(__byte_perm(t[0], t[1], sel3), __byte_perm(t[2], t[3], sel3), pick);
}

// One unit of rows g (r = 0) and g + 8 (r = 1) as lane t reads it: code words and header words.
struct TileRows {
  u32 q[2][TILE_NW];
  u32 h[2][TILE_NH];
};

__device__ __forceinline__ void tile_load(const u8* __restrict__ b0, const u8* __restrict__ b1, int t, TileRows& d) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u8* b = r ? b1 : b0;
#if BLK_FMT == 0 || BLK_FMT == 1
    constexpr int QS = BLK_FMT == 1 ? 48 : 16;  // q5_k: qh[32] at 16, then qs
    const uint4 h = __ldg((const uint4*)b);
    d.h[r][0] = h.x; d.h[r][1] = h.y; d.h[r][2] = h.z; d.h[r][3] = h.w;
#pragma unroll
    for (int G = 0; G < 4; ++G) {
      const uint2 v = __ldg((const uint2*)(b + QS + 32 * G + 8 * t));
      d.q[r][2 * G] = v.x;
      d.q[r][2 * G + 1] = v.y;
    }
#if BLK_FMT == 1
    const uint2 v = __ldg((const uint2*)(b + 16 + 8 * t));
    d.q[r][8] = v.x;
    d.q[r][9] = v.y;
#endif
#elif BLK_FMT == 2
    const u32* base = (const u32*)((size_t)b & ~(size_t)3);
    const int sh = (int)((size_t)b & 2) * 8;
    // words 3 i + 0, 1, 2 of run i = 2 h + hh: ql at 64 h + 16 hh (+ 32), qh at 128 + 32 h + 16 hh; lane's bytes 4t..
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i >> 1, hh = i & 1;
      d.q[r][3 * i] = ld32_at(base + t, sh, 64 * h + 16 * hh);
      d.q[r][3 * i + 1] = ld32_at(base + t, sh, 64 * h + 32 + 16 * hh);
      d.q[r][3 * i + 2] = ld32_at(base + t, sh, 128 + 32 * h + 16 * hh);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) d.h[r][i] = ld32_at(base, sh, 192 + 4 * i);  // the 16 int8 scales
    d.h[r][4] = (u32)__ldg((const u16*)(b + 208));                        // d
#elif BLK_FMT == 8
    // iq4_xs: d@0 scales_h@2 scales_l@4, sub-block j's 16 code bytes at 8 + 16 j
    const uint2 h = __ldg((const uint2*)b);
    d.h[r][0] = h.x;
    d.h[r][1] = h.y;
#pragma unroll
    for (int j = 0; j < 8; ++j) d.q[r][j] = __ldg((const u32*)(b + 8 + 16 * j) + t);
#else
    // q5_0: d@0 qh@2 qs@6; q5_1: d@0 m@2 qh@4 qs@8; iq4_nl: d@0 qs@2 (the unit is 4-byte aligned:
    // blocks.py's TILE_BLOCKS)
    constexpr int QS = BLK_FMT == 6 ? 8 : BLK_FMT == 5 ? 6 : 2;
    const u32* u = (const u32*)b;
#pragma unroll
    for (int k = 0; k < TILE_BLOCKS; ++k) {
      d.h[r][k] = unit_word(u, BLK_BYTES * k);  // d in the low half (q5_1: m in the high one)
#if IQ4
      d.q[r][k] = unit_word(u + t, BLK_BYTES * k + QS);
#else
      d.q[r][2 * k] = unit_word(u + t, BLK_BYTES * k + QS);
      d.q[r][2 * k + 1] = unit_word(u, BLK_BYTES * k + QS - 4) >> (4 * t);  // qh
#endif
    }
#endif
  }
}

// The scale s and offset o (0 where the format has none; see TILE_A0: o - TILE_A0 s) of scale group grp
// (a constant after unrolling) of row r. The kernel takes each where it applies it, so that only the
// header words stay live across a unit, not every group's scale and offset.
__device__ __forceinline__ void tile_scale(const TileRows& d, int r, int grp, u32 magic, float& s, float& o) {
#if BLK_FMT == 0 || BLK_FMT == 1
  const u32 s0 = d.h[r][1], s1 = d.h[r][2], s2 = d.h[r][3];
  const float dd = f16_lo(d.h[r][0]), dm = f16_hi(d.h[r][0]);
  // the 6-bit scale and min of sub-block grp, bytes grp % 4 of these words (sub-blocks 0..3, 4..7)
  const u32 sc = grp < 4 ? s0 & 0x3F3F3F3Fu : (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
  const u32 mn = grp < 4 ? s1 & 0x3F3F3F3Fu : ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
  // 2^23 + byte as a float; times d minus 2^23 d is d * byte, rounded once
  const float fs = __uint_as_float(__byte_perm(sc, magic, 0x7540u | (u32)(grp & 3)));  // magic: 0x4B000000
  const float fm = __uint_as_float(__byte_perm(mn, magic, 0x7540u | (u32)(grp & 3)));
  s = fmaf(fs, dd, -8388608.0f * dd);
  o = fmaf(-(float)TILE_A0, s, fmaf(fm, -dm, 8388608.0f * dm));
#elif BLK_FMT == 2
  (void)magic;
  // mma grp = 8 h + 4 hh + q uses scale 8 h + 2 q + hh
  const int h = grp >> 3, hh = (grp >> 2) & 1, q = grp & 3, idx = 8 * h + 2 * q + hh;
  s = f16_lo(d.h[r][4]) * (float)(i8)byte_of(d.h[r][idx >> 2], idx & 3);
  o = 0.0f;
#elif BLK_FMT == 8
  // the 6-bit scale ls of sub-block grp: low 4 bits from scales_l's nibble grp, high 2 from scales_h
  // (bits 2 grp, 2 grp + 1), whose nibbles are first spread to bytes
  const u32 sl = d.h[r][1], sh = d.h[r][0] >> 16;
  u32 hb = (sh | (sh << 8)) & 0x00FF00FFu;
  hb = (hb | (hb << 4)) & 0x0F0F0F0Fu;  // byte m: scales_h bits 4m .. 4m + 3 (sub-blocks 2m, 2m + 1)
  const u32 ls = (grp & 1) ? ((sl >> 4) & 0x0F0F0F0Fu) | ((hb << 2) & 0x30303030u)
                           : (sl & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u);
  // 2^23 + ls as a float, less 2^23 + 32: ls - 32 (exact)
  const float fl = __uint_as_float(__byte_perm(ls, magic, 0x7540u | (u32)(grp >> 1))) - 8388640.0f;
  s = f16_lo(d.h[r][0]) * fl;
  o = 0.0f;
#else  // the 32-element formats: group grp is block grp of the unit
  (void)magic;
  s = f16_lo(d.h[r][grp]);
  // q5_1: w = d q + m = d (128 + q) + m - 128 d; q5_0's -16 d: TILE_FOLD; iq4_nl: none
  o = BLK_FMT == 6 ? fmaf(-128.0f, s, f16_hi(d.h[r][grp])) : 0.0f;
#endif
}

// Every scale group's scale and offset, rows 0 and 1 (the host tests' view of tile_scale).
__device__ __forceinline__ void tile_scales(const TileRows& d, u32 magic, float s[2][TILE_NG], float o[2][TILE_NG]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int grp = 0; grp < TILE_NG; ++grp) tile_scale(d, r, grp, magic, s[r][grp], o[r][grp]);
}

// The first of lane t's four elements (of the unit) in mma i: tile_lane(t) + tile_elem(i).
__device__ __forceinline__ int tile_lane(int t) { return (BLK_FMT == 0 || BLK_FMT == 1 ? 8 : 4) * t; }
__device__ __forceinline__ int tile_elem(int i) {
#if BLK_FMT == 0 || BLK_FMT == 1
  return 32 * (i >> 1) + 4 * (i & 1);
#elif BLK_FMT == 2
  return 128 * (i >> 3) + 32 * (i & 3) + 16 * ((i >> 2) & 1);
#else
  return 32 * (i >> 1) + 16 * (i & 1);
#endif
}

// A fragment of mma i: a0 / a2 row 0's codes (e, e + 2) / (e + 1, e + 3) (TILE_PAIRS: (e, e + 1) /
// (e + 2, e + 3)), a1 / a3 row 1's, as bf16 pairs (q4_k: 16 + q; q6_k: q - 32; the 5-bit formats:
// 128 + q; iq4: KVALUES[q]). kc: tile_consts.
__device__ __forceinline__ void tile_a(const TileRows& d, int i, const u32* kc, u32* a) {
  const u32 mask = kc[0];
  (void)mask;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#if IQ4
    // the lane's word of block (iq4_xs: sub-block) i / 2; its low 16 bits' nibbles are the codes of
    // elements (e, half 0), (e, half 1), (e + 1, half 0), (e + 1, half 1), the high bits' of e + 2, e + 3
    const u32 w = d.q[r][i >> 1];
    const u32 s3 = w & 0x77777777u, pick = ((w >> 1) & 0x44444444u) | kc[8];
    const u32 lo01 = book4(kc, s3, pick), hi01 = book4(kc + 4, s3, pick);
    const u32 lo23 = book4(kc, s3 >> 16, pick >> 16), hi23 = book4(kc + 4, s3 >> 16, pick >> 16);
    a[r] = __byte_perm(lo01, hi01, (i & 1) ? 0x7351 : 0x6240);
    a[r + 2] = __byte_perm(lo23, hi23, (i & 1) ? 0x7351 : 0x6240);
#elif BLK_FMT == 0
    const int j = i >> 1;  // sub-block: group j / 2, low nibbles for even j
    const u32 w = d.q[r][2 * (j >> 1) + (i & 1)];
    const u32 lo = (j & 1) ? (w >> 1) : (w << 3), hi = (j & 1) ? (w >> 9) : (w >> 5);
    a[r] = (lo & mask) | 0x41804180u;  // mask: 0x00780078
    a[r + 2] = (hi & mask) | 0x41804180u;
#elif BLK_FMT == 2
    const int run = i >> 2, q = i & 3;
    const u32 L = d.q[r][3 * run + (q & 1)], H = d.q[r][3 * run + 2];
    const u32 lo = (q & 2) ? (L >> 4) : L;
    const u32 hb = q == 0 ? (H << 4) : q == 1 ? (H << 2) : q == 2 ? H : (H >> 2);
    const u32 v = (lo & 0x0F0F0F0Fu) | (hb & 0x30303030u);  // four 6-bit codes, one per byte
    constexpr u32 ONE2 = 0x3F803F80u, NEG96 = 0xC2C0C2C0u;
    a[r] = bf16x2_fma(((v << 1) & mask) | 0x42804280u, ONE2, NEG96);  // mask: 0x007E007E
    a[r + 2] = bf16x2_fma(((v >> 7) & mask) | 0x42804280u, ONE2, NEG96);
#else  // the 5-bit formats
#if BLK_FMT == 1
    const int j = i >> 1;  // sub-block j: nibble j % 2 of group j / 2, bit j of qh
    const u32 w = d.q[r][2 * (j >> 1) + (i & 1)], H = d.q[r][8 + (i & 1)];
    const u32 lo = (j & 1) ? (w >> 4) : w;
    const u32 hb = j <= 4 ? (H << (4 - j)) & 0x10101010u : (H >> (j - 4)) & 0x10101010u;
#else
    const int k = i >> 1, half = i & 1;  // block k: low nibbles and qh bits 0..3, or high and 16..19
    const u32 w = d.q[r][2 * k], H = d.q[r][2 * k + 1];
    const u32 lo = half ? (w >> 4) : w;
    const u32 hb = spread4(half ? (H >> 16) : H, 4);
#endif
    const u32 v = (lo & 0x0F0F0F0Fu) | hb;  // four 5-bit codes, one per byte
    a[r] = __byte_perm(v, mask, 0x4140);    // mask: 0x43; (128 + code 0, 128 + code 1): TILE_PAIRS
    a[r + 2] = __byte_perm(v, mask, 0x4342);
#endif
  }
}

// B fragment from 4 consecutive activations (x e .. e + 3 as two words): pairs (e, e + 2), (e + 1, e + 3)
// where the A pairs are so (q4_k, q6_k: one shift places bytes 0 and 2 of a code word), else the words
// as they are: (e, e + 1), (e + 2, e + 3).
__device__ __forceinline__ void tile_b(uint2 xv, u32& b0, u32& b1) {
#if TILE_PAIRS
  b0 = xv.x;
  b1 = xv.y;
#else
  b0 = __byte_perm(xv.x, xv.y, 0x5410);
  b1 = __byte_perm(xv.x, xv.y, 0x7632);
#endif
}

#if !ACT_F32 && !defined(BLOCKS_HOST)
// One unit's products for the warp's 16 rows, added to acc (codes in d, activations from xb).
__device__ __forceinline__ void tile_block(float* acc, const TileRows& d, const act* __restrict__ xb, const u32* kc,
                                           u32 magic, const u32* ones) {
#pragma unroll
  for (int grp = 0; grp < TILE_NG; ++grp) {
    float s0, o0, s1, o1;
#if !TILE_PREFETCH  // (placed here or after the mmas, ptxas keeps the fewer registers without spills)
    tile_scale(d, 0, grp, magic, s0, o0);
    tile_scale(d, 1, grp, magic, s1, o1);
#endif
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float cx[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // sum of the group's x per column (the same for every row)
#pragma unroll
    for (int u = 0; u < TILE_GROUP; ++u) {
      const int i = grp * TILE_GROUP + u;
      const uint2 xv = __ldg((const uint2*)(xb + tile_elem(i)));
      u32 b0, b1, a[4];
      tile_b(xv, b0, b1);
      tile_a(d, i, kc, a);
      mma16816(c, a[0], a[1], a[2], a[3], b0, b1);
      if (TILE_OFFSET) mma16816(cx, ones[0], ones[1], ones[2], ones[3], b0, b1);
      if (TILE_FOLD) mma16816(c, ones[0], ones[1], ones[2], ones[3], b0, b1);
    }
#if TILE_PREFETCH
    tile_scale(d, 0, grp, magic, s0, o0);
    tile_scale(d, 1, grp, magic, s1, o1);
#endif
    acc[0] = fmaf(c[0], s0, acc[0]);
    acc[1] = fmaf(c[1], s0, acc[1]);
    acc[2] = fmaf(c[2], s1, acc[2]);
    acc[3] = fmaf(c[3], s1, acc[3]);
    if (TILE_OFFSET) {
      acc[0] = fmaf(cx[0], o0, acc[0]);
      acc[1] = fmaf(cx[1], o0, acc[1]);
      acc[2] = fmaf(cx[2], o1, acc[2]);
      acc[3] = fmaf(cx[3], o1, acc[3]);
    }
  }
}

// Grid: ceil(N / 16) blocks of W * 32 threads, W = 8 or 16 (more warps split K where N gives few
// blocks; W depends on N only, never on M). With -DTILE_PREFETCH=1 a warp loads its next unit while
// it computes the current one (two buffers: its loads stay in flight across its own arithmetic, at
// the cost of registers: q4_k reaches the 128 that 512-thread blocks allow).
#ifndef TILE_MIN_BLOCKS
#define TILE_MIN_BLOCKS 0
#endif
#if TILE_MIN_BLOCKS  // 8-warp blocks only, registers bounded so that TILE_MIN_BLOCKS of them fit on an SM
#define TILE_BOUNDS __launch_bounds__(8 * 32, TILE_MIN_BLOCKS)
#else
#define TILE_BOUNDS __launch_bounds__(TILE_MAX_WARPS * 32)
#endif
extern "C" __global__ void TILE_BOUNDS
gemv_blocks_tile(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, void* __restrict__ y,
                 i64 y_stride, int M, int N, int K, int y_f32 NORM_PARAMS) {
  PDL_ENTRY();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nw = blockDim.x >> 5;
  const int n0 = blockIdx.x * 16;
  const i64 row_bytes = (i64)(K / QK) * BLK_BYTES;
  const u8* w0 = w + (i64)min(n0 + g, N - 1) * row_bytes;  // rows past N: read, never stored
  const u8* w1 = w + (i64)min(n0 + g + 8, N - 1) * row_bytes;
  // activation row g; lanes past M read row 0 (their columns are computed, never stored, and a
  // column of the mma depends only on its own activations)
  const act* xl = x + (g < M ? g : 0) * x_stride + tile_lane(t);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const u32 zero = (u32)M >> 31;  // 0 (M >= 1)
  const u32 magic = opaque(0x4B000000u, zero);
  u32 kc[TILE_NK];
  tile_consts(zero, kc);
  u32 ones[4];  // A = ones (bf16 1.0 pairs): the mma that sums activations (TILE_FOLD: -144)
#pragma unroll
  for (int j = 0; j < 4; ++j) ones[j] = opaque(TILE_ONES, zero << j);  // four registers, not one copied
  const int nb = K / TILE_QK;
#if TILE_PREFETCH
  TileRows d0, d1;
  if (warp < nb) tile_load(w0 + (i64)warp * TILE_BYTES, w1 + (i64)warp * TILE_BYTES, t, d0);
  for (int b = warp; b < nb; b += 2 * nw) {
    const int b1 = b + nw, b2 = b + 2 * nw;
    if (b1 < nb) tile_load(w0 + (i64)b1 * TILE_BYTES, w1 + (i64)b1 * TILE_BYTES, t, d1);
    tile_block(acc, d0, xl + (i64)b * TILE_QK, kc, magic, ones);
    if (b1 >= nb) break;
    if (b2 < nb) tile_load(w0 + (i64)b2 * TILE_BYTES, w1 + (i64)b2 * TILE_BYTES, t, d0);
    tile_block(acc, d1, xl + (i64)b1 * TILE_QK, kc, magic, ones);
  }
#else
  for (int b = warp; b < nb; b += nw) {
    TileRows d;
    tile_load(w0 + (i64)b * TILE_BYTES, w1 + (i64)b * TILE_BYTES, t, d);
    tile_block(acc, d, xl + (i64)b * TILE_QK, kc, magic, ones);
  }
#endif
  tile_epilogue<TILE_MAX_WARPS>(acc, nw, n0, N, M, y, y_stride, y_f32 NORM_ARGS);  // common.cuh
}
#endif
#endif
