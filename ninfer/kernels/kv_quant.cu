// Compressed KV cache (--kv-dtype int8|fp8): per token and kv head one fp16 scale, amax / QMAX,
// and HEAD codes: int8 round-to-nearest-even of x / scale (-DKV_FP8=0), or e4m3 of x / scale
// (-DKV_FP8=1, sm_89+ cvt). kv_quantize_write stores new K and V rows; attention.cu reads the
// codes back through kv_decode (included there) and multiplies by the row's scale.
//   k_rows/v_rows [T, Hkv, D] act, contiguous (RoPE already applied to k)
//   slot_mapping [T] int32: page * page_size + pos % page_size; negative: no write (padding)
//   k_cache/v_cache [pages, page_size, Hkv, D] u8 codes; k_scale/v_scale [pages, page_size, Hkv] f16 bits
// Grid: (T, 2 * Hkv), one warp per row (K rows, then V rows).
#include "common.cuh"
#include "kv_codes.cuh"

extern "C" __global__ void kv_quantize_write(const act* __restrict__ k_rows, const act* __restrict__ v_rows,
                                             const i32* __restrict__ slot_mapping, u8* __restrict__ k_cache,
                                             u8* __restrict__ v_cache, u16* __restrict__ k_scale,
                                             u16* __restrict__ v_scale, int Hkv, int D) {
  PDL_ENTRY();
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const i32 slot = slot_mapping[t];
  if (slot < 0) return;
  const bool is_v = h >= Hkv;
  const int hh = is_v ? h - Hkv : h;
  const act* src = (is_v ? v_rows : k_rows) + ((i64)t * Hkv + hh) * D;
  float amax = 0.0f;
  for (int j = lane; j < D; j += WARP) amax = fmaxf(amax, fabsf(act_f32(src[j])));
  amax = warp_max(amax);
  const u16 bits = f32_to_f16(fmaxf(amax / KV_QMAX, KV_MIN_SCALE));
  const float scale = f16_to_f32(bits);
  const i64 row = (i64)slot * Hkv + hh;
  u8* dst = (is_v ? v_cache : k_cache) + row * D;
  for (int j = lane; j < D; j += WARP) dst[j] = kv_encode(act_f32(src[j]) / scale);
  if (lane == 0) (is_v ? v_scale : k_scale)[row] = bits;
}
