// A host (C++) stand-in for ninfer/kernels/common.cuh: just enough for blocks.cu to compile with g++,
// so tests/test_blocks_host.py can run its block decoding (load_chunk) on the CPU against gguf-py.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#define __device__
#define __forceinline__ inline
#define __constant__ static
#define __restrict__
#define __global__
#define __launch_bounds__(x)
#define __shared__
#define __align__(x)
#define PDL_ENTRY()  // programmatic dependent launch: nothing on the host
static inline void __syncthreads() {}
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32;
typedef int i32; typedef long long i64;
struct uint4 { u32 x, y, z, w; }; struct uint2 { u32 x, y; }; struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
// PTX prmt (default mode): result byte i is byte (s >> 4i) & 7 of the 8 bytes {y:x}.
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {
  const unsigned long long b = ((unsigned long long)y << 32) | x;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= (u32)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
struct Dim { int x; }; static Dim threadIdx, blockIdx, blockDim;
static inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline float f16_to_f32(u16 h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
#define ACT_F32 1  // activations as floats: blocks.cu's bf16-only tensor-core kernel is left out
typedef float act;
static inline act to_act(float f) { return f; }
template <int N> void load_act(const act* p, float* f) { for (int i = 0; i < N; ++i) f[i] = p[i]; }
template <int N> void store_act(act* p, const float* f) { for (int i = 0; i < N; ++i) p[i] = f[i]; }
static inline float warp_sum(float v) { return v; }
// for gemv_blocks_tile's per-lane pieces (tests/kernels_host/tile_blocks.cpp)
#define BLOCKS_HOST 1
#include <algorithm>
#include <cstddef>
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh) {
  return (u32)((((unsigned long long)hi << 32) | lo) >> (sh & 31));
}
static inline u32 bf16x2_half_fma(u32 a, u32 b, u32 c) {  // one bf16 fma, rounded to nearest even
  const float f = fmaf(__uint_as_float(a << 16), __uint_as_float(b << 16), __uint_as_float(c << 16));
  u32 u;
  memcpy(&u, &f, 4);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
static inline u32 bf16x2_fma(u32 a, u32 b, u32 c) {
  return bf16x2_half_fma(a & 0xffffu, b & 0xffffu, c & 0xffffu) | (bf16x2_half_fma(a >> 16, b >> 16, c >> 16) << 16);
}
