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
// Split-K: a token's n keys (from its window's first), when more than SPLIT_MIN, are cut into
// min(MAX_SPLIT, ceil(n / partition)) equal partitions (grid z; `partition` is the least a partition
// holds), so a mid-length context spreads over several blocks and a long one over at most MAX_SPLIT;
// one of at most SPLIT_MIN keys is one block's (cheaper than a combine launch). With one partition the block
// writes `out` itself; otherwise it writes its normalized partial output and (max, sum) and
// paged_attention_combine merges them in partition order. The cut depends only on the token's own
// n_keys, and every reduction has a fixed order, so a token's result does not depend on the other
// tokens in the batch.
// -DROPE_KV=1 (decode only, bf16/fp32 caches, rotary_dim == head_dim, no q/k norms): the kernel also
// does rope_kv.cu's work for its token, one launch instead of two: every block rotates its query
// heads as it loads them (q itself is left as it was), and the block of the token's last partition
// (the one that reads the newest key) rotates the new k of its kv head and stores it and v at
// slots[t] before it reads the cache. The values are rope_kv_write's (common.cuh rope_lo / rope_hi,
// rounded to act), so the output is bit-equal to rope_kv_write + paged_attention. Only where a
// token's keys are all in the cache before the step or its own (not speculative verification).
#include "common.cuh"
#include "attention_split.cuh"
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
#ifndef ROPE_KV
#define ROPE_KV 0
#endif
#if ROPE_KV && KV_QUANT
#error "ROPE_KV writes act caches: a compressed cache takes rope_kv_write + kv_quantize_write"
#endif
#if ROPE_KV
typedef kv_t* kv_ptr;  // written, then read, by the same kernel: not through the read-only path
#else
typedef const kv_t* __restrict__ kv_ptr;
#endif
#ifndef MAX_SPLIT
#error "compile with -DMAX_SPLIT=<most partitions of one token's keys>"
#endif
#ifndef SPLIT_MIN
#error "compile with -DSPLIT_MIN=<most keys of a context that is not cut>"
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(GQA * HEAD_DIM <= 2048, "GQA * HEAD_DIM too large for registers and shared memory");
// KL lanes share one key row (KPW keys per warp at a time): as few as the registers allow (a lane
// holds 2 * GQA query and accumulator slices and two keys' K and V slices, (2 GQA + 4) * D / KL
// floats), so a warp has several rows in flight and a score takes log2(KL) shuffles, not 5.
#define KV_FLOATS ((2 * GQA + 4) * HEAD_DIM)
#ifndef KL
#define KL (KV_FLOATS <= 200 * 8 ? 8 : KV_FLOATS <= 200 * 16 ? 16 : 32)
#endif
#define KPW (32 / KL)
#define EPK (HEAD_DIM / KL)      // elements of a row per lane
#define CE (EPK < 8 ? EPK : 8)   // per load: chunk c of lane sl is elements (c * KL + sl) * CE ..
#define NCH (EPK / CE)
#define NSLOT (NWARPS * KPW)     // keys in flight per block and step
static_assert(NCH == 1 || NCH % 2 == 0, "a lane's chunks pair up for RoPE (ROPE_KV)");

// A lane's chunks of a row of activations (q) -> floats.
__device__ __forceinline__ void load_slice(const act* row, int sl, float* f) {
#pragma unroll
  for (int c = 0; c < NCH; ++c) load_act<CE>(row + (c * KL + sl) * CE, f + c * CE);
}

// A lane's chunks of cache row `row` (page * page_size + slot, times Hkv, plus the kv head).
__device__ __forceinline__ void load_kv(const kv_t* cache, const u16* scales, i64 row, int sl, float* f) {
#if KV_QUANT
  const float sc = f16_to_f32(scales[row]);
  const u8* p = cache + row * HEAD_DIM;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    u8 b[CE];
    if constexpr (CE == 8) *(uint2*)b = *(const uint2*)(p + (c * KL + sl) * CE);
    else if constexpr (CE == 4) *(u32*)b = *(const u32*)(p + (c * KL + sl) * CE);
    else *(u16*)b = *(const u16*)(p + (c * KL + sl) * CE);
#pragma unroll
    for (int e = 0; e < CE; ++e) f[c * CE + e] = kv_decode(b[e]) * sc;
  }
#else
  load_slice(cache + row * HEAD_DIM, sl, f);
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

