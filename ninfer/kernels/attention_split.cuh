// Split-K of decode attention, shared by attention.cu and attention_decode_mma.cu (they must cut a
// context alike and merge partitions alike: attention.cu's paged_attention_combine and the mma
// kernel's in-kernel merge give the same bits). Include after MAX_SPLIT is defined.
#pragma once

// The first key a token sees: 0, or the first of its window.
__device__ __forceinline__ int first_key(int n_keys, int window) { return window > 0 ? max(0, n_keys - window) : 0; }

// Keys per partition of a token's n keys (the last partition may hold fewer): n <= 0 gives 1.
__device__ __forceinline__ int split_size(int n, int partition) {
  const int parts = min(MAX_SPLIT, max(1, (n + partition - 1) / partition));
  return max(1, (n + parts - 1) / parts);
}


// Element d of one head's output from its nparts partitions at part_out[(base + p) * D + d] (normalized
// partial outputs) and part_ml[(base + p) * 2 + {0, 1}] (max in the natural base, sum), merged in
// partition order. Reads through L2 (__ldcg): the partials may come from other blocks of the grid.
__device__ __forceinline__ float merge_partials(const float* part_out, const float* part_ml, i64 base, int nparts,
                                                int D, int d) {
  float M = NEG_INF;
  for (int p = 0; p < nparts; ++p) M = fmaxf(M, __ldcg(part_ml + (base + p) * 2));
  float num = 0.0f, den = 0.0f;
  for (int p = 0; p < nparts; ++p) {
    const float w = expf(__ldcg(part_ml + (base + p) * 2) - M) * __ldcg(part_ml + (base + p) * 2 + 1);
    num += w * __ldcg(part_out + (base + p) * D + d);
    den += w;
  }
  return num / den;
}
