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
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32;
typedef int i32; typedef long long i64;
struct uint4 { u32 x, y, z, w; }; struct uint2 { u32 x, y; };
struct Dim { int x; }; static Dim threadIdx, blockIdx, blockDim;
static inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline float f16_to_f32(u16 h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
typedef float act;
static inline act to_act(float f) { return f; }
template <int N> void load_act(const act* p, float* f) { for (int i = 0; i < N; ++i) f[i] = p[i]; }
template <int N> void store_act(act* p, const float* f) { for (int i = 0; i < N; ++i) p[i] = f[i]; }
static inline float warp_sum(float v) { return v; }
