// Row-wise kernels: embedding gather (act and groupwise int8/int4 tables), RMSNorm fused
// with the residual add, SwiGLU. Activations in and out (`act`: bf16, or fp32 with ACT_F32),
// fp32 math; 8 activations a vector (launchers check hidden % 8 == 0 and 16-byte aligned rows).
#include "common.cuh"

// An id outside [0, V) writes NaN so the bug shows instead of reading out of bounds.
__device__ __forceinline__ bool bad_id(int id, int V, act* row, int H) {
  if (id >= 0 && id < V) return false;
  const float nan[8] = {NAN_F, NAN_F, NAN_F, NAN_F, NAN_F, NAN_F, NAN_F, NAN_F};
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) store_act<8>(row + i * 8, nan);
  return true;
}

// out[t, :] = table[ids[t], :]; table [V, H] and out [T, H] act. Grid: T blocks.
extern "C" __global__ void embedding(const i32* __restrict__ ids, const act* __restrict__ table,
                                     act* __restrict__ out, int V, int H) {
  PDL_ENTRY();
  const int t = blockIdx.x;
  const int id = ids[t];
  act* dst = out + (i64)t * H;
  if (bad_id(id, V, dst, H)) return;
  const act* src = table + (i64)id * H;
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
    float f[8];
    load_act<8>(src + i * 8, f);
    store_act<8>(dst + i * 8, f);
  }
}

// Groupwise-quantized table (ninfer/engine/quant.py layouts), dequantized to act:
//   kind 0 int8:     q [V, H] int8,       w = q * s
//   kind 1 int4 sym: q [V, H/2] uint8,    w = (q - 8) * s
//   kind 2 int4 asym q [V, H/2] uint8,    w = q * s + m
// scales/mins [V, H/g] f16. Each thread makes 8 outputs (g % 8 == 0, so one group).
extern "C" __global__ void embedding_quant(const i32* __restrict__ ids, const u8* __restrict__ q,
                                           const u16* __restrict__ scales, const u16* __restrict__ mins,
                                           act* __restrict__ out, int V, int H, int group_size, int kind) {
  PDL_ENTRY();
  const int t = blockIdx.x;
  const int id = ids[t];
  const int nvec = H / 8;
  act* dst = out + (i64)t * H;
  if (bad_id(id, V, dst, H)) return;
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
    store_act<8>(dst + e, w);
  }
}

// residual == nullptr: out = rmsnorm(x) * w.
// otherwise: residual += x (rounded to act, as an add in that dtype would be), out = rmsnorm(residual) * w.
// x, residual, out [T, H] with row strides; weight [H]; all act. Grid: T blocks. fp32 sum of
// squares in a fixed order, so a row's result never depends on the other rows.
extern "C" __global__ void rmsnorm_residual(const act* __restrict__ x, act* residual, const act* __restrict__ weight,
                                            act* __restrict__ out, int H, i64 x_stride, i64 res_stride,
                                            i64 out_stride, float eps) {
  // the weight (up to 4 vectors a thread: H <= 8192 at 256 threads) is read while the kernel before runs
  PDL_LAUNCH();
  float w[4][8];
  rmsnorm_weights<4>(weight, H, blockDim.x, w);
  PDL_WAIT();
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  rmsnorm_row<false, 4>(x + t * x_stride, residual ? residual + t * res_stride : nullptr, weight, out + t * out_stride,
                        H, eps, blockDim.x, scratch, w);
}

// gate_up [T, 2I] -> out [T, I] = act(g) * up, act silu (swiglu) or gelu_tanh (geglu, Gemma's MLP).
// gate = [:, :I], up = [:, I:]; interleaved != 0: the gate and up rows of the projection were
// interleaved in eights (launchers.glu_rows): gate 8v .. 8v + 7 at 16v, the matching up at 16v + 8.
// Grid-stride over T * I/8 vectors.
template <bool GELU>
__device__ __forceinline__ void gated(const act* __restrict__ gate_up, act* __restrict__ out, int T, int I,
                                      i64 in_stride, i64 out_stride, int interleaved) {
  const int nvec = I / 8;
  const i64 total = (i64)T * nvec;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
    const int t = (int)(idx / nvec);
    const int v = (int)(idx % nvec);
    const act* row = gate_up + t * in_stride;
    const act* gp = row + (interleaved ? 16 * v : 8 * v);
    float g[8], u[8];
    load_act<8>(gp, g);
    load_act<8>(interleaved ? gp + 8 : row + I + v * 8, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = GELU ? gelu_mul_f(g[j], u[j]) : silu_mul_f(g[j], u[j]);
    store_act<8>(out + t * out_stride + v * 8, g);
  }
}

extern "C" __global__ void swiglu(const act* __restrict__ gate_up, act* __restrict__ out, int T, int I,
                                  i64 in_stride, i64 out_stride, int interleaved) {
  PDL_ENTRY();
  gated<false>(gate_up, out, T, I, in_stride, out_stride, interleaved);
}

extern "C" __global__ void geglu(const act* __restrict__ gate_up, act* __restrict__ out, int T, int I,
                                 i64 in_stride, i64 out_stride, int interleaved) {
  PDL_ENTRY();
  gated<true>(gate_up, out, T, I, in_stride, out_stride, interleaved);
}
