// int4 / int8 GEMV / skinny GEMM for decode on tensor cores, weights in tiles: y[M, N] = x[M, K] @ W^T,
// M = 1..8 bf16 activation rows, W [N, K] groupwise int4 or int8 laid out by launchers.gemv_pack("tiled"):
//   T4_FMT 2 sym:  w = (q - 8) * s;   T4_FMT 3 asym: w = q * s + m   (s, m f16, one per row and group)
//   T4_FMT 1 int8: w = q * s (layout and arithmetic at the end of this comment)
// Why another kernel beside gemv_mma.cu: that one keeps ~1 KB of weights in flight per warp and spends
// ~340 instructions per KB on int4 (a third of them address arithmetic), so it streams ~1.6 TB/s where
// bf16 reaches ~3.9. Here every load is a whole 512-byte slab a warp reads contiguously, T4_STAGES
// slabs are in flight per warp, and the inner loop is dequant + mma + scale only.
//
// Layout (N % 16 == 0, K % 64 == 0; S = K / 64 slabs per row tile). Tile T holds rows 16 T .. 16 T + 15;
// slab j of it, k = 64 j .. 64 j + 63, is 512 contiguous bytes at (T S + j) * 512: lane l = 4 g + t
// owns bytes 16 l .. 16 l + 15, the four words (chunk c, half h) at 4 (2 c + h): row 16 T + 8 h + g,
// k = 64 j + 32 c + 8 t + e, e = 0..7, with element e in nibble (e >> 1) + 4 (e & 1) (k0 k2 k4 k6 k1 k3
// k5 k7 from the low nibble up), so the nibbles at bits 4 i and 16 + 4 i are the pair (k 2i, k 2i + 1)
// and the activations' bf16 pairs feed the mma as stored.
// Scales (and mins, the same way) keep their [N, K/g] shape, reordered: with E = 2 when g == 32 (two
// groups per slab) and 1 otherwise (a group spans g / 64 slabs), scale (row 16 T + 8 h + g', group b E + e)
// sits at ((T (K / (g E)) + b) * 8 + g') * 2 E + 2 e + h, so a lane reads its rows' scales for a slab
// in one 8-byte (g == 32) or 4-byte load.
//
// mma.m16n8k16: A = 16 weight rows x 16 k (lane g, t: rows g and g + 8), B = 16 k x 8 activation rows
// (lane g: row g, zero beyond M). Per 32-k chunk two mmas; the group scale applies to the chunk's (g == 32)
// or the slab's (g >= 64) result in fp32; asym (which dequantizes 16 + q) adds (m - 16 s) * sum(x),
// sum(x) by an mma with A = ones.
// The T4_WARPS warps of a block split the tile's slabs (warp w: w, w + T4_WARPS, ...) and add their
// partial sums in warp order: a column's result depends only on its own activation row (batch
// invariant), and not on T4_STAGES or T4_XPRE; T4_WARPS (a shape's choice) sets the order of the sum.
//
// int8 (T4_FMT 1, N % 16 == 0, K % 32 == 0; S = K / 32): slab j of tile T holds k = 32 j .. 32 j + 31 of
// its 16 rows, 512 bytes at (T S + j) * 512; lane l = 4 g + t owns bytes 16 l .. 16 l + 15, word 2 c + h:
// row 16 T + 8 h + g, k = 32 j + 8 t + 4 c + e, e = 0..3 in bytes (e0 e2 e1 e3), so the nibbles at bits
// 4 i and 16 + 4 i pair (k0, k1) (i = 0 low, 1 high) and (k2, k3) (i = 2, 3). With q = 16 hi + lo (hi
// the signed high nibble, lo the unsigned low one), per 4-k word pair one mma over lo and one over
// 16 hi, both exact in bf16 (one lop3 and one bf16x2 fma a pair), into the same accumulator: the slab's
// sum(q x), times its group's scale (scales as int4's g >= 64 layout: a group spans g / 32 slabs).
// Per 512 bytes it issues 4 mmas and 16 pairs, against int4's 8 and 16 (asym).
#include "common.cuh"