// Score soft-capping (Gemma 2 style); softcap <= 0: none.
__device__ __forceinline__ float cap_score(float s, float softcap) {
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

// Sum over the KL lanes of a key group (a fixed butterfly: every lane of the group gets the same value).
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = KL / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// exp(m - M) for an online-softmax state's max m under a new max M; 0 for a state without keys.
__device__ __forceinline__ float rescale(float m, float M) { return m == NEG_INF ? 0.0f : expf(m - M); }

// Grid: (Hkv, T, max_parts); block: NWARPS warps. A block serves all GQA query heads of one kv
// head, so each K/V row is read once for the group. Key slot j = warp * KPW + (lane / KL) takes
// keys k0 + j, k0 + j + NSLOT, ... two per step, with its own online-softmax state; at the end the
// slots of a warp merge by shuffles and the warps in shared memory, in a fixed order.
extern "C" __global__ void __launch_bounds__(NWARPS * 32)
paged_attention(const act* __restrict__ q, i64 q_stride, kv_ptr k_cache, kv_ptr v_cache, const u16* __restrict__ k_scale, const u16* __restrict__ v_scale,
                const i32* __restrict__ block_tables, int max_pages,
                const i32* __restrict__ cu_seqlens, const i32* __restrict__ lens, int num_seqs,
                act* __restrict__ out, i64 out_stride, float* __restrict__ part_out,
                float* __restrict__ part_ml, int max_parts, int Hkv, int page_size, int partition,
                float scale, int window, float softcap
#if ROPE_KV
                , const act* __restrict__ k_new, i64 k_stride, const act* __restrict__ v_new, i64 v_stride,
                const float* __restrict__ cos_t, const float* __restrict__ sin_t, const i32* __restrict__ positions,
                const i32* __restrict__ slots
#endif
) {
  PDL_ENTRY();
  __shared__ float sm_acc[NWARPS][GQA][HEAD_DIM];
  __shared__ float sm_m[NWARPS][GQA];
  __shared__ float sm_l[NWARPS][GQA];
  const int kvh = blockIdx.x, t = blockIdx.y, part = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / KL, sl = lane % KL;
  const int Hq = Hkv * GQA;
  int b;
  const int n_keys = token_keys(t, cu_seqlens, lens, num_seqs, &b);
  const int first = first_key(n_keys, window);
  const int size = split_size(n_keys - first, partition);
  const int nparts = (n_keys - first + size - 1) / size;
  if (n_keys <= 0) {  // an empty context (padding lane): write zeros, not garbage
    if (part == 0)
      for (int i = threadIdx.x; i < GQA * HEAD_DIM; i += blockDim.x)
        out[t * out_stride + (i64)(kvh * GQA) * HEAD_DIM + i] = 0;
    return;
  }
  if (part >= nparts) return;
  const int k0 = first + part * size;
  const int k1 = min(n_keys, k0 + size);

  float qf[GQA][EPK], acc[GQA][EPK], m[GQA], l[GQA];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    load_slice(q + t * q_stride + (i64)(kvh * GQA + g) * HEAD_DIM, sl, qf[g]);
    m[g] = NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < EPK; ++e) acc[g][e] = 0.0f;
  }
#if ROPE_KV
  {
    // slot (c, j) of a lane's slice is element i = (c KL + sl) CE + j; its RoPE partner i +- D/2 is
    // chunk c +- NCH/2 of the same lane (NCH >= 2), or the same chunk of lane sl ^ KL/2 (NCH == 1)
    constexpr int HALF = HEAD_DIM / 2;
    const int pos = positions[t];
    const float* cr = cos_t + (i64)pos * HALF;
    const float* sr = sin_t + (i64)pos * HALF;
    auto rotate = [&](float* f) {  // every lane of the warp calls it (shuffles)
      if constexpr (NCH >= 2) {
#pragma unroll
        for (int c = 0; c < NCH / 2; ++c)
#pragma unroll
          for (int j = 0; j < CE; ++j) {
            const int i = (c * KL + sl) * CE + j;
            const float x = f[c * CE + j], y = f[(c + NCH / 2) * CE + j];
            f[c * CE + j] = act_round(rope_lo(x, y, cr[i], sr[i]));
            f[(c + NCH / 2) * CE + j] = act_round(rope_hi(x, y, cr[i], sr[i]));
          }
      } else {
        const bool low = sl < KL / 2;
#pragma unroll
        for (int j = 0; j < CE; ++j) {
          const int i = (sl % (KL / 2)) * CE + j;
          const float other = __shfl_xor_sync(0xffffffffu, f[j], KL / 2);
          f[j] = act_round(low ? rope_lo(f[j], other, cr[i], sr[i]) : rope_hi(other, f[j], cr[i], sr[i]));
        }
      }
    };
#pragma unroll
    for (int g = 0; g < GQA; ++g) rotate(qf[g]);
    const i32 slot = slots[t];
    if (part == nparts - 1 && slot >= 0 && warp == 0) {  // the newest key and value into the cache
      float kf[EPK], vf[EPK];
      load_slice(k_new + t * k_stride + (i64)kvh * HEAD_DIM, sl, kf);
      rotate(kf);
      if (sub == 0) {
        load_slice(v_new + t * v_stride + (i64)kvh * HEAD_DIM, sl, vf);
        const i64 row = ((i64)slot * Hkv + kvh) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          store_act<CE>(k_cache + row + (c * KL + sl) * CE, kf + c * CE);
          store_act<CE>(v_cache + row + (c * KL + sl) * CE, vf + c * CE);
        }
      }
    }
    __syncthreads();  // the block's own stores are visible to its warps after the barrier
  }
