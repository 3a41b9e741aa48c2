// Paged attention, one kernel for decode and prefill: every query token attends the keys
// 0..n_keys-1 of its own sequence, read from the paged cache. Compiled per shape with
// -DHEAD_DIM=.. -DGQA=.. (query heads per kv head).
//   q [T, Hq, D] act (token stride q_stride), out [T, Hq, D] act (token stride out_stride)
//   k_cache/v_cache [num_pages, page_size, Hkv, D] act (act: bf16, or fp32 with -DACT_F32=1); block_tables [B, max_pages] int32
//   -DKV_QUANT=1: the caches hold u8 codes (int8, or e4m3 with -DKV_FP8=1; kv_codes.cuh) and
//   k_scale/v_scale [num_pages, page_size, Hkv] f16 one scale per token and head; each K/V row is
//   decoded and scaled as it is read (the compressed cache is read directly, never expanded)
//   decode  (cu_seqlens == nullptr): token t is sequence t, n_keys = lens[t] (context length)
//   prefill (cu_seqlens [B+1]):      token t of sequence b sits at position
//            lens[b] + (t - cu_seqlens[b]) (lens = start_pos) and sees keys 0..that position.
// window > 0 (sliding-window layers): a token sees only its last `window` keys (its own
// included), keys n_keys - window .. n_keys - 1. softcap > 0: each score s -> softcap * tanh(s / softcap).
// Split-K: a token's keys (from its window's first) are cut into partitions of `partition` keys (grid z). With one
// partition the block writes `out` itself; otherwise it writes its normalized partial output and
// (max, sum) and paged_attention_combine merges them in partition order. The cut depends only on
// the token's own n_keys, and every reduction has a fixed order, so a token's result does not
// depend on the other tokens in the batch.
#include "common.cuh"
#ifndef KV_QUANT
#define KV_QUANT 0
#endif
#if KV_QUANT
#include "kv_codes.cuh"
typedef u8 kv_t;
#else
typedef act kv_t;
#endif

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=64|128|256"
#endif
#ifndef GQA
#error "compile with -DGQA=<query heads per kv head>"
#endif
#define EPL (HEAD_DIM / 32)  // elements per lane
#define NWARPS 4
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(GQA * HEAD_DIM <= 2048, "GQA * HEAD_DIM too large for registers and shared memory");

// A lane's EPL contiguous activations -> floats, coalesced across the warp.
__device__ __forceinline__ void load_lane(const act* p, float* f) { load_act<EPL>(p, f); }

// A lane's EPL elements of cache row `row` (page * page_size + slot, times Hkv, plus the kv head).
__device__ __forceinline__ void load_kv(const kv_t* cache, const u16* scales, i64 row, int lane, float* f) {
#if KV_QUANT
  const float sc = f16_to_f32(scales[row]);
  const u8* p = cache + row * HEAD_DIM + lane * EPL;
#pragma unroll
  for (int e = 0; e < EPL; ++e) f[e] = kv_decode(p[e]) * sc;
#else
  load_lane(cache + row * HEAD_DIM + lane * EPL, f);
#endif
}

// Which sequence token t belongs to and how many keys it sees.
__device__ __forceinline__ int token_keys(int t, const i32* cu_seqlens, const i32* lens, int num_seqs, int* seq) {
  if (!cu_seqlens) {
    *seq = t;
    return lens[t];
  }
  int b = 0;
  while (b + 1 < num_seqs && cu_seqlens[b + 1] <= t) ++b;
  *seq = b;
  return lens[b] + (t - cu_seqlens[b]) + 1;
}

// The first key a token sees: 0, or the first of its window.
__device__ __forceinline__ int first_key(int n_keys, int window) { return window > 0 ? max(0, n_keys - window) : 0; }

