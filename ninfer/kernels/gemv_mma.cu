// GEMV / skinny GEMM for decode on tensor cores: y[M, N] = x[M, K] @ W^T, M = 1..8 rows, bf16
// activations, W [N, K] in the same layouts as gemv.cu (quant.py's, untouched):
//   MMA_FMT 0 bf16:      W [N, K] bf16
//   MMA_FMT 1 int8:      W [N, K] int8, scales [N, K/g] f16;              w = q * s
//   MMA_FMT 2 int4 sym:  W [N, K/2] uint8, scales [N, K/g] f16;          w = (q - 8) * s
//   MMA_FMT 3 int4 asym: W [N, K/2] uint8, scales, mins [N, K/g] f16;    w = q * s + m
// (int4 element 2j in the low nibble of byte j; int8 and, where K % 128 == 0, int4 rows interleaved
// by launchers.gemv_pack.) One block of MMA_WARPS warps owns a tile of 16
// output columns n; its warps split K by iterations (warp w takes iterations w, w + MMA_WARPS, ...)
// and each issues mma.m16n8k16 with A = 16 weight rows x 16 k and B = 16 k x 8 activation rows (the
// M rows, zero beyond M). A lane (g = lane / 4, t = lane % 4) feeds weight rows g and g + 8 and
// activation row g. The k order inside an mma is free as long as A and B agree, so each lane reads
// its own chunks:
//   bf16: 8 consecutive k per lane and row -> two mmas, pairs (k, k+1) as stored;
//   int4: word t (8 nibbles) of a 32-wide chunk of k -> two mmas that take all their k from that
//         chunk, inside one scale group (group sizes are multiples of 32), so the group's scale
//         applies to the mma result:
//         acc += s * sum(q x) (+ m * sum(x), sum(x) by an mma with A = ones). Nibbles i and i + 4 of
//         a word sit 16 bits apart, so one and/or gives two of them as bf16 (128 + q), exact, and one
//         bf16x2 fma takes the offset off; the activations' pairs are permuted to match (prmt).
// fp32 accumulation; a column m's result depends only on row m of x (zero rows add zeros), and the
// warps' partial sums are added in warp order: batch invariant, like gemv.cu.
#include "common.cuh"

#define MMA_WARPS 8

#ifndef MMA_FMT
#error "compile with -DMMA_FMT=0|1|2|3"
#endif
#ifndef MMA_WIDE
#define MMA_WIDE 0  // int4 rows interleaved for 16-byte loads (K % 128 == 0, see gemv_pack)
#endif
#if ACT_F32
#error "gemv_mma takes bf16 activations only"
#endif
// MMA_PIPE > 0 (bf16; speed only, the same bits): that many iterations in flight a warp, a rolling
// pipeline (below; launchers.mma_variant)
#ifndef MMA_PIPE
#define MMA_PIPE 0
#endif
// MMA_EARLY 1 (with MMA_PIPE; speed only): the pipeline's first weight loads are issued before the PDL
// wait, coherent, so they overlap the kernel before (gemv_tiled.cu's way)
#ifndef MMA_EARLY
#define MMA_EARLY 0
#endif
#define MMA_EARLY_W (MMA_FMT == 0 && MMA_PIPE && MMA_EARLY)
// MMA_L2PF > 0 (any format; speed only): the block's weight rows, up to MMA_L2PF 128-byte lines a
// thread, asked of L2 before the PDL wait (common.cuh prefetch_region_l2; launchers.WEIGHT_PREFETCH)
#ifndef MMA_L2PF
#define MMA_L2PF 0
#endif
// MMA_L2PF_K 1 (with MMA_L2PF): the lines in k order across the block's 16 rows (line j: row j % 16,
// bytes 128 (j / 16) on), the order the warps read them, instead of the region's (rows 0, 1, ... whole)
#ifndef MMA_L2PF_K
#define MMA_L2PF_K 0
#endif

