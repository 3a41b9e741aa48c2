// Shared helpers for ninfer's NVRTC kernels. No system headers: NVRTC compiles these
// standalone, so bf16/f16 are handled as raw 16-bit words and converted by hand.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;  // raw bf16 or f16 bits
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define WARP 32

// Programmatic dependent launch (sm_90+). Every kernel's first statement is PDL_ENTRY(). Launched
// with the programmatic-serialization attribute (compiler.Kernel.launch), a kernel's blocks may be
// scheduled while the kernel before it on the stream still runs: here they let the next kernel's
// blocks be scheduled the same way, then wait until the previous kernel has completed and its
// writes are visible, so nothing a kernel reads or writes is touched before that. Launched
// without the attribute, both instructions do nothing.
// A kernel may split it in two, PDL_LAUNCH() first and PDL_WAIT() later, to load before the wait what
// no kernel writes (its weights) while the kernel before it runs: with coherent loads, since ptxas
// moves .nc ones (__ldg) across the wait (tests/test_pdl_order.py).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_LAUNCH()
#define PDL_WAIT()
#endif
#define PDL_ENTRY() \
  do {              \
    PDL_LAUNCH();   \
    PDL_WAIT();     \
  } while (0)

#define NEG_INF (__int_as_float(0xff800000))
#define NAN_F (__int_as_float(0x7fc00000))

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// A 32-bit word holds two bf16: element 0 in the low half (little endian).
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf16x2(float a, float b) {
  return (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
}

// 8 bf16 (one 16-byte vector) -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
  f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
  f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
  f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
  f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  v.x = pack_bf16x2(f[0], f[1]);
  v.y = pack_bf16x2(f[2], f[3]);
  v.z = pack_bf16x2(f[4], f[5]);
  v.w = pack_bf16x2(f[6], f[7]);
  return v;
}

// Activations (hidden states, q/k/v, the KV cache, norm weights) are bf16 by default and fp32
// when a module is compiled with -DACT_F32=1; kernels read and write them through these helpers
// and always compute in fp32. Weights of the gemv keep their own formats.
#ifndef ACT_F32
#define ACT_F32 0
#endif
#if ACT_F32
typedef float act;
__device__ __forceinline__ float act_f32(act a) { return a; }
__device__ __forceinline__ act to_act(float f) { return f; }
#else
typedef u16 act;
__device__ __forceinline__ float act_f32(act a) { return bf16_to_f32(a); }
__device__ __forceinline__ act to_act(float f) { return f32_to_bf16(f); }
#endif
// f rounded as storing it as an activation would round it.
__device__ __forceinline__ float act_round(float f) { return act_f32(to_act(f)); }

// N (2, 4 or 8) consecutive activations at p <-> floats; p is aligned to N activations.
template <int N>
__device__ __forceinline__ void load_act(const act* p, float* f) {
#if ACT_F32
  if constexpr (N == 2) {
    const float2 v = *(const float2*)p;
    f[0] = v.x; f[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *(const float4*)(p + i);
      f[i] = v.x; f[i + 1] = v.y; f[i + 2] = v.z; f[i + 3] = v.w;
    }
  }
#else
  if constexpr (N == 2) {
    const u32 w = *(const u32*)p;
    f[0] = bf16_lo(w); f[1] = bf16_hi(w);
  } else if constexpr (N == 4) {
    const uint2 w = *(const uint2*)p;
    f[0] = bf16_lo(w.x); f[1] = bf16_hi(w.x); f[2] = bf16_lo(w.y); f[3] = bf16_hi(w.y);
  } else {
    unpack8(*(const uint4*)p, f);
  }
#endif
}

template <int N>
__device__ __forceinline__ void store_act(act* p, const float* f) {
#if ACT_F32
  if constexpr (N == 2) {
    *(float2*)p = make_float2(f[0], f[1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) *(float4*)(p + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
  }
#else
  if constexpr (N == 2) *(u32*)p = pack_bf16x2(f[0], f[1]);
  else if constexpr (N == 4) *(uint2*)p = make_uint2(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]));
  else *(uint4*)p = pack8(f);
#endif
}

