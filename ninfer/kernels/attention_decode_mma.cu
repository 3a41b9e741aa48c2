// Decode attention on tensor cores: one query token per sequence attends its context in the paged
// cache. The same inputs, split-K cut (attention_split.cuh), partial outputs (merged by attention.cu's
// paged_attention_combine), window, soft-capping and ROPE_KV fusion as attention.cu's decode; bf16
// caches (not compressed), head_dim 64 or 128, at most 8 query heads per kv head, pages of a power
// of two keys (page_shift = log2 page_size: no integer division per key).
// Grid (Hkv, T, max_parts), NW warps; a block serves the GQA query heads of one kv head over one
// partition, warp w taking the 16-key steps k0 + 16 (w + NW i). Per step, with m16n8k16 mmas:
//   S = Q K^T:     A = Q (rows: the group's heads, zero past GQA), B = K^T (n: 8 keys), two n-tiles.
//                  The k order inside an mma is free as long as A and B agree, so lane (g, t) reads
//                  8 consecutive dims (one 16-byte load) of its head g and of keys g and 8 + g.
//   O^T += V^T P^T: A = V^T (rows: dims, k: the 16 keys), B = P^T (n: the heads) straight from S's
//                  accumulators (lane (g, t) holds head g's probabilities of keys 2t, 2t+1, 8+2t,
//                  9+2t, which is B's layout). Lane (g, t) reads 8 consecutive dims 64 h + 8 g .. of
//                  those four keys' V rows; rows g and g + 8 of mma i are dims 64 h + 8 g + 2 i and
//                  + 1, so one byte permute per register pairs two keys' values (no transpose, no
//                  shared memory).
// Online softmax in base 2 per head (P rounded to bf16 as the mma takes it, the sum over the rounded
// values); the warps merge in warp order through shared memory. A token's result depends only on its
// own keys and partition (fixed steps, fixed mma order; keys past the partition are clamped reads with
// probability exactly 0), so it is batch-invariant, like attention.cu.
// -DROPE_KV=1: as attention.cu's (q rotated as it is loaded, rounded to bf16; the block of the last
// partition writes the rotated new k and v at slots[t] before any warp reads the cache).
#include "common.cuh"
#include "attention_split.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=64|128"
#endif
#ifndef GQA
#error "compile with -DGQA=<query heads per kv head>"
#endif
#ifndef MAX_SPLIT
#error "compile with -DMAX_SPLIT=<most partitions of one token's keys>"
#endif
#ifndef SPLIT_MIN
#error "compile with -DSPLIT_MIN=<most keys of a context that is not cut>"
#endif
#if ACT_F32
#error "attention_decode_mma takes bf16 activations only"
#endif
#ifndef ROPE_KV
#define ROPE_KV 0
#endif
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(GQA >= 1 && GQA <= 8, "at most 8 query heads per kv head (the mma's n)");

#ifndef ATTN_PF
#define ATTN_PF 0  // > 0: a warp asks L2 for the K and V rows of its step ATTN_PF ahead (speed only)
#endif
// ATTN_EARLY 1 (speed only, the same bits): before the PDL wait, what no kernel of the step writes — the
// context lengths, positions and slots (copied in before the step), the block table — is read, and the
// warp's first 16 keys' K and V rows (older than this step, but for the newest, which L2 takes as written)
// and the RoPE row are asked of L2, so that the wait is followed by L2 hits rather than a chain of
// dependent loads (lens -> table -> K / V).
#ifndef ATTN_EARLY
#define ATTN_EARLY 0
#endif
// a load ATTN_EARLY keeps before the PDL wait: coherent (ptxas moves .nc loads after the wait) and
// volatile (kept in program order with the wait's own volatile asm)
__device__ __forceinline__ int ld_early(const i32* p) {
#if ATTN_EARLY
  int v;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
#else
  return *p;
#endif
}
#ifndef NW
#error "compile with -DNW=<warps per block> (launchers.ATTN_MMA_WARPS: one value per run, it orders the sums)"
#endif
#define D HEAD_DIM
#define KC (D / 32)       // a lane's 16-byte pieces of a K row (dims 32 c + 8 t ..)
#define VG (D / 64)       // a lane's 16-byte pieces of a V row (dims 64 h + 8 g ..)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#if ROPE_KV
typedef act* kv_ptr;  // written, then read, by the same kernel: not through the read-only path
#else
typedef const act* __restrict__ kv_ptr;
#endif