// GEMV_PNORM 1 (common.cuh; bf16 with MMA_PIPE, one row): the residual norm in this gemv's prologue, the
// pipeline reading the normed row from shared memory.
#if GEMV_PNORM && !(MMA_FMT == 0 && MMA_PIPE)
#error "GEMV_PNORM takes MMA_FMT 0 with MMA_PIPE"
#endif
// MMA_XSMEM 1 (bf16 with MMA_PIPE; speed only, the same bits): after the PDL wait the block copies its M
// activation rows (K + 8 apart) into dynamic shared memory (cp.async, then one barrier) and the pipeline
// reads them there, as GEMV_PNORM's normed row (gemv_tiled.cu's T4_XSMEM); the launcher gives it
// M (K + 8) * 2 bytes.
#ifndef MMA_XSMEM
#define MMA_XSMEM 0
#endif
#if MMA_XSMEM && !(MMA_FMT == 0 && MMA_PIPE)
#error "MMA_XSMEM takes MMA_FMT 0 with MMA_PIPE"
#endif
#define MMA_XS (GEMV_PNORM || MMA_XSMEM)  // the pipeline's activations from shared memory
// GEMV_HWOUT / GEMV_RSCALE 1 (common.cuh): a residual norm split between this residual gemv and its consumer.

// The nibbles at bits `shift` and 16 + `shift` of w as two bf16 (128 + v, exact) plus neg_off2 (two bf16).
__device__ __forceinline__ u32 bf16_pair(u32 w, int shift, u32 neg_off2) {
  const u32 v = ((w >> shift) & 0x000F000Fu) | 0x43004300u;
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(neg_off2));  // v * 1 + off
  return r;
}

#define NEG128 0xC300C300u  // (-128, -128)
#define NEG136 0xC308C308u  // (-136, -136)

// Nibbles i and i + 4 of an int4 word as two bf16 (q_i, q_{i+4}) minus the format's offset.
__device__ __forceinline__ u32 nibble_pair(u32 w, int i) {
  return bf16_pair(w, 4 * i, MMA_FMT == 2 ? NEG136 : NEG128);
}

