// Split-K of decode attention, shared by attention.cu and attention_decode_mma.cu (they must cut a
// context alike: both write partitions that attention.cu's paged_attention_combine merges). Include
// after MAX_SPLIT is defined.
#pragma once

// The first key a token sees: 0, or the first of its window.
__device__ __forceinline__ int first_key(int n_keys, int window) { return window > 0 ? max(0, n_keys - window) : 0; }

// Keys per partition of a token's n keys (the last partition may hold fewer): n <= 0 gives 1.
__device__ __forceinline__ int split_size(int n, int partition) {
  const int parts = min(MAX_SPLIT, max(1, (n + partition - 1) / partition));
  return max(1, (n + parts - 1) / parts);
}