#endif
  const i32* table = block_tables + (i64)b * max_pages;
  // Two keys per slot and step (2 * NSLOT rows of the block in flight); the loop bound is the
  // warp's, so every lane takes part in the group shuffles, and a slot past k1 loads nothing.
  for (int base = k0 + warp * KPW; base < k1; base += 2 * NSLOT) {
    const int sa = base + sub, sb = sa + NSLOT;
    const bool va_ok = sa < k1, vb_ok = sb < k1;
    float ka[EPK], va[EPK], kb[EPK], vb[EPK];
#pragma unroll
    for (int e = 0; e < EPK; ++e) ka[e] = va[e] = kb[e] = vb[e] = 0.0f;
    if (va_ok) {
      const i64 row = ((i64)table[sa / page_size] * page_size + sa % page_size) * Hkv + kvh;
      load_kv(k_cache, k_scale, row, sl, ka);
      load_kv(v_cache, v_scale, row, sl, va);
    }
    if (vb_ok) {
      const i64 row = ((i64)table[sb / page_size] * page_size + sb % page_size) * Hkv + kvh;
      load_kv(k_cache, k_scale, row, sl, kb);
      load_kv(v_cache, v_scale, row, sl, vb);
    }
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      float da = 0.0f, db = 0.0f;
#pragma unroll
      for (int e = 0; e < EPK; ++e) {
        da += qf[g][e] * ka[e];
        db += qf[g][e] * kb[e];
      }
      da = group_sum(da);
      db = group_sum(db);
      const float s1 = va_ok ? cap_score(da * scale, softcap) : NEG_INF;
      const float s2 = vb_ok ? cap_score(db * scale, softcap) : NEG_INF;
      const float m_new = fmaxf(m[g], fmaxf(s1, s2));
      if (m_new == NEG_INF) continue;  // this slot has seen no key yet
      const float corr = rescale(m[g], m_new), p1 = expf(s1 - m_new), p2 = expf(s2 - m_new);
      l[g] = l[g] * corr + p1 + p2;
#pragma unroll
      for (int e = 0; e < EPK; ++e) acc[g][e] = acc[g][e] * corr + p1 * va[e] + p2 * vb[e];
      m[g] = m_new;
    }
  }
  // Merge the warp's KPW slots (butterfly: both partners compute the same sums).
#pragma unroll
  for (int o = KL; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float M = fmaxf(m[g], mo), c = rescale(m[g], M), co = rescale(mo, M);
      l[g] = l[g] * c + lo * co;
#pragma unroll
      for (int e = 0; e < EPK; ++e) acc[g][e] = acc[g][e] * c + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * co;
      m[g] = M;
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
      for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int e = 0; e < CE; ++e) sm_acc[warp][g][(c * KL + sl) * CE + e] = acc[g][c * CE + e];
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
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
      const float c = rescale(sm_m[w][g], M);
      L += sm_l[w][g] * c;
      A += sm_acc[w][g][d] * c;
    }
    write_partition(out, out_stride, part_out, part_ml, t, Hq, kvh * GQA + g, max_parts, part, nparts, HEAD_DIM, d, A,
                    L, M);
  }
}

// Merge a token's partitions in partition order. Grid: (Hq, T); block: HEAD_DIM threads.
// part_out [T, Hq, max_parts, D] fp32 (normalized partials), part_ml [T, Hq, max_parts, 2].
extern "C" __global__ void paged_attention_combine(const float* __restrict__ part_out,
                                                   const float* __restrict__ part_ml,
                                                   const i32* __restrict__ cu_seqlens, const i32* __restrict__ lens,
                                                   int num_seqs, act* __restrict__ out, i64 out_stride,
                                                   int max_parts, int partition, int window) {
  PDL_ENTRY();
  const int head = blockIdx.x, t = blockIdx.y, Hq = gridDim.x;
  int b;
  const int n_keys = token_keys(t, cu_seqlens, lens, num_seqs, &b);
  const int n = n_keys - first_key(n_keys, window), size = split_size(n, partition);
  const int nparts = (n + size - 1) / size;
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
