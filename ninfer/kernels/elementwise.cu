// Row-wise kernels: embedding gather (bf16 and groupwise int8/int4 tables), RMSNorm fused
// with the residual add, SwiGLU. All bf16 in/out with fp32 math; 16-byte vectors where the
// row allows it (launchers check hidden % 8 == 0 and 16-byte aligned rows).
#include "common.cuh"

// out[t, :] = table[ids[t], :]; table [V, H] bf16, out [T, H] bf16. Grid: T blocks.
// An id outside [0, V) writes NaN so the bug shows instead of reading out of bounds.
extern "C" __global__ void embedding_bf16(const i32* __restrict__ ids, const u16* __restrict__ table,
                                          u16* __restrict__ out, int V, int H) {
  const int t = blockIdx.x;
  const int id = ids[t];
  const int nvec = H / 8;
  uint4* dst = (uint4*)(out + (i64)t * H);
  if (id < 0 || id >= V) {
    const uint4 nan = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) dst[i] = nan;
    return;
  }
  const uint4* src = (const uint4*)(table + (i64)id * H);
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) dst[i] = src[i];
}

// Groupwise-quantized table (ninfer/engine/quant.py layouts), dequantized to bf16:
//   kind 0 int8:     q [V, H] int8,       w = q * s
//   kind 1 int4 sym: q [V, H/2] uint8,    w = (q - 8) * s
//   kind 2 int4 asym q [V, H/2] uint8,    w = q * s + m
// scales/mins [V, H/g] f16. Each thread makes 8 outputs (g % 8 == 0, so one group).
extern "C" __global__ void embedding_quant(const i32* __restrict__ ids, const u8* __restrict__ q,
                                           const u16* __restrict__ scales, const u16* __restrict__ mins,
                                           u16* __restrict__ out, int V, int H, int group_size, int kind) {
  const int t = blockIdx.x;
  const int id = ids[t];
  const int nvec = H / 8;
  uint4* dst = (uint4*)(out + (i64)t * H);
  if (id < 0 || id >= V) {
    const uint4 nan = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) dst[i] = nan;
    return;
  }
  const int ngroups = H / group_size;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const int e = i * 8;
    const int grp = e / group_size;
    const float s = f16_to_f32(scales[(i64)id * ngroups + grp]);
    float w[8];
    if (kind == 0) {
      const uint2 raw = *(const uint2*)(q + (i64)id * H + e);
      const u32 words[2] = {raw.x, raw.y};
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = (float)(i8)((words[j >> 2] >> ((j & 3) * 8)) & 0xffu) * s;
    } else {
      const u32 raw = *(const u32*)(q + (i64)id * (H / 2) + e / 2);
      const float m = kind == 2 ? f16_to_f32(mins[(i64)id * ngroups + grp]) : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float qv = (float)((raw >> (j * 4)) & 0xfu);  // element 2j low nibble, 2j+1 high
        w[j] = kind == 1 ? (qv - 8.0f) * s : qv * s + m;
      }
    }
    dst[i] = pack8(w);
  }
}

// residual == nullptr: out = rmsnorm(x) * w.
// otherwise: residual += x (rounded to bf16, as a bf16 add would be), out = rmsnorm(residual) * w.
// x, residual, out [T, H] with row strides; weight [H]. Grid: T blocks. fp32 sum of squares
// in a fixed order, so a row's result never depends on the other rows.
extern "C" __global__ void rmsnorm_residual(const u16* __restrict__ x, u16* residual, const u16* __restrict__ weight,
                                            u16* __restrict__ out, int H, i64 x_stride, i64 res_stride,
                                            i64 out_stride, float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  const int nvec = H / 8;
  const uint4* xr = (const uint4*)(x + t * x_stride);
  uint4* rr = residual ? (uint4*)(residual + t * res_stride) : nullptr;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    float a[8];
    unpack8(xr[i], a);
    if (rr) {
      float r[8];
      unpack8(rr[i], r);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = bf16_to_f32(f32_to_bf16(a[j] + r[j]));
      rr[i] = pack8(a);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += a[j] * a[j];
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
  const uint4* src = rr ? (const uint4*)rr : xr;  // this thread's own writes above: no barrier needed
  const uint4* wr = (const uint4*)weight;
  uint4* orow = (uint4*)(out + t * out_stride);
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    float a[8], w[8];
    unpack8(src[i], a);
    unpack8(wr[i], w);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = a[j] * inv * w[j];
    orow[i] = pack8(a);
  }
}

// gate_up [T, 2I] (gate = [:, :I], up = [:, I:]) -> out [T, I] = silu(gate) * up.
// Grid-stride over T * I/8 vectors.
extern "C" __global__ void swiglu(const u16* __restrict__ gate_up, u16* __restrict__ out, int T, int I,
                                  i64 in_stride, i64 out_stride) {
  const int nvec = I / 8;
  const i64 total = (i64)T * nvec;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int t = (int)(idx / nvec);
    const int v = (int)(idx % nvec);
    const u16* row = gate_up + t * in_stride;
    float g[8], u[8];
    unpack8(((const uint4*)row)[v], g);
    unpack8(((const uint4*)(row + I))[v], u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    ((uint4*)(out + t * out_stride))[v] = pack8(g);
  }
}