// One 32-wide chunk of k at kb for weight rows g (word wa) and g + 8 (word wb): lane t holds
// elements 8 t .. 8 t + 7 of the chunk; mma pairs (e0, e4), (e1, e5) | (e2, e6), (e3, e7).
__device__ __forceinline__ void int4_chunk(float* acc, u32 wa, u32 wb, const act* xr, int kb, int t, bool has_x,
                                           const u16* s0p, const u16* s1p, const u16* m0p, const u16* m1p,
                                           int gshift) {
  const uint4 ZERO4 = {0u, 0u, 0u, 0u};
  const uint4 xv = has_x ? __ldg((const uint4*)(xr + kb + 8 * t)) : ZERO4;
  const u32 b0 = __byte_perm(xv.x, xv.z, 0x5410), b1 = __byte_perm(xv.x, xv.z, 0x7632);
  const u32 b2 = __byte_perm(xv.y, xv.w, 0x5410), b3 = __byte_perm(xv.y, xv.w, 0x7632);
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma16816(c, nibble_pair(wa, 0), nibble_pair(wb, 0), nibble_pair(wa, 1), nibble_pair(wb, 1), b0, b1);
  mma16816(c, nibble_pair(wa, 2), nibble_pair(wb, 2), nibble_pair(wa, 3), nibble_pair(wb, 3), b2, b3);
  const int grp = (kb >> 5) >> gshift;  // group sizes are 32 << gshift (no integer division per chunk)
  const float s0 = f16_to_f32(__ldg(s0p + grp)), s1 = f16_to_f32(__ldg(s1p + grp));
  acc[0] = fmaf(c[0], s0, acc[0]);
  acc[1] = fmaf(c[1], s0, acc[1]);
  acc[2] = fmaf(c[2], s1, acc[2]);
  acc[3] = fmaf(c[3], s1, acc[3]);
#if MMA_FMT == 3
  constexpr u32 ONES = 0x3F803F80u;
  float cx[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // sum of the chunk's x per column (the same for every row)
  mma16816(cx, ONES, ONES, ONES, ONES, b0, b1);
  mma16816(cx, ONES, ONES, ONES, ONES, b2, b3);
  const float m0 = f16_to_f32(__ldg(m0p + grp)), m1 = f16_to_f32(__ldg(m1p + grp));
  acc[0] = fmaf(cx[0], m0, acc[0]);
  acc[1] = fmaf(cx[1], m0, acc[1]);
  acc[2] = fmaf(cx[2], m1, acc[2]);
  acc[3] = fmaf(cx[3], m1, acc[3]);
#endif
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)
gemv_mma(const act* __restrict__ x, i64 x_stride, const u8* __restrict__ w, const u16* __restrict__ scales,
         const u16* __restrict__ mins, void* __restrict__ y, i64 y_stride, int M, int N, int K, int group_size,
         int y_f32 NORM_PARAMS PNORM_PARAMS CATCHUP_PARAMS HWOUT_PARAMS RSCALE_PARAMS) {
  PDL_LAUNCH();
#if MMA_XS
  extern __shared__ uint4 xs_raw[];  // the normed row, or M rows of K + 8 activations (MMA_XSMEM)
  act* const xs = (act*)xs_raw;
#endif
#if GEMV_PNORM
  PNORM_WEIGHTS();
#endif
#if GEMV_CATCHUP
  u32 cu[2];  // warp 0's residual columns, one add caught up (stored in the epilogue)
#endif
#if GEMV_RSCALE
  RSCALE_BUF();
#endif
#if GEMV_HWOUT
  u32 hwe[3] = {0u, 0u, 0u};  // HW_EARLY: warp 0's residual columns and norm weights
#endif
  // after the PDL wait: the residual's catch-up loads, the normed row, a split norm's sums, HW_EARLY's loads
  auto after_wait = [&]() {
#if GEMV_CATCHUP
    catchup_load(cu, yp, yp_stride, rr, rr_stride, blockIdx.x * 16, N, M);
#endif
#if GEMV_HWOUT
    if (HW_EARLY) hwout_load(hwe, hw_rr, hw_rr_stride, hw_w, blockIdx.x * 16, N, M);
#endif
#if GEMV_RSCALE
    rscale_copy(rs_buf, rs_parts, rs_stride, M);  // waited for before the epilogue
#endif
#if GEMV_PNORM
    pnorm_row(x, pn_rr, pn_w, xs, K, pn_eps, pn_nt, pn_wpre);
#elif MMA_XSMEM
    for (int m = 0; m < M; ++m)  // every copy in flight at once, then one barrier
      for (int c = threadIdx.x; c < K / 8; c += MMA_WARPS * 32)
        cp_async16(xs + m * (K + 8) + 8 * c, x + m * x_stride + 8 * c);
    cp_async_wait_all();
    __syncthreads();
#endif
  };
#if MMA_L2PF
  {
    const i64 row_bytes = MMA_FMT == 0 ? 2 * (i64)K : MMA_FMT == 1 ? (i64)K : (i64)K / 2;
    const int rows0 = blockIdx.x * 16, rows = min(16, N - rows0);
#if MMA_L2PF_K
#pragma unroll
    for (int i = 0; i < MMA_L2PF; ++i) {
      const int j = i * blockDim.x + threadIdx.x;
      const i64 col = (i64)(j >> 4) * 128;
      if ((j & 15) < rows && col < row_bytes) prefetch_l2(w + (rows0 + (j & 15)) * row_bytes + col);
    }
#else
    prefetch_region_l2<MMA_L2PF>(w + rows0 * row_bytes, rows * row_bytes);
#endif
  }
#endif
#if !MMA_EARLY_W
  PDL_WAIT();
  after_wait();
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  const i64 r0 = min(n0 + g, N - 1), r1 = min(n0 + g + 8, N - 1);  // rows past N: read, never stored
  const bool has_x = g < M;
  const act* xr = x + (has_x ? g : 0) * x_stride;
  const uint4 ZERO4 = {0u, 0u, 0u, 0u};
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};

#if MMA_FMT == 0
  const u16* w0 = (const u16*)w + r0 * K + 8 * t;
  const u16* w1 = (const u16*)w + r1 * K + 8 * t;
  const int iters = K / 32;
#if MMA_PIPE
  // MMA_PIPE iterations in flight a warp, as a rolling pipeline (gemv_tiled.cu's stages): iteration
  // j + MMA_PIPE is loaded into the slot iteration j leaves, so its loads stay ahead of the mmas that
  // wait for j + 1 (the loop below leaves ptxas one iteration in flight: too few bytes where a shape
  // has 1-3 blocks an SM). The mmas run in the loop's order: the same bits. Loads volatile
  // (common.cuh), the activations coherent, so ptxas keeps them after the PDL wait.
  constexpr int STEP = MMA_WARPS * 32;  // elements from one of a warp's iterations to its next
  const int n = iters > warp ? (iters - warp + MMA_WARPS - 1) / MMA_WARPS : 0;  // this warp's iterations
  const u16* pa = w0 + warp * 32;
  const u16* pb = w1 + warp * 32;
#if MMA_XS
#if GEMV_PNORM
  const act* px = xs + warp * 32 + 8 * t;  // one row
#else
  const act* px = xs + (has_x ? g : 0) * (K + 8) + warp * 32 + 8 * t;
#endif
  auto ldx = [&](const act* p) { return *(const uint4*)p; };
#else
  const act* px = xr + warp * 32 + 8 * t;
  auto ldx = [&](const act* p) { return ld_act(p); };
#endif
  uint4 a[MMA_PIPE], b[MMA_PIPE], xv[MMA_PIPE];
  auto load = [&](int p, int i) {  // iteration base + i (pointers at base) into slot p
    a[p] = ld_stream(pa + i * STEP);
    b[p] = ld_stream(pb + i * STEP);
    xv[p] = has_x ? ldx(px + i * STEP) : ZERO4;
  };
  auto compute = [&](int p) {
    mma16816(acc, a[p].x, b[p].x, a[p].y, b[p].y, xv[p].x, xv[p].y);
    mma16816(acc, a[p].z, b[p].z, a[p].w, b[p].w, xv[p].z, xv[p].w);
  };
#if MMA_EARLY_W
#pragma unroll
  for (int p = 0; p < MMA_PIPE; ++p)
    if (p < n) {  // the first weights, coherent, before the wait; the activations after it
      a[p] = ld_stream(pa + p * STEP, false);
      b[p] = ld_stream(pb + p * STEP, false);
    }
  PDL_WAIT();
  after_wait();
#pragma unroll
  for (int p = 0; p < MMA_PIPE; ++p)
    if (p < n) xv[p] = has_x ? ldx(px + p * STEP) : ZERO4;
#else
#pragma unroll
  for (int p = 0; p < MMA_PIPE; ++p)
    if (p < n) load(p, p);
#endif
  int base = 0;
  for (; base + 2 * MMA_PIPE <= n; base += MMA_PIPE) {
#pragma unroll
    for (int p = 0; p < MMA_PIPE; ++p) {
      compute(p);
      load(p, p + MMA_PIPE);
    }
    pa += MMA_PIPE * STEP;
    pb += MMA_PIPE * STEP;
    px += MMA_PIPE * STEP;
  }
#pragma unroll
  for (int p = 0; p < MMA_PIPE; ++p) {
    if (base + p < n) {
      compute(p);
      if (base + p + MMA_PIPE < n) load(p, p + MMA_PIPE);
    }
  }
#pragma unroll
  for (int p = 0; p < MMA_PIPE; ++p)
    if (base + MMA_PIPE + p < n) compute(p);
#else
#pragma unroll 4
  for (int it = warp; it < iters; it += MMA_WARPS) {
    const int kb = it * 32;
    const uint4 a = __ldg((const uint4*)(w0 + kb));
    const uint4 b = __ldg((const uint4*)(w1 + kb));
    const uint4 xv = has_x ? __ldg((const uint4*)(xr + kb + 8 * t)) : ZERO4;
    mma16816(acc, a.x, b.x, a.y, b.y, xv.x, xv.y);
    mma16816(acc, a.z, b.z, a.w, b.w, xv.z, xv.w);
  }
#endif
#elif MMA_FMT == 1
  // int8 rows interleaved (gemv_pack): in each 64-byte block (64 k), lane t's 16 bytes hold word t
  // of its four 16-wide chunks. With u = q ^ 0x80 = 16 uh + ul, q = 16 (uh - 8) + ul: per chunk one
  // mma over the low nibbles and one over the high ones (bytes 0 and 2, then 1 and 3, pair up as the
  // activations (x0, x2), (x1, x3) do), and the group scale on 16 c_hi + c_lo.
  const int ngroups = K / group_size;
  const int gshift = 31 - __clz(group_size >> 4);  // group sizes are 16 << gshift
  const u16* s0p = scales + r0 * ngroups;
  const u16* s1p = scales + r1 * ngroups;
  const u8* w0 = w + r0 * K + 16 * t;
  const u8* w1 = w + r1 * K + 16 * t;
  const uint2 ZERO2 = {0u, 0u};
  const int iters = K / 64;
#pragma unroll 2
  for (int it = warp; it < iters; it += MMA_WARPS) {
    const int kb = it * 64;
    const uint4 wa4 = __ldg((const uint4*)(w0 + kb)), wb4 = __ldg((const uint4*)(w1 + kb));
    const u32 wa[4] = {wa4.x ^ 0x80808080u, wa4.y ^ 0x80808080u, wa4.z ^ 0x80808080u, wa4.w ^ 0x80808080u};
    const u32 wb[4] = {wb4.x ^ 0x80808080u, wb4.y ^ 0x80808080u, wb4.z ^ 0x80808080u, wb4.w ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = kb + 16 * i + 4 * t;  // this lane's four k of chunk i
      const uint2 xv = has_x ? __ldg((const uint2*)(xr + k)) : ZERO2;
      const u32 b0 = __byte_perm(xv.x, xv.y, 0x5410), b1 = __byte_perm(xv.x, xv.y, 0x7632);
      float cl[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ch[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma16816(cl, bf16_pair(wa[i], 0, NEG128), bf16_pair(wb[i], 0, NEG128), bf16_pair(wa[i], 8, NEG128),
               bf16_pair(wb[i], 8, NEG128), b0, b1);
      mma16816(ch, bf16_pair(wa[i], 4, NEG136), bf16_pair(wb[i], 4, NEG136), bf16_pair(wa[i], 12, NEG136),
               bf16_pair(wb[i], 12, NEG136), b0, b1);
      const int grp = ((kb + 16 * i) >> 4) >> gshift;
      const float s0 = f16_to_f32(__ldg(s0p + grp)), s1 = f16_to_f32(__ldg(s1p + grp));
      acc[0] = fmaf(fmaf(ch[0], 16.0f, cl[0]), s0, acc[0]);
      acc[1] = fmaf(fmaf(ch[1], 16.0f, cl[1]), s0, acc[1]);
      acc[2] = fmaf(fmaf(ch[2], 16.0f, cl[2]), s1, acc[2]);
      acc[3] = fmaf(fmaf(ch[3], 16.0f, cl[3]), s1, acc[3]);
    }
  }
#else
  const i64 row_bytes = K / 2;
  const int ngroups = K / group_size;
  const int gshift = 31 - __clz(group_size >> 5);  // group sizes are 32 << gshift
  const u16* s0p = scales + r0 * ngroups;
  const u16* s1p = scales + r1 * ngroups;
#if MMA_FMT == 3
  const u16* m0p = mins + r0 * ngroups;
  const u16* m1p = mins + r1 * ngroups;
#define MINS_ARGS m0p, m1p
#else
#define MINS_ARGS nullptr, nullptr
#endif
#if MMA_WIDE
  // interleaved rows (gemv_pack): in each 64-byte block (128 k), lane t's 16 bytes hold word t of
  // its four 32-wide chunks, so the four lanes of a row read 64 contiguous bytes
  const u8* w0 = w + r0 * row_bytes + 16 * t;
  const u8* w1 = w + r1 * row_bytes + 16 * t;
  const int iters = K / 128;
#pragma unroll 2
  for (int it = warp; it < iters; it += MMA_WARPS) {
    const int kb = it * 128;
    const uint4 wa4 = __ldg((const uint4*)(w0 + kb / 2)), wb4 = __ldg((const uint4*)(w1 + kb / 2));
    const u32 wa[4] = {wa4.x, wa4.y, wa4.z, wa4.w}, wb[4] = {wb4.x, wb4.y, wb4.z, wb4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) int4_chunk(acc, wa[i], wb[i], xr, kb + 32 * i, t, has_x, s0p, s1p, MINS_ARGS, gshift);
  }
#else
  // rows as stored: lane t reads word t of each 32-wide chunk (16 bytes of a row per warp load)
  const u8* w0 = w + r0 * row_bytes + 4 * t;
  const u8* w1 = w + r1 * row_bytes + 4 * t;
  const int iters = K / 32;
#pragma unroll 4
  for (int it = warp; it < iters; it += MMA_WARPS) {
    const int kb = it * 32;
    int4_chunk(acc, __ldg((const u32*)(w0 + kb / 2)), __ldg((const u32*)(w1 + kb / 2)), xr, kb, t, has_x, s0p, s1p,
               MINS_ARGS, gshift);
  }
#endif
#endif

#if GEMV_RSCALE
  rscale_rows(rs_inv, rs_buf, M, K, rs_eps, MMA_WARPS);
#endif
  tile_epilogue<MMA_WARPS>(acc, MMA_WARPS, n0, N, M, y, y_stride,
                           y_f32 NORM_ARGS CATCHUP_ARGS HWOUT_ARGS RSCALE_ARGS);  // common.cuh
}