extern "C" __global__ void __launch_bounds__(NW * 32)
paged_attention_decode_mma(const act* __restrict__ q, i64 q_stride, kv_ptr k_cache, kv_ptr v_cache,
                           const i32* __restrict__ block_tables, int max_pages, const i32* __restrict__ lens,
                           act* __restrict__ out, i64 out_stride, float* __restrict__ part_out,
                           float* __restrict__ part_ml, int max_parts, int Hkv, int page_shift, int partition,
                           float scale, int window, float softcap
#if ROPE_KV
                           , const act* __restrict__ k_new, i64 k_stride, const act* __restrict__ v_new, i64 v_stride,
                           const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                           const i32* __restrict__ positions, const i32* __restrict__ slots
#endif
) {
#if ATTN_EARLY
  PDL_LAUNCH();
#else
  PDL_ENTRY();
#endif
  __shared__ float sm_o[NW][GQA][D];
  __shared__ float sm_m[NW][GQA];
  __shared__ float sm_l[NW][GQA];
  const int kvh = blockIdx.x, tok = blockIdx.y, part = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int Hq = Hkv * GQA;
  const int n_keys = ld_early(lens + tok);
  const int first = first_key(n_keys, window);
  const int size = split_size(n_keys - first, partition);
  const int nparts = (n_keys - first + size - 1) / size;
  if (n_keys <= 0) {  // an empty context (padding lane): write zeros, not garbage
#if ATTN_EARLY
    PDL_WAIT();  // out may still be read by a kernel before this one
#endif
    if (part == 0)
      for (int i = threadIdx.x; i < GQA * D; i += blockDim.x) out[tok * out_stride + (i64)(kvh * GQA) * D + i] = 0;
    return;
  }
  if (part >= nparts) return;
  const int k0 = first + part * size;
  const int k1 = min(n_keys, k0 + size);
#if ATTN_EARLY
  {
    const i32* tab = block_tables + (i64)tok * max_pages;
    const int key = min(k0 + 16 * warp + (lane & 15), k1 - 1);
    if (k0 + 16 * warp < k1) {  // lanes 0..15 the K rows of the warp's first step, 16..31 the V rows
      const act* cache = lane < 16 ? (const act*)k_cache : (const act*)v_cache;
      const char* r = (const char*)(cache + (i64)ld_early(tab + (key >> page_shift)) * (((i64)Hkv * D) << page_shift) +
                                    ((key & ((1 << page_shift) - 1)) * Hkv + kvh) * D);
#pragma unroll
      for (int b = 0; b < D * 2; b += 128) prefetch_l2(r + b);
    }
#if ROPE_KV
    if (warp == 0 && lane < 2 * (D * 2 / 128)) {  // the position's cos and sin rows, D / 2 floats each
      const int pos = ld_early(positions + tok);
      const char* r = (const char*)((lane & 1 ? sin_t : cos_t) + (i64)pos * (D / 2));
      prefetch_l2(r + 128 * (lane >> 1));
    }
#endif
  }
  PDL_WAIT();
#endif

  // Q: head g's dims 32 c + 8 t .. + 7 (zeros past the group)
  const uint4 ZERO4 = {0u, 0u, 0u, 0u};
  uint4 qa[KC];
  {
    const act* qr = q + tok * q_stride + (i64)(kvh * GQA + min(g, GQA - 1)) * D + 8 * t;
#pragma unroll
    for (int c = 0; c < KC; ++c) qa[c] = g < GQA ? *(const uint4*)(qr + 32 * c) : ZERO4;
  }
#if ROPE_KV
  {
    // dims i = 32 c + 8 t + j (c < KC / 2) and i + D / 2 (chunk c + KC / 2) are RoPE partners
    const int pos = positions[tok];
    const float* cr = cos_t + (i64)pos * (D / 2);
    const float* sr = sin_t + (i64)pos * (D / 2);
#pragma unroll
    for (int c = 0; c < KC / 2; ++c) {
      float lo[8], hi[8];
      unpack8(qa[c], lo);
      unpack8(qa[c + KC / 2], hi);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = 32 * c + 8 * t + j;
        const float x = lo[j], y = hi[j];
        lo[j] = act_round(rope_lo(x, y, cr[i], sr[i]));
        hi[j] = act_round(rope_hi(x, y, cr[i], sr[i]));
      }
      qa[c] = pack8(lo);
      qa[c + KC / 2] = pack8(hi);
    }
    const i32 slot = slots[tok];
    if (part == nparts - 1 && slot >= 0 && warp == 0) {  // the newest key and value into the cache
      const act* kr = k_new + tok * k_stride + (i64)kvh * D;
      const act* vr = v_new + tok * v_stride + (i64)kvh * D;
      const i64 row = ((i64)slot * Hkv + kvh) * D;
      for (int i = lane; i < D / 2; i += WARP) {
        const float x = act_f32(kr[i]), y = act_f32(kr[i + D / 2]);
        k_cache[row + i] = to_act(rope_lo(x, y, cr[i], sr[i]));
        k_cache[row + i + D / 2] = to_act(rope_hi(x, y, cr[i], sr[i]));
        v_cache[row + i] = vr[i];
        v_cache[row + i + D / 2] = vr[i + D / 2];
      }
    }
    __syncthreads();  // the block's own stores are visible to its warps after the barrier
  }
