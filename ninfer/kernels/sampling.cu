// On-device sampling, one block per sequence (SAMPLE_THREADS threads, fixed, so the reduction
// order is fixed). This is the one definition of ninfer's sampler; ninfer/engine/sampler.py
// computes the same on the host (same candidates, same float32 arithmetic, same Philox draw).
// Per row b:
//   logit'[i] = logit[i] - fadd(presence[b] * (count[b, i] > 0), fmul(frequency[b], count[b, i]))
//   (counts: the sequence's generated-token counts, int32 [B, V]; nullptr means no penalties;
//   explicit roundings, so no FMA contraction makes it differ from the host)
//   logit'[i] = -inf where bit (i & 31) of masks[b, i >> 5] is clear (XGrammar's packed int32
//   bitmask [B, ceil(V/32)]; rows without a grammar have every bit set), and where logit[i] is NaN
//   candidates = the top_k[b] (<= 20) largest logit', ties broken by the lower token id
//   temperature[b] <= 0: the token is candidate 0 (greedy argmax, lowest id on ties)
//   otherwise, in float32: p_j = exp((logit'_j - logit'_0) / T) over the candidates (0 for -inf),
//   total = p_0 + p_1 + ... (sequential); keep the shortest prefix whose running mass reaches
//   top_p * total (at least one), stopping early at the first p_j < min_p * p_0; draw
//   c = Philox4x32-10(key = (seed lo, seed hi), counter = (step lo, step hi, 0, 0)),
//   u = (c[0] >> 8) * 2^-24; the token is the first kept candidate whose running sum exceeds
//   u * kept mass (the last kept one if none does).
// Writes tokens [B] int32.
//
// SAMPLE_PHASE (the same tokens in every mode: candidates are the top k under one total order, value then
// lowest id, and the top k of a row is the top k of its parts' top k's):
//   0: one block a row scans it and samples;
//   1: block (b, s) scans part s of row b's loads (nparts parts) and writes its candidates to
//      part_v / part_i [B, nparts, TOPK_MAX] (NO_ID past the row's end);
//   2: one block a row merges its parts' candidates and samples.
// One block reads a 128k-vocabulary row at one SM's pace; split over parts, the row streams from all SMs.
#include "common.cuh"

#define SAMPLE_THREADS 512
#define SAMPLE_UNROLL 8
#ifndef SAMPLE_VEC
#define SAMPLE_VEC 0  // 1: four logits (and counts) a load; V % 4 == 0 and 16-byte aligned rows (the launcher's check)
#endif
#define TOPK_MAX 20
#define NO_ID 0x7fffffff
#ifndef SAMPLE_PHASE
#define SAMPLE_PHASE 0
#endif