#ifndef T4_FMT
#error "compile with -DT4_FMT=1|2|3"
#endif
#ifndef T4_G32
#define T4_G32 1  // int4 with group size 32 (else a power of two >= 64; int8: 0, any power of two >= 32)
#endif
#define T4_INT8 (T4_FMT == 1)
#if T4_INT8 && T4_G32
#error "int8 takes T4_G32 0 (a slab is one group or part of one)"
#endif
#define SLAB_K (T4_INT8 ? 32 : 64)  // k a slab holds
#ifndef T4_STAGES
#define T4_STAGES 4  // slabs in flight per warp
#endif
#ifndef T4_XPRE
#define T4_XPRE 0  // 1: load a slab's activations with its weights (8 more registers a stage), 0: when
#endif             // it is computed (they are L1 hits after the first block on an SM, at one row)
#ifndef T4_WARPS
#define T4_WARPS 8  // warps a block splits its tile's slabs over (the order their sums add: results
#endif              // differ in the last bits between 8 and 16, so the launcher picks it by shape only)
#ifndef T4_MINB
#define T4_MINB 0  // > 0: blocks an SM must hold at once (caps the registers; 0: ptxas's choice)
#endif
#if T4_MINB
#define T4_BOUNDS __launch_bounds__(T4_WARPS * 32, T4_MINB)
#else
#define T4_BOUNDS __launch_bounds__(T4_WARPS * 32)
#endif
// T4_L2PF > 0 (speed only): the block's tile, up to T4_L2PF 128-byte lines a thread, asked of L2 before
// the PDL wait, beside the first stages' loads (common.cuh prefetch_region_l2; launchers.WEIGHT_PREFETCH)
#ifndef T4_L2PF
#define T4_L2PF 0
#endif
// T4_DQ 1 (asym int4 in groups of 32 only; other bits than 0): each pair dequantized to bf16 in registers,
// w = (16 + q) s + (m - 16 s) in one bf16x2 fma (s and m - 16 s rounded to bf16), and the chunk's two
// mmas accumulate into the tile's fp32 sums, in place of the sum(x) mmas and the per-chunk fp32 scaling.
// Fewer instructions a byte (scripts/sass_count.py: 165 a KB against 181), but s and m - 16 s rounded to
// bf16 move a whole group's weights together by up to 2^-9 (16 + q) s: ~1 % on the output (an H100, random
// weights), a sixth of the 4-bit rounding's own; launchers.TILED_DQ keeps it off.
#ifndef T4_DQ
#define T4_DQ 0
#endif
// T4_F16 1 (int8 only; other bits than 0): the mmas in fp16 — a word's bytes as two fp16 pairs by a
// byte permute (1024 + (q ^ 0x80)) and one fp16x2 add (- 1152), exact, one mma a 4-k word pair where the
// bf16 path needs two (q = 16 hi + lo) and three instructions a pair; the activations converted to fp16
// a slab at a time after a scaling by 2^-F16_SHIFT (exact; the sums scaled back at the end), so that
// bf16 activations up to 65,504 * 2^F16_SHIFT convert exactly (Gemma's MLP inputs pass fp16's range),
// and below 2^(F16_SHIFT - 14) lose low bits (at most 2^(F16_SHIFT - 24) each); past that range, clamped.
#define F16_SHIFT 8
#ifndef T4_F16
#define T4_F16 0
#endif
// T4_XSMEM 1 (speed only, the same bits): after the PDL wait the block copies its activations (M rows of K,
// a row padded by 8 so that rows start on other banks) into dynamic shared memory, all threads at once,
// and the slabs read them there: each slab's x is then a shared-memory load in its dependency chain, not
// an L1 / L2 one (Nsight Compute: the tiled gemvs stall on global loads, long_scoreboard, at 33-51 % of
// their issue slots). The launcher gives it M (K + 8) * 2 bytes of shared memory where that fits.
#ifndef T4_XSMEM
#define T4_XSMEM 0
#endif
// GEMV_PNORM 1 (common.cuh; with T4_XSMEM, whose shared memory holds the normed row): the residual norm
// in this gemv's prologue.
#if GEMV_PNORM && !T4_XSMEM
#error "GEMV_PNORM takes T4_XSMEM 1"
#endif
// GEMV_HWOUT / GEMV_RSCALE 1 (common.cuh): a residual norm split between this residual gemv and its consumer.
#if T4_F16 && !T4_INT8
#error "T4_F16 takes T4_FMT 1"
#endif
#if T4_DQ && !(T4_FMT == 3 && T4_G32)
#error "T4_DQ takes T4_FMT 3 with T4_G32 1"
#endif
#if ACT_F32
#error "gemv_tiled takes bf16 activations only"
#endif

