// Split-K of decode attention, shared by attention.cu and attention_decode_mma.cu (they must cut a
// context alike: both write partitions that attention.cu's paged_attention_combine merges). Include
// after MAX_SPLIT and SPLIT_MIN are defined.
#pragma once

// The first key a token sees: 0, or the first of its window.
__device__ __forceinline__ int first_key(int n_keys, int window) { return window > 0 ? max(0, n_keys - window) : 0; }

// Keys per partition of a token's n keys (the last partition may hold fewer): n <= 0 gives 1. A context
// of at most SPLIT_MIN keys stays whole (one block per kv head reads it in less time than a combine
// launch takes).
__device__ __forceinline__ int split_size(int n, int partition) {
  if (n <= SPLIT_MIN) return max(1, n);
  const int parts = min(MAX_SPLIT, max(1, (n + partition - 1) / partition));
  return max(1, (n + parts - 1) / parts);
}


// A block's result for element d of query head `head` of token t over partition `part` of nparts:
// with one partition the output itself (A / L), else the normalized partial and (max M in the natural
// base, sum L) for the combine kernel.
__device__ __forceinline__ void write_partition(act* out, i64 out_stride, float* part_out, float* part_ml, int t,
                                                int Hq, int head, int max_parts, int part, int nparts, int D, int d,
                                                float A, float L, float M) {
  if (nparts == 1) {
    out[t * out_stride + (i64)head * D + d] = to_act(A / L);
  } else {
    const i64 p = ((i64)t * Hq + head) * max_parts + part;
    part_out[p * D + d] = A / L;
    if (d == 0) {
      part_ml[p * 2] = M;
      part_ml[p * 2 + 1] = L;
    }
  }
}