#endif

  const i32* table = block_tables + (i64)tok * max_pages;
  const int page_mask = (1 << page_shift) - 1;
  const i64 page_elems = ((i64)Hkv * D) << page_shift;
  // key -> its row of kv head kvh in a cache (pages of 2^page_shift keys)
  auto row = [&](const act* cache, int key) {
    return cache + (i64)table[key >> page_shift] * page_elems + ((key & page_mask) * Hkv + kvh) * D;
  };
  const float sl2 = scale * LOG2E, cap_in = softcap > 0.0f ? scale / softcap : 0.0f, cap_out = softcap * LOG2E;
  float m = NEG_INF, l = 0.0f;  // head g's running max (base 2, the same in a quad) and this lane's part of the sum
  float o[VG][4][4];            // O^T: [h][i] rows dims 64 h + 8 g + 2 i (+ 1), columns heads 2 t, 2 t + 1
#pragma unroll
  for (int h = 0; h < VG; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[h][i][0] = o[h][i][1] = o[h][i][2] = o[h][i][3] = 0.0f;

  for (int base = k0 + 16 * warp; base < k1; base += 16 * NW) {
    const int last = k1 - 1;  // keys past the partition read this one (finite) and get probability 0
#if ATTN_PF
    // the step ATTN_PF ahead: its 16 keys' K rows (lanes 0..15) and V rows (16..31), D * 2 bytes each,
    // requested into L2 now, so that more of the partition's bytes are in flight than one step's
    // loads (the registers hold one step: a second would cost the occupancy)
    if (base + 16 * NW * ATTN_PF < k1) {
      const act* p = row(lane < 16 ? (const act*)k_cache : (const act*)v_cache,
                         min(base + 16 * NW * ATTN_PF + (lane & 15), last));
#pragma unroll
      for (int b = 0; b < D * 2; b += 128) prefetch_l2((const char*)p + b);
    }
#endif
    uint4 kr[2][KC], vr[4][VG];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const act* p = row(k_cache, min(base + 8 * j + g, last)) + 8 * t;
#pragma unroll
      for (int c = 0; c < KC; ++c) kr[j][c] = *(const uint4*)(p + 32 * c);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // keys 2t, 2t+1, 8+2t, 9+2t of the step
      const act* p = row(v_cache, min(base + 8 * (r >> 1) + 2 * t + (r & 1), last)) + 8 * g;
#pragma unroll
      for (int h = 0; h < VG; ++h) vr[r][h] = *(const uint4*)(p + 64 * h);
    }
    // S: s[j][0..1] = head g, keys base + 8 j + 2 t (+ 1); [2..3] the zero rows
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        mma16816(s[j], qa[c].x, 0u, qa[c].y, 0u, kr[j][c].x, kr[j][c].y);
        mma16816(s[j], qa[c].z, 0u, qa[c].w, 0u, kr[j][c].z, kr[j][c].w);
      }
    }
    float x[4];  // base-2 scores of keys 2t, 2t+1, 8+2t, 9+2t; -inf past the partition
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = base + 8 * (e >> 1) + 2 * t + (e & 1);
      const float v = s[e >> 1][e & 1];
      x[e] = key <= last ? (softcap > 0.0f ? cap_out * tanhf(v * cap_in) : v * sl2) : NEG_INF;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);        // finite: key `base` is in the partition
    const float corr = exp2f(m - mn);     // m == -inf on the warp's first step: 0
    m = mn;
    const u32 b0 = pack_bf16x2(exp2f(x[0] - mn), exp2f(x[1] - mn));
    const u32 b1 = pack_bf16x2(exp2f(x[2] - mn), exp2f(x[3] - mn));
    l = l * corr + (bf16_lo(b0) + bf16_hi(b0)) + (bf16_lo(b1) + bf16_hi(b1));  // the rounded values the mma takes
    const float ca = __shfl_sync(0xffffffffu, corr, 8 * t), cb = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
    for (int h = 0; h < VG; ++h) {
      const u32 v0[4] = {vr[0][h].x, vr[0][h].y, vr[0][h].z, vr[0][h].w};
      const u32 v1[4] = {vr[1][h].x, vr[1][h].y, vr[1][h].z, vr[1][h].w};
      const u32 v8[4] = {vr[2][h].x, vr[2][h].y, vr[2][h].z, vr[2][h].w};
      const u32 v9[4] = {vr[3][h].x, vr[3][h].y, vr[3][h].z, vr[3][h].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float* c = o[h][i];
        c[0] *= ca;
        c[1] *= cb;
        c[2] *= ca;
        c[3] *= cb;
        mma16816(c, __byte_perm(v0[i], v1[i], 0x5410), __byte_perm(v0[i], v1[i], 0x7632),
                 __byte_perm(v8[i], v9[i], 0x5410), __byte_perm(v8[i], v9[i], 0x7632), b0, b1);
      }
    }
  }

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (t == 0 && g < GQA) {
    sm_m[warp][g] = m;  // a warp without keys: -inf, 0
    sm_l[warp][g] = l;
  }
#pragma unroll
  for (int h = 0; h < VG; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = 64 * h + 8 * g + 2 * i;
      if (2 * t < GQA) {
        sm_o[warp][2 * t][d] = o[h][i][0];
        sm_o[warp][2 * t][d + 1] = o[h][i][2];
      }
      if (2 * t + 1 < GQA) {
        sm_o[warp][2 * t + 1][d] = o[h][i][1];
        sm_o[warp][2 * t + 1][d + 1] = o[h][i][3];
      }
    }
  __syncthreads();
  // Merge the warps in warp order. Warp 0 always saw key k0, so M is finite.
  for (int i = threadIdx.x; i < GQA * D; i += blockDim.x) {
    const int gh = i / D, d = i % D;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][gh]);
    float L = 0.0f, A = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float c = exp2f(sm_m[w][gh] - M);
      L += sm_l[w][gh] * c;
      A += sm_o[w][gh][d] * c;
    }
    // the combine works in the natural base
    write_partition(out, out_stride, part_out, part_ml, tok, Hq, kvh * GQA + gh, max_parts, part, nparts, D, d, A, L,
                    M * LN2);
  }
}
