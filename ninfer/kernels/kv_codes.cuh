// Codes of a compressed KV cache, shared by kv_quant.cu (encode) and attention.cu (decode).
// KV_FP8=1: e4m3 (max 448) through the sm_89+ cvt instructions; otherwise int8 (max 127).
#pragma once
#include "common.cuh"

#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8
#define KV_QMAX 448.0f
#else
#define KV_QMAX 127.0f
#endif
#define KV_MIN_SCALE 6.103515625e-05f  // the smallest normal fp16 (torch.finfo(float16).tiny)

__device__ __forceinline__ u16 f32_to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// x: a value already divided by its row's scale, |x| <= KV_QMAX up to the scale's rounding.
__device__ __forceinline__ u8 kv_encode(float x) {
#if KV_FP8
  u16 pair;  // {a -> high byte, b -> low byte}
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return (u8)(pair & 0xffu);
#else
  return (u8)(i8)(int)fminf(fmaxf(rintf(x), -127.0f), 127.0f);
#endif
}

__device__ __forceinline__ float kv_decode(u8 code) {
#if KV_FP8
  u32 h2;  // the low byte's e4m3 -> the low f16
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)code));
  return f16_to_f32((u16)(h2 & 0xffffu));
#else
  return (float)(i8)code;
#endif
}