#define T4_ASYM (T4_FMT == 3)
// A pair's nibbles as bf16: sym 128 + q (nibble in the mantissa's low bits) then an fma by -136; asym
// 16 + q (nibble in the mantissa's top four bits) with no fma, the 16 s it adds taken off the min;
// int8 as sym (pair8).
#define T4_MASK (T4_ASYM ? 0x00780078u : 0x000F000Fu)

#if T4_G32
typedef uint2 scale_t;  // (row g, row g + 8) of chunk 0, then of chunk 1
#else
typedef u32 scale_t;  // (row g, row g + 8) of the slab's group
#endif

struct Stage {
  uint4 w;
  scale_t s;
#if T4_ASYM
  scale_t m;
#endif
#if T4_XPRE
  uint4 x0;
#if !T4_INT8
  uint4 x1;
#endif
#endif
};

// Nibbles at bits 4 i and 16 + 4 i of w as two bf16 (exact): sym q - 8, asym 16 + q. `mask` is
// T4_MASK held in a register: as a literal, ptxas rematerializes it before most lop3s (one extra
// instruction per pair), so the kernel derives it from an argument ptxas cannot fold.
__device__ __forceinline__ u32 pair(u32 w, int i, u32 mask) {
#if T4_ASYM
  // bits 3..6 of a bf16 above 16's exponent (0x4180) are eighths: q << 3 there is 16 + q
  const u32 v = i == 0 ? w << 3 : w >> (4 * i - 3);
  return (v & mask) | 0x41804180u;  // one lop3
#else
  const u32 v = ((w >> (4 * i)) & mask) | 0x43004300u;  // 128 + q, one lop3
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));  // - 136
  return r;
#endif
}

// int8: the nibbles at bits 4 i and 16 + 4 i of w (T4_MASK in `mask`) as two bf16, exact: i even, the
// low nibbles (128 + lo, less 128); i odd, the signed high ones times 16 (128 + (hi ^ 8) = 136 + hi, times
// 16 less 2176).
__device__ __forceinline__ u32 pair8(u32 w, int i, u32 mask) {
  const u32 v = (w >> (4 * i)) & mask;
  u32 r;
  if (i & 1)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v ^ 0x43084308u), "r"(0x41804180u), "r"(0xC508C508u));
  else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v | 0x43004300u), "r"(0x3F803F80u), "r"(0xC300C300u));
  return r;
}

// c += four k of rows g (word wa) and g + 8 (wb) times their activations' pairs x01, x23 (int8)
__device__ __forceinline__ void chunk8(float* c, u32 wa, u32 wb, u32 x01, u32 x23, u32 mask) {
  mma16816(c, pair8(wa, 0, mask), pair8(wb, 0, mask), pair8(wa, 2, mask), pair8(wb, 2, mask), x01, x23);
  mma16816(c, pair8(wa, 1, mask), pair8(wb, 1, mask), pair8(wa, 3, mask), pair8(wb, 3, mask), x01, x23);
}

#if T4_F16
// bytes (lo, hi) of an int8 word (sel 0x4240: bytes 0 and 2, 0x4341: 1 and 3) as two fp16, exact
__device__ __forceinline__ u32 bytes_f16(u32 w, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(w ^ 0x80808080u), "r"(0x64646464u), "r"(sel));  // 1024 + (q ^ 0x80)
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(0x64806480u));  // - 1152
  return r;
}

// a bf16 pair times 2^-F16_SHIFT (exact) as an fp16 pair
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 x) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x3B803B80u));  // 2^-8
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(__uint_as_float(r & 0xffff0000u)), "f"(__uint_as_float(r << 16)));
  return r;
}
static_assert(F16_SHIFT == 8, "bf16x2_to_f16x2's multiplier is 2^-8");

// c += four k (bytes e0 e2 e1 e3) of rows g (word wa) and g + 8 (wb) times their activations' pairs x01, x23
__device__ __forceinline__ void chunk8_f16(float* c, u32 wa, u32 wb, u32 x01, u32 x23) {
  mma16816_f16(c, bytes_f16(wa, 0x4240u), bytes_f16(wb, 0x4240u), bytes_f16(wa, 0x4341u), bytes_f16(wb, 0x4341u),
               bf16x2_to_f16x2(x01), bf16x2_to_f16x2(x23));
}
#endif

__device__ __forceinline__ void f16x2_to_f32(u32 w, float& lo, float& hi) {
  asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
      : "=f"(lo), "=f"(hi) : "r"(w));
}