// Score soft-capping (Gemma 2 style); softcap <= 0: none.
__device__ __forceinline__ float cap_score(float s, float softcap) {
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

// Online-softmax update of one head's state with one key's score and value row.
__device__ __forceinline__ void softmax_update(float s, const float* v, float& m, float& l, float* acc) {
  const float m_new = fmaxf(m, s);
  const float corr = expf(m - m_new);  // m == -inf on the first key: corr = 0, acc is 0 anyway
  const float p = expf(s - m_new);
  l = l * corr + p;
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = acc[e] * corr + p * v[e];
  m = m_new;
}

// Grid: (Hkv, T, max_parts); block: NWARPS warps. A block serves all GQA query heads of one
// kv head, so each K/V row is read once for the group. Warp w takes keys k0+w, k0+w+NWARPS, ...
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_attention(const act* __restrict__ q, i64 q_stride, const kv_t* __restrict__ k_cache,
                const kv_t* __restrict__ v_cache, const u16* __restrict__ k_scale, const u16* __restrict__ v_scale,
                const i32* __restrict__ block_tables, int max_pages,
                const i32* __restrict__ cu_seqlens, const i32* __restrict__ lens, int num_seqs,
                act* __restrict__ out, i64 out_stride, float* __restrict__ part_out,
                float* __restrict__ part_ml, int max_parts, int Hkv, int page_size, int partition,
                float scale, int window, float softcap) {
  __shared__ float sm_acc[NWARPS][GQA][HEAD_DIM];
  __shared__ float sm_m[NWARPS][GQA];
  __shared__ float sm_l[NWARPS][GQA];
  const int kvh = blockIdx.x, t = blockIdx.y, part = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Hq = Hkv * GQA;
  int b;
  const int n_keys = token_keys(t, cu_seqlens, lens, num_seqs, &b);
  const int first = first_key(n_keys, window);
  const int nparts = (n_keys - first + partition - 1) / partition;
  if (n_keys <= 0) {  // an empty context (padding lane): write zeros, not garbage
    if (part == 0)
      for (int i = threadIdx.x; i < GQA * HEAD_DIM; i += blockDim.x)
        out[t * out_stride + (i64)(kvh * GQA) * HEAD_DIM + i] = 0;
    return;
  }
  if (part >= nparts) return;
  const int k0 = first + part * partition;
  const int k1 = min(n_keys, k0 + partition);

  float qf[GQA][EPL], acc[GQA][EPL], m[GQA], l[GQA];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    load_lane(q + t * q_stride + (i64)(kvh * GQA + g) * HEAD_DIM + lane * EPL, qf[g]);
    m[g] = NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
  }
  const i32* table = block_tables + (i64)b * max_pages;
  // Two keys per iteration so two K/V row loads are in flight; updates stay in key order.
  for (int s = k0 + warp; s < k1; s += 2 * NWARPS) {
    const int s2 = s + NWARPS;
    const bool two = s2 < k1;
    float ka[EPL], va[EPL], kb[EPL], vb[EPL];
    {
      const i64 row = ((i64)table[s / page_size] * page_size + s % page_size) * Hkv + kvh;
      load_kv(k_cache, k_scale, row, lane, ka);
      load_kv(v_cache, v_scale, row, lane, va);
    }
    if (two) {
      const i64 row = ((i64)table[s2 / page_size] * page_size + s2 % page_size) * Hkv + kvh;
      load_kv(k_cache, k_scale, row, lane, kb);
      load_kv(v_cache, v_scale, row, lane, vb);
    }
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      float d = 0.0f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) d += qf[g][e] * ka[e];
      softmax_update(cap_score(warp_sum(d) * scale, softcap), va, m[g], l[g], acc[g]);
    }
    if (two) {
#pragma unroll
      for (int g = 0; g < GQA; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) d += qf[g][e] * kb[e];
        softmax_update(cap_score(warp_sum(d) * scale, softcap), vb, m[g], l[g], acc[g]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) sm_acc[warp][g][lane * EPL + e] = acc[g][e];
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  // Merge the warps in warp order. Warp 0 always saw key k0, so M is finite.
  for (int i = threadIdx.x; i < GQA * HEAD_DIM; i += blockDim.x) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, sm_m[w][g]);
    float L = 0.0f, A = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      const float c = expf(sm_m[w][g] - M);
      L += sm_l[w][g] * c;
      A += sm_acc[w][g][d] * c;
    }
    const int head = kvh * GQA + g;
    if (nparts == 1) {
      out[t * out_stride + (i64)head * HEAD_DIM + d] = to_act(A / L);
    } else {
      const i64 p = ((i64)t * Hq + head) * max_parts + part;
      part_out[p * HEAD_DIM + d] = A / L;
      if (d == 0) {
        part_ml[p * 2] = M;
        part_ml[p * 2 + 1] = L;
      }
    }
  }
}

// Merge a token's partitions in partition order. Grid: (Hq, T); block: HEAD_DIM threads.
// part_out [T, Hq, max_parts, D] fp32 (normalized partials), part_ml [T, Hq, max_parts, 2].
extern "C" __global__ void paged_attention_combine(const float* __restrict__ part_out,
                                                   const float* __restrict__ part_ml,
                                                   const i32* __restrict__ cu_seqlens, const i32* __restrict__ lens,
                                                   int num_seqs, act* __restrict__ out, i64 out_stride,
                                                   int max_parts, int partition, int window) {
  const int head = blockIdx.x, t = blockIdx.y, Hq = gridDim.x;
  int b;
  const int n_keys = token_keys(t, cu_seqlens, lens, num_seqs, &b);
  const int nparts = (n_keys - first_key(n_keys, window) + partition - 1) / partition;
  if (nparts <= 1) return;  // written by paged_attention directly
  const i64 base = ((i64)t * Hq + head) * max_parts;
  float M = NEG_INF;
  for (int p = 0; p < nparts; ++p) M = fmaxf(M, part_ml[(base + p) * 2]);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float num = 0.0f, den = 0.0f;
    for (int p = 0; p < nparts; ++p) {
      const float w = expf(part_ml[(base + p) * 2] - M) * part_ml[(base + p) * 2 + 1];
      num += w * part_out[(base + p) * HEAD_DIM + d];
      den += w;
    }
    out[t * out_stride + (i64)head * HEAD_DIM + d] = to_act(num / den);
  }
}