// Butterfly sum: a fixed order of additions, and every lane ends with the same value.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum with a fixed order (warp butterflies, then warp 0 over the warp sums).
// `scratch` holds at least 32 floats; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nwarps ? scratch[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) scratch[0] = s;
  }
  __syncthreads();
  return scratch[0];
}

// c[4] += A (16 x 16, bf16, row-major fragment a0..a3) x B (16 x 8, bf16, column-major fragment b0, b1)
// on tensor cores, fp32 accumulators: lane (g = lane / 4, t = lane % 4) holds c rows g, g + 8 and
// columns 2 t, 2 t + 1; a rows g, g + 8, k 2 t, 2 t + 1 (a0, a1) and + 8 (a2, a3); b k 2 t, 2 t + 1
// (b0) and + 8 (b1), column g.
#define MMA16816(name, type)                                                                          \
  __device__ __forceinline__ void name(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {       \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                 "{%8,%9}, {%0,%1,%2,%3};"                                                                \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                          \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                \
  }
MMA16816(mma16816, "bf16")
MMA16816(mma16816_f16, "f16")  // the same with fp16 inputs

// cp.async: 16 bytes from global into shared memory (through L2 only), asynchronously; cp_async_wait_all()
// returns once every copy the thread issued has landed (visible to that thread; a barrier for the others)
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Streaming loads: weights and scales are read once, so they do not displace the activations in L1.
// nc false (a constant where inlined): a coherent load, which ptxas leaves before a PDL_WAIT (it
// moves .nc loads after one).
__device__ __forceinline__ uint4 ld_stream(const void* p, bool nc = true) {
  uint4 v;
  if (nc)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream2(const void* p, bool nc = true) {
  uint2 v;
  if (nc)
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  else
    asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_stream1(const void* p, bool nc = true) {
  u32 v;
  if (nc)
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  else
    asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// A hint: the 128-byte line at p into L2, no register written, nothing waits on it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Up to PF lines a thread of [p, p + bytes) into L2, the block's threads taking consecutive 128-byte
// lines (the region's start first): a kernel's weights, which nothing writes, asked for before its PDL
// wait, so they stream from memory while the kernel before finishes (a hint: the same bits).
template <int PF>
__device__ __forceinline__ void prefetch_region_l2(const void* p, i64 bytes) {
#pragma unroll
  for (int i = 0; i < PF; ++i) {
    const i64 off = ((i64)i * blockDim.x + threadIdx.x) * 128;
    if (off < bytes) prefetch_l2((const char*)p + off);
  }
}

// The activations (the kernel before's output): a coherent load, which ptxas keeps after PDL_WAIT
// (an .nc one, as __ldg, it may move above it).
__device__ __forceinline__ uint4 ld_act(const act* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One activation (the kernel before's output, or one earlier's) by a coherent load, kept after PDL_WAIT.
__device__ __forceinline__ act ld_act1(const act* p) {
  act v;
#if ACT_F32
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
#else
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
#endif
  return v;
}

// 8 activations at p read through L2 only (not L1: data written by other blocks of the same kernel).
__device__ __forceinline__ void load_act8_l2(const act* p, float* f) {
#if ACT_F32
  const float4 a = __ldcg((const float4*)p), b = __ldcg((const float4*)(p + 4));
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
#else
  unpack8(__ldcg((const uint4*)p), f);
#endif
}

// One row of RMSNorm fused with the residual add, by the block's first nt threads (every thread of
// the block calls it: block_sum): rr == nullptr: out = rmsnorm(x) * w; else rr += x (rounded to act,
// as an add in that dtype would be) and out = rmsnorm(rr) * w. fp32 sum of squares in an order fixed
// by nt alone, so elementwise.cu's rmsnorm_residual (nt = its block size) and the fused gemv epilogue
// (GEMV_NORM, the same nt) give the same bits. L2: x is read through L2 (written by other blocks).
// PRE > 0: wpre[p] holds the weight's 8 values at vector threadIdx.x + p nt (rmsnorm_weights, loaded
// before a PDL wait), for the first PRE of this thread's vectors; the same values, so the same bits.
// RR_WRITE false: rr is only read (out = rmsnorm(rr + x) * w, rr left as it was; the sum formed again for
// the scaling), for a gemv's prologue (GEMV_PNORM) whose blocks all read rr at once.
template <bool L2, int PRE = 0, bool RR_WRITE = true>
__device__ __forceinline__ void rmsnorm_row(const act* x, act* rr, const act* __restrict__ weight, act* orow, int H,
                                            float eps, int nt, float* scratch, const float (*wpre)[8] = nullptr) {
  const int nvec = H / 8;
  const bool mine = threadIdx.x < nt;
  auto load_x = [&](int i, float* a) {
    if (L2) load_act8_l2(x + i * 8, a);
    else load_act<8>(x + i * 8, a);
  };
  auto add_rr = [&](int i, float* a) {  // a = x + rr, rounded to act as an add in that dtype would be
    float r[8];
    load_act<8>(rr + i * 8, r);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = act_round(a[j] + r[j]);
  };
  float ss = 0.0f;
  for (int i = threadIdx.x; mine && i < nvec; i += nt) {
    float a[8];
    load_x(i, a);
    if (rr) {
      add_rr(i, a);
      if (RR_WRITE) store_act<8>(rr + i * 8, a);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += a[j] * a[j];
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
  auto scale = [&](int i, const float* w) {
    float a[8];
    if (rr && RR_WRITE) {
      load_act<8>(rr + i * 8, a);  // this thread's own writes above: no barrier needed
    } else {
      load_x(i, a);
      if (rr) add_rr(i, a);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = a[j] * inv * w[j];
    store_act<8>(orow + i * 8, a);
  };
  int i = threadIdx.x;
#pragma unroll
  for (int p = 0; p < PRE; ++p, i += nt)
    if (mine && i < nvec) scale(i, wpre[p]);
  for (; mine && i < nvec; i += nt) {
    float w[8];
    load_act<8>(weight + i * 8, w);
    scale(i, w);
  }
}

// rmsnorm_row's first PRE weight vectors of this thread (threadIdx.x + p nt < H / 8), by coherent loads,
// which may come before a PDL wait (nothing writes a weight).
template <int PRE>
__device__ __forceinline__ void rmsnorm_weights(const act* weight, int H, int nt, float (*w)[8]) {
#pragma unroll
  for (int p = 0; p < PRE; ++p) {
    const int i = threadIdx.x + p * nt;
    if (threadIdx.x < nt && i < H / 8) {
#if ACT_F32
      const uint4 a = ld_stream(weight + i * 8, false), b = ld_stream(weight + i * 8 + 4, false);
      w[p][0] = __uint_as_float(a.x); w[p][1] = __uint_as_float(a.y); w[p][2] = __uint_as_float(a.z);
      w[p][3] = __uint_as_float(a.w); w[p][4] = __uint_as_float(b.x); w[p][5] = __uint_as_float(b.y);
      w[p][6] = __uint_as_float(b.z); w[p][7] = __uint_as_float(b.w);
#else
      unpack8(ld_stream(weight + i * 8, false), w[p]);
#endif
    }
  }
}

// RoPE (rotate_half) on one pair (x = element i, y = element i + half of a head): lo = x cos - y sin,
// hi = y cos + x sin, each one product and one fma in this order, so that rope_kv.cu and the fused
// decode attention (attention.cu ROPE_KV) round the same way.
__device__ __forceinline__ float rope_lo(float x, float y, float c, float s) { return fmaf(x, c, -(y * s)); }
__device__ __forceinline__ float rope_hi(float x, float y, float c, float s) { return fmaf(y, c, x * s); }

// The gated activations of an MLP, in fp32: silu(g) * u and gelu_tanh(g) * u (torch's
// gelu(approximate="tanh")). One definition for elementwise.cu and the fused gemv epilogue below, so
// both round the same way.
__device__ __forceinline__ float silu_mul_f(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float gelu_mul_f(float g, float u) {
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
}

// The epilogue of the tensor-core gemvs (gemv_mma.cu, gemv_tiled.cu, blocks.cu's mma and tile kernels).
// Each of the block's nw (<= MAXW) warps holds partial sums of one 16-row tile n0 .. n0 + 15 in the
// mma16816 accumulator layout: lane (g, t) has acc[0], acc[1] for row g, columns (activation rows)
// 2 t, 2 t + 1, and acc[2], acc[3] for row g + 8. Warp 0 adds them in warp order (a column's result
// depends on its own activation row only: batch invariant) and stores y[m, n] for n < N, m < M, fp32
// when y_f32, else rounded to act.
// Compiled with -DGEMV_GLU=1 (silu) or 2 (gelu_tanh), the weight is a gated MLP's gate and up
// projections with rows interleaved in eights (tile rows 0..7: gate rows n0/2 .. n0/2 + 7, rows 8..15:
// the same up rows; launchers.glu_rows) and y [M, N/2] receives act(act(gate) x act(up)) at n0/2 + g:
// the bits a gemv into act followed by swiglu / geglu would give. y_f32 is ignored (always act).
// Compiled with -DGEMV_NORM=1, the kernel also does rmsnorm_residual's work on its output (one
// launch instead of two): y [M, N] (act) is stored as usual, then the block that finishes last (a
// device-wide counter, reset by that block for the next launch) adds each row of y into the residual
// and writes the normed row: residual[m] += y[m], normed[m] = rmsnorm(residual[m]) * norm_w, with
// rmsnorm_residual's bits (rmsnorm_row, its thread count norm_nt). The kernels take the extra
// arguments as NORM_PARAMS.
#ifndef GEMV_GLU
#define GEMV_GLU 0
#endif
#ifndef GEMV_NORM
#define GEMV_NORM 0
#endif
#if GEMV_NORM
#define NORM_PARAMS , act* __restrict__ residual, i64 res_stride, const act* __restrict__ norm_w, \
    act* __restrict__ normed, i64 normed_stride, float eps, int norm_nt, u32* __restrict__ counter
#define NORM_ARGS , residual, res_stride, norm_w, normed, normed_stride, eps, norm_nt, counter
#else
#define NORM_PARAMS
#define NORM_ARGS
#endif
// Compiled with -DGEMV_CATCHUP=1 (a decode step whose residual norms run in the next gemv's prologue,
// GEMV_PNORM below, leave the residual one add behind): the block also adds the previous residual
// gemv's output yp into the residual rr at its own columns, rr[m, n] = act(rr[m, n] + yp[m, n]) (n0 ..
// n0 + 15, m < M: no other block touches them), rmsnorm_residual's add with its bits. Warp 0 loads them
// with catchup_load after the kernel's PDL wait (every block that read rr has finished then) and stores
// them in the epilogue. Not with GEMV_GLU (a gated MLP's gate_up adds nothing to the residual).
#ifndef GEMV_CATCHUP
#define GEMV_CATCHUP 0
#endif
#if GEMV_CATCHUP
#if GEMV_GLU || ACT_F32
#error "GEMV_CATCHUP takes bf16 activations and no GEMV_GLU"
#endif
#define CATCHUP_PARAMS , const act* __restrict__ yp, i64 yp_stride, act* __restrict__ rr, i64 rr_stride
#define CATCHUP_ARGS , cu, rr, rr_stride
#define CATCHUP_EPARAMS , const u32* cu, act* __restrict__ rr, i64 rr_stride
// the (m, n) of epilogue value j of a warp-0 lane (g, t): tile_epilogue's mapping
// (bf16 only: values j and j + 1 packed in cu[j / 2], two registers held across the kernel's loop)
__device__ __forceinline__ void catchup_load(u32* cu, const act* yp, i64 yp_stride, const act* rr, i64 rr_stride,
                                             int n0, int N, int M) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  cu[0] = cu[1] = 0u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), m = 2 * t + (j & 1);
    if (threadIdx.x < 32 && n < N && m < M)
      cu[j >> 1] |= (u32)to_act(act_f32(ld_act1(yp + m * yp_stride + n)) + act_f32(ld_act1(rr + m * rr_stride + n)))
                    << (16 * (j & 1));
  }
}
#else
#define CATCHUP_PARAMS
#define CATCHUP_ARGS
#define CATCHUP_EPARAMS
#endif
// Compiled with -DGEMV_PNORM=1 (gemv_tiled.cu, gemv_mma.cu's bf16 pipeline; one bf16 row; the same bits as
// rmsnorm_residual then the gemv): x is the residual gemv's output before the residual norm, and every
// block forms the normed row itself, x' = rmsnorm(rr + x) * pn_w (rmsnorm_row over pn_nt =
// rmsnorm_residual's threads, rr only read), into its dynamic shared memory (K + 8 activations), where
// its slabs read it: one launch fewer per norm. The residual stays one add behind; the next residual gemv
// makes it up (GEMV_CATCHUP). The kernel loads the norm weight's first vectors before its PDL wait
// (PNORM_WEIGHTS) and forms the row after it (pnorm_row).
#ifndef GEMV_PNORM
#define GEMV_PNORM 0
#endif
#if GEMV_PNORM
#if ACT_F32
#error "GEMV_PNORM takes bf16 activations"
#endif
#define PNORM_PARAMS , const act* __restrict__ pn_rr, const act* __restrict__ pn_w, float pn_eps, int pn_nt
#define PNORM_PRE 2  // norm weight vectors a thread loads before the wait (K <= 2 * 8 * pn_nt: all of them)
#define PNORM_WEIGHTS()              \
  float pn_wpre[PNORM_PRE][8];       \
  rmsnorm_weights<PNORM_PRE>(pn_w, K, pn_nt, pn_wpre)
__device__ __forceinline__ void pnorm_row(const act* x, const act* rr, const act* __restrict__ weight, act* xs, int K,
                                          float eps, int nt, const float (*wpre)[8]) {
  __shared__ float scratch[32];
  rmsnorm_row<false, PNORM_PRE, false>(x, (act*)rr, weight, xs, K, eps, nt, scratch, wpre);
  __syncthreads();  // a thread's normed vectors are read by other threads
}
#else
#define PNORM_PARAMS
#endif
// A residual norm split between two gemvs of a decode step (gemv_tiled.cu; other bits than rmsnorm_residual
// then the gemv, the same at every row count): rmsnorm(h) * w @ W^T = rinv * ((h * w) @ W^T), rinv =
// rsqrt(sum(h^2) / K + eps), so the residual gemv writes h * w and sums of squares, and the consumer scales
// its fp32 sums by rinv in its epilogue: no norm launch, and nothing added before the consumer's first mma.
// Compiled with -DGEMV_HWOUT=1 (the residual gemv, no GEMV_GLU / NORM / CATCHUP): the block adds its
// columns of y into the residual, h = act(rr + act(y)) (rmsnorm_residual's add, its bits), stores h into
// rr, act(h * hw_w) into y in place of y, and per row m its 16 columns' sum of squares into
// hw_parts[m * hw_parts_stride + n0 / 16] in sumsq16's order.
// Compiled with -DGEMV_RSCALE=1 and -DRS_P=K/16 (the consumer): the block copies rows 0..M-1 of
// rs_parts (RS_P floats each) into shared memory after its PDL wait (rscale_copy) and its epilogue
// multiplies row m's sums by rsqrt(sum / K + rs_eps) before rounding (rscale_rows' order: the same
// factor in every block and at every M). RS_PAR 1 (speed only, the same bits): the block's warps reduce
// a row each after the main loop (rows w, w + warps, ...) where RS_PAR 0 has warp 0 reduce every row in
// the epilogue (M rows one after another in each block's tail; one row saves RS_PAR's barrier:
// launchers.RSCALE_PAR_ROWS).
#ifndef GEMV_HWOUT
#define GEMV_HWOUT 0
#endif
#ifndef GEMV_RSCALE
#define GEMV_RSCALE 0
#endif
#if GEMV_HWOUT
#if GEMV_GLU || GEMV_NORM || GEMV_CATCHUP || ACT_F32
#error "GEMV_HWOUT takes bf16 activations and no GEMV_GLU, GEMV_NORM or GEMV_CATCHUP"
#endif
// HW_EARLY 1 (speed only, the same bits): warp 0 loads its residual columns and their norm weights right
// after the PDL wait (hwout_load, three registers held across the loop) instead of in the epilogue, where
// the loads' round trip lies in every block's tail.
#ifndef HW_EARLY
#define HW_EARLY 0
#endif
#define HWOUT_PARAMS , act* __restrict__ hw_rr, i64 hw_rr_stride, const act* __restrict__ hw_w, \
    float* __restrict__ hw_parts, i64 hw_parts_stride
#define HWOUT_ARGS , hw_rr, hw_rr_stride, hw_w, hw_parts, hw_parts_stride, hwe
#define HWOUT_EPARAMS HWOUT_PARAMS, const u32* hwe
// warp 0's residual values j (tile_epilogue's mapping; j and j + 1 packed in e[j / 2]) and norm weights
// (columns g and g + 8 in e[2]), after the PDL wait: every block that read the residual has finished
__device__ __forceinline__ void hwout_load(u32* e, const act* rr, i64 rr_stride, const act* w, int n0, int N, int M) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  e[0] = e[1] = e[2] = 0u;
  if (threadIdx.x >= 32) return;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), m = 2 * t + (j & 1);
    if (n < N && m < M) e[j >> 1] |= (u32)ld_act1(rr + m * rr_stride + n) << (16 * (j & 1));
  }
  if (n0 + g < N) e[2] |= (u32)ld_act1(w + n0 + g);
  if (n0 + g + 8 < N) e[2] |= (u32)ld_act1(w + n0 + g + 8) << 16;
}
#else
#define HWOUT_PARAMS
#define HWOUT_ARGS
#define HWOUT_EPARAMS
#endif
#if GEMV_RSCALE
#if GEMV_NORM || GEMV_PNORM || GEMV_HWOUT || ACT_F32 || !defined(RS_P) || RS_P % 4
#error "GEMV_RSCALE takes bf16 activations, RS_P (a multiple of 4), no GEMV_NORM, GEMV_PNORM or GEMV_HWOUT"
#endif
#ifndef RS_PAR
#define RS_PAR 0
#endif
#define RSCALE_PARAMS , const float* __restrict__ rs_parts, i64 rs_stride, float rs_eps
#define RSCALE_ARGS , rs_buf, rs_inv, K, rs_eps
#define RSCALE_EPARAMS , const float* rs_buf, const float* rs_inv, int rs_K, float rs_eps
#define RSCALE_BUF()                                \
  __shared__ __align__(16) float rs_buf[8 * RS_P]; \
  __shared__ float rs_inv[8]
// rows 0..M-1 of the parts into buf, every thread's 16-byte copies in flight (cp_async_wait_all before
// the epilogue's barrier)
__device__ __forceinline__ void rscale_copy(float* buf, const float* parts, i64 stride, int M) {
  for (int i = threadIdx.x; i < M * (RS_P / 4); i += blockDim.x) {
    const int m = i / (RS_P / 4), c = i % (RS_P / 4);
    cp_async16(buf + m * RS_P + 4 * c, parts + m * stride + 4 * c);
  }
}
// one row's rinv by a whole warp from its RS_P sums in shared memory: lane l adds sums l, l + 32, ... in
// order, then the warp's xor tree (every lane gets it)
__device__ __forceinline__ float rscale_row(const float* row, int K, float eps) {
  float s = 0.0f;
  for (int i = threadIdx.x & 31; i < RS_P; i += 32) s += row[i];
  return rsqrtf(warp_sum(s) / (float)K + eps);
}
// the block's rows' rinv before its epilogue: RS_PAR 1, warp w's rows into inv[m] (after every thread's
// copies; the epilogue's barrier shows them to warp 0); RS_PAR 0, only the copies waited for
__device__ __forceinline__ void rscale_rows(float* inv, const float* buf, int M, int K, float eps, int nw) {
  cp_async_wait_all();  // RS_PAR 0: the epilogue's barrier then shows every thread's copies to warp 0
#if RS_PAR
  __syncthreads();  // every thread's copies
  const int warp = threadIdx.x >> 5;
  for (int m = warp; m < M; m += nw) {
    const float v = rscale_row(buf + m * RS_P, K, eps);
    if ((threadIdx.x & 31) == 0) inv[m] = v;
  }
#else
  (void)inv, (void)buf, (void)M, (void)K, (void)eps, (void)nw;
#endif
}
// rinv of rows 2 t and 2 t + 1 (lane t = lane & 3 of warp 0 in the epilogue): RS_PAR's from inv, else
// reduced here one row after another (rscale_row's loop written out: the cubins of the kernel timed in
// session 30, byte for byte); rows past M give 0
__device__ __forceinline__ void rscale_factors(float* f, const float* buf, const float* inv, int M, int K, float eps) {
  const int t = threadIdx.x & 3;
  f[0] = f[1] = 0.0f;
#if RS_PAR
  (void)buf, (void)K, (void)eps;
  if (2 * t < M) f[0] = inv[2 * t];
  if (2 * t + 1 < M) f[1] = inv[2 * t + 1];
#else
  (void)inv;
  const int lane = threadIdx.x & 31;
  for (int m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int i = lane; i < RS_P; i += 32) s += buf[m * RS_P + i];
    const float v = rsqrtf(warp_sum(s) / (float)K + eps);
    if (m == 2 * t) f[0] = v;
    if (m == 2 * t + 1) f[1] = v;
  }
#endif
}
#else
#define RSCALE_PARAMS
#define RSCALE_ARGS
#define RSCALE_EPARAMS
#endif
template <int MAXW>
__device__ __forceinline__ void tile_epilogue(const float* acc, int nw, int n0, int N, int M, void* y, i64 y_stride,
                                              int y_f32 NORM_PARAMS CATCHUP_EPARAMS HWOUT_EPARAMS RSCALE_EPARAMS) {
  __shared__ float part[MAXW][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) part[warp][lane][j] = acc[j];
  __syncthreads();
  if (warp == 0) {
  float r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    r[j] = part[0][lane][j];
#pragma unroll
    for (int v = 1; v < MAXW; ++v)
      if (v < nw) r[j] += part[v][lane][j];
  }
#if GEMV_RSCALE
  float inv[2];
  rscale_factors(inv, rs_buf, rs_inv, M, rs_K, rs_eps);
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] *= inv[j & 1];
#endif
#if GEMV_GLU
  (void)y_f32;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = 2 * t + j;
    if (n0 + g + 8 < N && m < M) {
      const float gate = act_round(r[j]), up = act_round(r[j + 2]);
      ((act*)y)[m * y_stride + n0 / 2 + g] = to_act(GEMV_GLU == 1 ? silu_mul_f(gate, up) : gelu_mul_f(gate, up));
    }
  }
#elif GEMV_HWOUT
  (void)y_f32;
  float h[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), m = 2 * t + (j & 1);
    h[j] = 0.0f;
    if (n < N && m < M) {
      act* const rp = hw_rr + m * hw_rr_stride + n;
#if HW_EARLY
      h[j] = act_round(act_round(r[j]) + act_f32((act)(hwe[j >> 1] >> (16 * (j & 1)))));
      *rp = to_act(h[j]);
      ((act*)y)[m * y_stride + n] = to_act(h[j] * act_f32((act)(hwe[2] >> (j >= 2 ? 16 : 0))));
#else
      (void)hwe;
      h[j] = act_round(act_round(r[j]) + act_f32(*rp));
      *rp = to_act(h[j]);
      ((act*)y)[m * y_stride + n] = to_act(h[j] * act_f32(hw_w[n]));
#endif
    }
  }
  // sumsq16: per row, lane g's fmaf(h[g + 8], h[g + 8], h[g] * h[g]), then the xor tree over g
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float q = fmaf(h[e + 2], h[e + 2], h[e] * h[e]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (g == 0 && 2 * t + e < M) hw_parts[(2 * t + e) * hw_parts_stride + n0 / 16] = q;
  }
#else
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), m = 2 * t + (j & 1);
    if (n < N && m < M) {
      if (y_f32) ((float*)y)[m * y_stride + n] = r[j];
      else ((act*)y)[m * y_stride + n] = to_act(r[j]);
#if GEMV_CATCHUP
      rr[m * rr_stride + n] = (act)(cu[j >> 1] >> (16 * (j & 1)));
#endif
    }
  }
#endif
  }
#if GEMV_NORM
  __shared__ u32 last;
  __shared__ float scratch[32];
  __threadfence();  // this block's stores of y reach L2 before it is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every other block's y is visible (read through L2 below)
  for (int m = 0; m < M; ++m)
    rmsnorm_row<true>((const act*)y + m * y_stride, residual + m * res_stride, norm_w, normed + m * normed_stride, N,
                      eps, norm_nt, scratch);
  if (threadIdx.x == 0) *counter = 0u;  // every block has counted: ready for the next launch
#endif
}