// c += the chunk (words wa: row g, wb: row g + 8) times its activations xv; cx += sum(x) (asym).
__device__ __forceinline__ void chunk(float* c, float* cx, u32 wa, u32 wb, uint4 xv, u32 mask) {
  mma16816(c, pair(wa, 0, mask), pair(wb, 0, mask), pair(wa, 1, mask), pair(wb, 1, mask), xv.x, xv.y);
  mma16816(c, pair(wa, 2, mask), pair(wb, 2, mask), pair(wa, 3, mask), pair(wb, 3, mask), xv.z, xv.w);
#if T4_ASYM
  constexpr u32 ONES = 0x3F803F80u;
  mma16816(cx, ONES, ONES, ONES, ONES, xv.x, xv.y);
  mma16816(cx, ONES, ONES, ONES, ONES, xv.z, xv.w);
#endif
}

// acc += c * s (+ cx * m): c rows g (c0, c1) and g + 8 (c2, c3); cx the same for both rows.
__device__ __forceinline__ void scale_into(float* acc, const float* c, const float* cx, u32 s, u32 m) {
  float s0, s1;
  f16x2_to_f32(s, s0, s1);
  acc[0] = fmaf(c[0], s0, acc[0]);
  acc[1] = fmaf(c[1], s0, acc[1]);
  acc[2] = fmaf(c[2], s1, acc[2]);
  acc[3] = fmaf(c[3], s1, acc[3]);
#if T4_ASYM
  float m0, m1;
  f16x2_to_f32(m, m0, m1);
  m0 = fmaf(-16.0f, s0, m0);  // c summed (16 + q) x
  m1 = fmaf(-16.0f, s1, m1);
  acc[0] = fmaf(cx[0], m0, acc[0]);
  acc[1] = fmaf(cx[1], m0, acc[1]);
  acc[2] = fmaf(cx[0], m1, acc[2]);
  acc[3] = fmaf(cx[1], m1, acc[3]);
#endif
}

#if T4_DQ
// acc += the chunk (words wa: row g, wb: row g + 8) dequantized to bf16 (scales s, mins m: f16x2 of rows
// g and g + 8) times its activations xv
__device__ __forceinline__ void chunk_dq(float* acc, u32 wa, u32 wb, uint4 xv, u32 s, u32 m, u32 mask) {
  float s0, s1, m0, m1;
  f16x2_to_f32(s, s0, s1);
  f16x2_to_f32(m, m0, m1);
  u32 sb, mb;  // bf16x2 (row g low, row g + 8 high), round to nearest
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(sb) : "f"(s1), "f"(s0));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(mb) : "f"(fmaf(-16.0f, s1, m1)), "f"(fmaf(-16.0f, s0, m0)));
  // (16 + q) s + m', one bf16x2 fma: row g takes the low halves of sb, mb, row g + 8 the high ones
  auto dq = [&](u32 v, bool hi) {
    u32 r;
    if (hi)
      asm("{.reg .b16 a, b, c, d;\n\t.reg .b32 s2, m2;\n\tmov.b32 {a, b}, %2;\n\tmov.b32 {c, d}, %3;\n\t"
          "mov.b32 s2, {b, b};\n\tmov.b32 m2, {d, d};\n\tfma.rn.bf16x2 %0, %1, s2, m2;}"
          : "=r"(r) : "r"(v), "r"(sb), "r"(mb));
    else
      asm("{.reg .b16 a, b, c, d;\n\t.reg .b32 s2, m2;\n\tmov.b32 {a, b}, %2;\n\tmov.b32 {c, d}, %3;\n\t"
          "mov.b32 s2, {a, a};\n\tmov.b32 m2, {c, c};\n\tfma.rn.bf16x2 %0, %1, s2, m2;}"
          : "=r"(r) : "r"(v), "r"(sb), "r"(mb));
    return r;
  };
  mma16816(acc, dq(pair(wa, 0, mask), false), dq(pair(wb, 0, mask), true), dq(pair(wa, 1, mask), false),
           dq(pair(wb, 1, mask), true), xv.x, xv.y);
  mma16816(acc, dq(pair(wa, 2, mask), false), dq(pair(wb, 2, mask), true), dq(pair(wa, 3, mask), false),
           dq(pair(wb, 3, mask), true), xv.z, xv.w);
}
#endif

// 8 activations (16 bytes) of the slab's x: from shared memory (T4_XSMEM) or global (the kernel before's output)
__device__ __forceinline__ uint4 ld_x(const act* p) {
#if T4_XSMEM
  return *(const uint4*)p;
#else
  return ld_act(p);
#endif
}

