// GEMV / skinny GEMM for decode: y[M, N] = x[M, K] @ W^T with M = 1..8 rows, W [N, K] in one of
//   GEMV_FMT 0 bf16:      W [N, K] bf16
//   GEMV_FMT 1 int8:      W [N, K] int8,     scales [N, K/g] f16;           w = q * s
//   GEMV_FMT 2 int4 sym:  W [N, K/2] uint8,  scales [N, K/g] f16;           w = (q - 8) * s
//   GEMV_FMT 3 int4 asym: W [N, K/2] uint8,  scales, mins [N, K/g] f16;     w = q * s + m
//   GEMV_FMT 4 f32:       W [N, K] f32
// (ninfer/engine/quant.py layouts: int4 element 2j in the low nibble of byte j), dequantized in
// registers. One warp per output column n; a lane reads 16 bytes of W per step (8 bf16, 16 int8,
// 32 int4 or 4 f32 weights), so a warp streams 512 contiguous bytes. fp32 accumulation: each lane
// sums its chunks in K order, then a fixed butterfly, so row m's result is the same whatever M
// is (batch invariance). x [M, K] act (row stride x_stride); y act or fp32 (row stride y_stride).
// The launcher checks K % chunk == 0 and group_size % chunk == 0, so a chunk never straddles a group.
#include "common.cuh"

#define GEMV_WARPS 8

template <int FMT> struct Chunk;
template <> struct Chunk<0> { static constexpr int n = 8; };
template <> struct Chunk<1> { static constexpr int n = 16; };
template <> struct Chunk<2> { static constexpr int n = 32; };
template <> struct Chunk<3> { static constexpr int n = 32; };
template <> struct Chunk<4> { static constexpr int n = 4; };

template <int M, int FMT>
__device__ __forceinline__ void gemv_impl(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w,
                                          const u16* __restrict__ scales, const u16* __restrict__ mins,
                                          void* __restrict__ y, i64 y_stride, int N, int K, int group_size,
                                          int y_f32) {
  constexpr int CH = Chunk<FMT>::n;
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  const i64 row_bytes = FMT == 4 ? (i64)K * 4 : FMT == 0 ? (i64)K * 2 : FMT == 1 ? (i64)K : (i64)K / 2;
  const u8* wrow = w + (i64)n * row_bytes;
  const int ngroups = FMT == 0 || FMT == 4 ? 0 : K / group_size;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;

#pragma unroll 2
  for (int k = lane * CH; k < K; k += 32 * CH) {
    const uint4 wv = *(const uint4*)(wrow + (FMT == 4 ? (i64)k * 4 : FMT == 0 ? (i64)k * 2 : FMT == 1 ? (i64)k : (i64)k / 2));
    if constexpr (FMT == 0 || FMT == 4) {
      float wf[CH];
      if constexpr (FMT == 0) {
        unpack8(wv, wf);
      } else {
        wf[0] = __uint_as_float(wv.x); wf[1] = __uint_as_float(wv.y);
        wf[2] = __uint_as_float(wv.z); wf[3] = __uint_as_float(wv.w);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[CH];
        load_act<CH>(x + m * x_stride + k, xf);
#pragma unroll
        for (int j = 0; j < CH; ++j) acc[m] = fmaf(wf[j], xf[j], acc[m]);
      }
    } else {
      const int grp = k / group_size;
      const float s = f16_to_f32(scales[(i64)n * ngroups + grp]);
      const float mn = FMT == 3 ? f16_to_f32(mins[(i64)n * ngroups + grp]) : 0.0f;
      const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
      float qf[CH];
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        if (FMT == 1) qf[j] = (float)(i8)((words[j >> 2] >> ((j & 3) * 8)) & 0xffu);
        else if (FMT == 2) qf[j] = (float)((words[j >> 3] >> ((j & 7) * 4)) & 0xfu) - 8.0f;
        else qf[j] = (float)((words[j >> 3] >> ((j & 7) * 4)) & 0xfu);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float dot = 0.0f, xsum = 0.0f;
#pragma unroll
        for (int v = 0; v < CH / 8; ++v) {
          float xf[8];
          load_act<8>(x + m * x_stride + k + v * 8, xf);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            dot = fmaf(qf[v * 8 + j], xf[j], dot);
            if (FMT == 3) xsum += xf[j];
          }
        }
        acc[m] = fmaf(dot, s, acc[m]);
        if (FMT == 3) acc[m] = fmaf(xsum, mn, acc[m]);
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

template <int FMT>
__device__ __forceinline__ void gemv_dispatch(int M, const act* x, i64 x_stride, const u8* w, const u16* scales,
                                              const u16* mins, void* y, i64 y_stride, int N, int K,
                                              int group_size, int y_f32) {
  switch (M) {
#define GEMV_CASE(MM) \
    case MM: gemv_impl<MM, FMT>(x, x_stride, w, scales, mins, y, y_stride, N, K, group_size, y_f32); break;
    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#undef GEMV_CASE
    default: break;
  }
}

// Grid: ceil(N / GEMV_WARPS) blocks of GEMV_WARPS * 32 threads. The weight format is a
// compile-time define (-DGEMV_FMT=0..4), one module per format, to keep NVRTC time down.
#ifndef GEMV_FMT
#error "compile with -DGEMV_FMT=0|1|2|3|4"
#endif
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, const u16* __restrict__ scales,
     const u16* __restrict__ mins, void* __restrict__ y, i64 y_stride, int M, int N, int K, int group_size,
     int y_f32) {
  PDL_ENTRY();
  gemv_dispatch<GEMV_FMT>(M, x, x_stride, w, scales, mins, y, y_stride, N, K, group_size, y_f32);
}