__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const u32 lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
    const u32 lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
    const u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
  }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_tokens(const float* __restrict__ logits, i64 logits_stride, int V, const i32* __restrict__ masks,
              i64 masks_stride, const i32* __restrict__ counts,
              i64 counts_stride, const float* __restrict__ presence, const float* __restrict__ frequency,
              const float* __restrict__ temperature, const i32* __restrict__ top_k,
              const float* __restrict__ top_p, const float* __restrict__ min_p, const i64* __restrict__ seeds,
              const i64* __restrict__ steps, i32* __restrict__ tokens
#if SAMPLE_PHASE
              , float* __restrict__ part_v, i32* __restrict__ part_i, int nparts
#endif
              ) {
  PDL_ENTRY();
  __shared__ float red_v[SAMPLE_THREADS / 32];
  __shared__ int red_i[SAMPLE_THREADS / 32];
  __shared__ float cand_v[TOPK_MAX];
  __shared__ int cand_i[TOPK_MAX];
  const int b = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float temp = temperature[b];
  const int k = temp <= 0.0f ? 1 : max(1, min(top_k[b], TOPK_MAX));
  const float pres = counts ? presence[b] : 0.0f, freq = counts ? frequency[b] : 0.0f;
  const float* row = logits + b * logits_stride;
  const i32* crow = counts ? counts + b * counts_stride : nullptr;
  const u32* mrow = (const u32*)masks + b * masks_stride;

  // Each thread's own top-k of its strided share, sorted best first.
  float lv[TOPK_MAX];
  int li[TOPK_MAX];
  int cnt = 0;
#if SAMPLE_VEC
  // lv[k - 1], li[k - 1] once the top-k is full, kept in registers: the common case (a logit that does
  // not enter) then reads no local memory (lv and li are indexed at run time, so they live there)
  float kv = NEG_INF;
  int ki = NO_ID;
#define KTH_V kv
#define KTH_I ki
#else
#define KTH_V lv[k - 1]
#define KTH_I li[k - 1]
#endif
  // a candidate (value v, id i) into this thread's top-k
  auto insert = [&](float v, int i) {
    if (cnt == k && !better(v, i, KTH_V, KTH_I)) return;
    int j = cnt < k ? cnt++ : k - 1;
    while (j > 0 && better(v, i, lv[j - 1], li[j - 1])) {
      lv[j] = lv[j - 1];
      li[j] = li[j - 1];
      --j;
    }
    lv[j] = v;
    li[j] = i;
#if SAMPLE_VEC
    if (cnt == k) {
      kv = j == k - 1 ? v : lv[k - 1];
      ki = j == k - 1 ? i : li[k - 1];
    }
#endif
  };
#undef KTH_V
#undef KTH_I
  // one logit (id i, generated count c, its mask word): penalties, NaN and the mask, then insert
  auto consider = [&](float v, int i, int c, u32 word) {
    if (v != v) v = NEG_INF;
    if (crow) v = __fsub_rn(v, __fadd_rn(c > 0 ? pres : 0.0f, __fmul_rn(freq, (float)c)));
    if (!((word >> (i & 31)) & 1u)) v = NEG_INF;
    insert(v, i);
  };
  // SAMPLE_UNROLL loads per thread are issued before any value is compared, so the loads overlap (the
  // scan is otherwise one dependent global load per element); which thread sees an element, and in
  // which order, does not matter: a thread's top-k and the merge below order by value, then lowest id
#if SAMPLE_VEC
  typedef float4 vals_t;  // a load: ids 4q .. 4q + 3, one mask word for all four (V % 4 == 0)
  typedef int4 counts_t;
  constexpr int W = 4;
#else
  typedef float vals_t;
  typedef int counts_t;
  constexpr int W = 1;
#endif
#if SAMPLE_PHASE == 2
  (void)consider;
  // the parts' candidates (k a part, NO_ID padding skipped) in place of the row's logits
  for (int j = threadIdx.x; j < nparts * k; j += SAMPLE_THREADS) {
    const i64 at = ((i64)b * nparts + j / k) * TOPK_MAX + j % k;
    const int id = part_i[at];
    if (id != NO_ID) insert(part_v[at], id);
  }
#else
  const int loads = V / W;
#if SAMPLE_PHASE == 1
  const int per = (loads + nparts - 1) / nparts;  // this block's loads: [lo, hi)
  const int lo = blockIdx.y * per, hi = min(loads, lo + per);
#else
  const int lo = 0, hi = loads;
#endif
  for (int base = lo + threadIdx.x; base < hi; base += SAMPLE_THREADS * SAMPLE_UNROLL) {
    vals_t vals[SAMPLE_UNROLL];
    u32 bits[SAMPLE_UNROLL];
    counts_t cs[SAMPLE_UNROLL];
#pragma unroll
    for (int u = 0; u < SAMPLE_UNROLL; ++u) {
      const int q = base + u * SAMPLE_THREADS;
      vals[u] = q < hi ? ((const vals_t*)row)[q] : vals_t{};
      bits[u] = q < hi ? mrow[(q * W) >> 5] : 0u;
      cs[u] = crow && q < hi ? ((const counts_t*)crow)[q] : counts_t{};
    }
#pragma unroll
    for (int u = 0; u < SAMPLE_UNROLL; ++u) {
      const int q = base + u * SAMPLE_THREADS;
      if (q >= hi) break;
#if SAMPLE_VEC
      consider(vals[u].x, 4 * q, cs[u].x, bits[u]);
      consider(vals[u].y, 4 * q + 1, cs[u].y, bits[u]);
      consider(vals[u].z, 4 * q + 2, cs[u].z, bits[u]);
      consider(vals[u].w, 4 * q + 3, cs[u].w, bits[u]);
#else
      consider(vals[u], q, cs[u], bits[u]);
#endif
    }
  }
#endif
  int head = 0;
  for (int r = 0; r < k; ++r) {
    float v = head < cnt ? lv[head] : NEG_INF;
    int id = head < cnt ? li[head] : NO_ID;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, id, o);
      if (better(ov, oi, v, id)) { v = ov; id = oi; }
    }
    if (lane == 0) { red_v[warp] = v; red_i[warp] = id; }
    __syncthreads();
    if (threadIdx.x == 0) {
      float bv = red_v[0];
      int bi = red_i[0];
      for (int w = 1; w < SAMPLE_THREADS / 32; ++w)
        if (better(red_v[w], red_i[w], bv, bi)) { bv = red_v[w]; bi = red_i[w]; }
      cand_v[r] = bv;
      cand_i[r] = bi;
    }
    __syncthreads();
    if (head < cnt && li[head] == cand_i[r]) ++head;
  }
#if SAMPLE_PHASE == 1
  if (threadIdx.x < k) {
    const i64 at = ((i64)b * nparts + blockIdx.y) * TOPK_MAX + threadIdx.x;
    part_v[at] = cand_v[threadIdx.x];
    part_i[at] = cand_i[threadIdx.x];
  }
  return;
#endif
  if (threadIdx.x != 0) return;
  int n = k;
  while (n > 1 && cand_i[n - 1] == NO_ID) --n;  // V < k
  if (temp <= 0.0f || n == 1) {
    tokens[b] = cand_i[0];
    return;
  }
  float p[TOPK_MAX];
  float total = 0.0f;
  for (int j = 0; j < n; ++j) {
    p[j] = cand_v[j] == NEG_INF ? 0.0f : expf((cand_v[j] - cand_v[0]) / temp);
    total += p[j];
  }
  const float tp = top_p[b], mp = min_p[b];
  int keep = 1;
  float mass = p[0];
  while (keep < n && mass < tp * total && p[keep] >= mp * p[0]) mass += p[keep++];
  u32 c[4] = {(u32)steps[b], (u32)((u64)steps[b] >> 32), 0u, 0u};
  philox4x32_10(c, (u32)seeds[b], (u32)((u64)seeds[b] >> 32));
  const float target = (float)(c[0] >> 8) * (1.0f / 16777216.0f) * mass;
  float run = 0.0f;
  int pick = keep - 1;
  for (int j = 0; j < keep; ++j) {
    run += p[j];
    if (run > target) { pick = j; break; }
  }
  tokens[b] = cand_i[pick];
}