extern "C" __global__ void T4_BOUNDS
gemv_tiled(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, const u16* __restrict__ scales,
           const u16* __restrict__ mins, void* __restrict__ y, i64 y_stride, int M, int N, int K, int group_size,
           int y_f32 NORM_PARAMS PNORM_PARAMS CATCHUP_PARAMS HWOUT_PARAMS RSCALE_PARAMS) {
  PDL_LAUNCH();  // the first stages' weights load before PDL_WAIT, while the kernel before runs
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, S = K / SLAB_K;
  // this lane's bytes of the warp's first slab (j = warp), its scales, its activations (row g, k 8 t of
  // chunk 0); each advances by STEP slabs. Lanes past the M rows read row M - 1: their mma columns are
  // never stored, and columns do not mix, so they need no zeros.
  constexpr int STEP = T4_WARPS;
  const u8* wp = w + ((i64)tile * S + warp) * 512 + lane * 16;
#if T4_G32
  const u16* sp = scales + ((i64)tile * S * 8 + g) * 4 + warp * 32;
#else
  // a group spans 1 << gshift slabs: slab j reads group j >> gshift, at + (j >> gshift) * 16
  const int gshift = 31 - __clz(group_size / SLAB_K);
  const u16* sp = scales + ((i64)tile * (K / group_size) * 8 + g) * 2;
#endif
#if T4_ASYM
  const u16* mp = mins + (sp - scales);
#endif
#if T4_XSMEM
  extern __shared__ uint4 xs_raw[];  // M rows of K + 8 activations
  act* const xs = (act*)xs_raw;
  const act* xp = xs + min(g, M - 1) * (K + 8) + 8 * t + warp * SLAB_K;
#else
  const act* xp = x + min(g, M - 1) * x_stride + 8 * t + warp * SLAB_K;
#endif
  const int n = S > warp ? (S - warp + STEP - 1) / STEP : 0;  // this warp's slabs

  int base = 0;  // slabs of this warp done (the pointers have advanced by base STEP slabs)
  // slab base + i of this warp (j = warp + (base + i) STEP), relative to the pointers: its weights,
  // scales (and mins), which no kernel writes
  auto load_w = [&](Stage& st, int i, bool nc) {
    st.w = ld_stream(wp + (i64)i * STEP * 512, nc);
#if T4_G32
    st.s = ld_stream2(sp + i * STEP * 32, nc);
#if T4_ASYM
    st.m = ld_stream2(mp + i * STEP * 32, nc);
#endif
#else
    const int grp = (warp + (base + i) * STEP) >> gshift;
    st.s = ld_stream1(sp + grp * 16, nc);
#if T4_ASYM
    st.m = ld_stream1(mp + grp * 16, nc);
#endif
#endif
  };
  // ... and its activations, the kernel before's output (after PDL_WAIT)
  auto load_x = [&](Stage& st, int i) {
#if T4_XPRE
    st.x0 = ld_x(xp + i * STEP * SLAB_K);
#if !T4_INT8
    st.x1 = ld_x(xp + i * STEP * 64 + 32);
#endif
#else
    (void)st, (void)i;
#endif
  };
  auto load = [&](Stage& st, int i) {
    load_w(st, i, true);
    load_x(st, i);
  };

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const u32 mask = T4_MASK | ((u32)group_size & 0x80000000u);  // group_size > 0: the literal
  auto compute = [&](const Stage& st, int i) {
#if T4_INT8
#if T4_XPRE
    const uint4 x0 = st.x0;
    (void)i;
#else
    const uint4 x0 = ld_x(xp + i * STEP * SLAB_K);
#endif
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if T4_F16
    chunk8_f16(c, st.w.x, st.w.y, x0.x, x0.y);
    chunk8_f16(c, st.w.z, st.w.w, x0.z, x0.w);
#else
    chunk8(c, st.w.x, st.w.y, x0.x, x0.y, mask);  // words (c 0, h 0), (0, 1): k 0..3 of the lane's 8
    chunk8(c, st.w.z, st.w.w, x0.z, x0.w, mask);  // (1, 0), (1, 1): k 4..7
#endif
    scale_into(acc, c, nullptr, st.s, 0u);
#else
#if T4_XPRE
    const uint4 x0 = st.x0, x1 = st.x1;
    (void)i;
#else
    const uint4 x0 = ld_x(xp + i * STEP * 64);
    const uint4 x1 = ld_x(xp + i * STEP * 64 + 32);
#endif
#if T4_ASYM && T4_G32
    const u32 m0 = st.m.x, m1 = st.m.y;
#elif T4_ASYM
    const u32 m0 = st.m;
#else
    const u32 m0 = 0u, m1 = 0u;
#endif
#if T4_DQ
    chunk_dq(acc, st.w.x, st.w.y, x0, st.s.x, m0, mask);
    chunk_dq(acc, st.w.z, st.w.w, x1, st.s.y, m1, mask);
#else
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    chunk(c, cx, st.w.x, st.w.y, x0, mask);
#if T4_G32
    scale_into(acc, c, cx, st.s.x, m0);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    chunk(d, dx, st.w.z, st.w.w, x1, mask);
    scale_into(acc, d, dx, st.s.y, m1);
#else
    chunk(c, cx, st.w.z, st.w.w, x1, mask);
    scale_into(acc, c, cx, st.s, m0);
#endif
#endif
#endif
  };

  // T4_STAGES slabs in flight: slab i + T4_STAGES is loaded into the stage slab i leaves. The steady
  // loop runs whole rounds with every load in range (no guards); the tail finishes the < 2 rounds left.
  Stage st[T4_STAGES];
#pragma unroll
  for (int p = 0; p < T4_STAGES; ++p)
    if (p < n) load_w(st[p], p, false);  // coherent loads: ptxas keeps them before the wait
#if T4_L2PF
  prefetch_region_l2<T4_L2PF>(w + (i64)tile * S * 512, (i64)S * 512);
#endif
#if GEMV_PNORM
  PNORM_WEIGHTS();
#endif
  PDL_WAIT();
#if GEMV_CATCHUP
  u32 cu[2];  // warp 0's residual columns, one add caught up (stored in the epilogue)
  catchup_load(cu, yp, yp_stride, rr, rr_stride, tile * 16, N, M);
#endif
#if GEMV_RSCALE
  RSCALE_BUF();
  rscale_copy(rs_buf, rs_parts, rs_stride, M);  // waited for before the epilogue
#endif
#if GEMV_HWOUT
  u32 hwe[3] = {0u, 0u, 0u};  // HW_EARLY: warp 0's residual columns and norm weights
  if (HW_EARLY) hwout_load(hwe, hw_rr, hw_rr_stride, hw_w, tile * 16, N, M);
#endif
#if GEMV_PNORM
  pnorm_row(x, pn_rr, pn_w, xs, K, pn_eps, pn_nt, pn_wpre);  // M == 1
#elif T4_XSMEM
  // every copy in flight at once (cp.async: no registers held), then one barrier
  for (int m = 0; m < M; ++m)
    for (int c = threadIdx.x; c < K / 8; c += T4_WARPS * 32)
      cp_async16(xs + m * (K + 8) + 8 * c, x + m * x_stride + 8 * c);
  cp_async_wait_all();
  __syncthreads();
#endif
#pragma unroll
  for (int p = 0; p < T4_STAGES; ++p)
    if (p < n) load_x(st[p], p);
  for (; base + 2 * T4_STAGES <= n; base += T4_STAGES) {
#pragma unroll
    for (int p = 0; p < T4_STAGES; ++p) {
      compute(st[p], p);
      load(st[p], p + T4_STAGES);
    }
    wp += T4_STAGES * STEP * 512;
    xp += T4_STAGES * STEP * SLAB_K;
#if T4_G32
    sp += T4_STAGES * STEP * 32;
#if T4_ASYM
    mp += T4_STAGES * STEP * 32;
#endif
#endif
  }
#pragma unroll
  for (int p = 0; p < T4_STAGES; ++p) {
    if (base + p < n) {
      compute(st[p], p);
      if (base + p + T4_STAGES < n) load(st[p], p + T4_STAGES);
    }
  }
#pragma unroll
  for (int p = 0; p < T4_STAGES; ++p)
    if (base + T4_STAGES + p < n) compute(st[p], p + T4_STAGES);

#if T4_F16
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] *= (float)(1 << F16_SHIFT);  // exact: the activations' scaling undone
#endif
#if GEMV_RSCALE
  rscale_rows(rs_inv, rs_buf, M, K, rs_eps, T4_WARPS);
#endif
  tile_epilogue<T4_WARPS>(acc, T4_WARPS, tile * 16, N, M, y, y_stride,
                          y_f32 NORM_ARGS CATCHUP_ARGS HWOUT_ARGS RSCALE_ARGS);  // common.cuh
}
