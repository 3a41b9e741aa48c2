/* CPU decode kernels of the torch backend (ninfer/kernels/cpu_native.py builds and loads this file).
 *
 * The few-row (decode) matmuls over int4 / int8 weights and the small ops around them, fused so a
 * decode step makes a handful of calls per layer instead of ~35 aten ops. Numerics follow the torch
 * route (torch_ops.Linear's `_weight_int4pack_mm_for_cpu`): bf16 activations times the dequantized
 * weight, accumulated in float32, the output rounded to bf16 where torch's is; activations are never
 * quantized.
 *
 * Weight layouts (cpu_native.NativeWeight builds them): tiles of 16 output rows, so a vector's lanes
 * are 16 outputs and a tile's sums need no horizontal reduction; a tile's bytes are contiguous.
 *   int4: per tile, per block of 32 inputs, 4 groups of 32 16-bit words. Vector v (0..15) of a block
 *         holds inputs 2v, 2v + 1 of the 16 rows as 32 codes (code 2 * lane + p: row lane, input
 *         2v + p, the pairs vdpbf16ps sums); word j of group i holds code j of vectors i, i + 4, i + 8,
 *         i + 12 in its four nibbles, low first. Scales and zeros [tiles][k/32][16] bf16:
 *         w = (q - 8) * scale + zero (torch's packed semantics). n % 16 == 0, k % 32 == 0.
 *   int8: per tile [k][16] int8 (input-major), scales [tiles][k/32][16] bf16: w = q * scale.
 *
 * Threads: the matmuls split their tiles over an OpenMP team of the calling thread. This file links
 * the libgomp torch loaded (same soname, so the loader reuses it): torch's ops and these share one
 * runtime and, on the engine's worker thread, one team of torch.set_num_threads() threads.
 * The AVX-512 BF16 int4 kernel is picked at run time; everything else is plain C that the compiler
 * vectorizes for AVX-512 and AVX2 (target_clones), with a baseline x86-64 clone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define EXPORT __attribute__((visibility("default")))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 16 floats as one value (GCC vector extensions: an AVX-512 register in the x86-64-v4 clone, two
 * AVX2 ones in the v3 clone): the attention's dot products without a scalar reduction per element. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int v16i __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))

INLINE v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE float sum16(v16f v) {
    v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += h[i];
    return s;
}

/* exp(x) of 16 values x <= 0 (softmax after the max is taken out): Cephes' expf, 2^n times a
 * degree-6 polynomial on |r| <= ln2/2, within ~2 ulp of libm's expf, which no loop vectorizes.
 * Below -87 it returns exp(-87) (~1.6e-38) instead of a denormal or zero. */
INLINE v16f exp16_nonpositive(v16f x) {
    const v16f lo = x - x - 87.0f, magic = x - x + 12582912.0f;  /* 1.5 * 2^23: round to integer */
    const v16i below = x < lo;
    x = (v16f)((below & (v16i)lo) | (~below & (v16i)x));
    v16f n = (x * 1.44269504088896341f + magic) - magic;
    v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#define MAX_ROWS 8
#define BLOCK 32
#define TILE 16
#ifndef PREFETCH
#define PREFETCH 2048  /* bytes ahead in a weight stream: 7 -> 12 GB/s on one thread, cold 3072 x 576 int4 */
#endif

/* One matmul's arguments: x [rows][k] bf16 times the weight of n rows. */
typedef struct {
    const uint16_t *x;
    int rows, k, n;
    const uint8_t *q;
    const uint16_t *scales, *zeros;  /* [n/16][k/group][16] bf16 (zeros: int4, 5- / 6-bit; int8 where given) */
    int group;  /* inputs per scale: 32 (int4, 5-bit), 16 (6-bit), 32 or 16 (int8) */
    const float *xf;  /* x as float32 [rows][k] */
    const float *xsum;  /* sum of x over each group of inputs, [rows][k/group] */
} matmul;

/* ---- int4 tile: y[r][lane] = sum over blocks of scale * sum (q - 8) x + zero * sum x ------------- */

#if defined(__x86_64__)
/* bf16 bits 0x4300 | q are the number 128 + q (q < 16): a nibble becomes bf16 with one AND-OR,
 * and sum (q - 8) x = sum (128 + q) x - 136 sum x, the last term folded into the zero's. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void int4_tile_avx512bf16_rows(const matmul *m, int t, float *y, const int rows) {
    const __m512i low4 = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300);
    const int blocks = m->k / BLOCK;
    const uint8_t *q = m->q + (size_t)t * TILE * (m->k / 2);
    const uint16_t *s = m->scales + (size_t)t * blocks * TILE, *z = m->zeros + (size_t)t * blocks * TILE;
    __m512 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)(q + (4 * b + i) * 64 + PREFETCH), _MM_HINT_T0);
            __m512i w = _mm512_loadu_si512(q + (4 * b + i) * 64);
            __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(w, low4, bias, 0xea);  /* (w & low4) | bias */
            __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low4, bias, 0xea);
            __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low4, bias, 0xea);
            __m512bh w3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), bias);
            for (int r = 0; r < rows; r++) {
                const uint32_t *xw = (const uint32_t *)(m->x + (size_t)r * m->k) + 16 * b + i;  /* input pairs */
                acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)xw[0]), w0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)_mm512_set1_epi32((int)xw[4]), w1);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)xw[8]), w2);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)_mm512_set1_epi32((int)xw[12]), w3);
            }
        }
        __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + b * TILE))), 16));
        __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(z + b * TILE))), 16));
        zv = _mm512_fnmadd_ps(sv, _mm512_set1_ps(136.0f), zv);
        for (int r = 0; r < rows; r++) {
            total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc0[r], acc1[r]), sv, total[r]);
            total[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(m->xsum[(size_t)r * blocks + b]), total[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * TILE, total[r]);
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void int4_tile_avx512bf16(const matmul *m, int t, float *y) {
    switch (m->rows) {  /* a copy per row count: the accumulators stay in registers */
        case 1: int4_tile_avx512bf16_rows(m, t, y, 1); break;
        case 2: int4_tile_avx512bf16_rows(m, t, y, 2); break;
        case 3: int4_tile_avx512bf16_rows(m, t, y, 3); break;
        case 4: int4_tile_avx512bf16_rows(m, t, y, 4); break;
        default: int4_tile_avx512bf16_rows(m, t, y, m->rows); break;
    }
}
#endif

CLONES
static void int4_tile_plain(const matmul *m, int t, float *y) {
    const int blocks = m->k / BLOCK;
    const uint8_t *q = m->q + (size_t)t * TILE * (m->k / 2);
    const uint16_t *s = m->scales + (size_t)t * blocks * TILE, *z = m->zeros + (size_t)t * blocks * TILE;
    for (int r = 0; r < m->rows; r++) {
        const float *x = m->xf + (size_t)r * m->k;
        float total[TILE] = {0};
        for (int b = 0; b < blocks; b++) {
            float acc[TILE] = {0};
            for (int v = 0; v < 16; v++) {  /* inputs 2v, 2v + 1 of the block: nibble v / 4 of group v % 4 */
                uint16_t words[2 * TILE];
                memcpy(words, q + (4 * b + v % 4) * 64, sizeof words);
                const int shift = 4 * (v / 4);
                const float x0 = x[BLOCK * b + 2 * v], x1 = x[BLOCK * b + 2 * v + 1];
#pragma omp simd
                for (int lane = 0; lane < TILE; lane++)
                    acc[lane] += (float)(((words[2 * lane] >> shift) & 15) - 8) * x0 +
                                 (float)(((words[2 * lane + 1] >> shift) & 15) - 8) * x1;
            }
            const float xs = m->xsum[(size_t)r * blocks + b];
#pragma omp simd
            for (int lane = 0; lane < TILE; lane++)
                total[lane] += acc[lane] * bf16_to_f32(s[b * TILE + lane]) + bf16_to_f32(z[b * TILE + lane]) * xs;
        }
        memcpy(y + r * TILE, total, sizeof total);
    }
}

static int avx512bf16_allowed = 1;  /* nf_allow_avx512bf16: tests run the plain C route too */

static int use_avx512bf16(void) {
#if defined(__x86_64__)
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512bf16");
    }
    return cached && avx512bf16_allowed;
#else
    return 0;
#endif
}

static inline void int4_tile(const matmul *m, int t, float *y) {
#if defined(__x86_64__)
    if (use_avx512bf16()) {
        int4_tile_avx512bf16(m, t, y);
        return;
    }
#endif
    int4_tile_plain(m, t, y);
}

/* ---- int8 tile: y[r][lane] = sum over groups of scale * sum q x (+ zero * sum x) ---------------- */

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void int8_tile_avx512_rows(const matmul *m, int t, float *y, const int rows, const int group) {
    const int groups = m->k / group;
    const int8_t *q = (const int8_t *)m->q + (size_t)t * TILE * m->k;
    const uint16_t *s = m->scales + (size_t)t * groups * TILE;
    const uint16_t *z = m->zeros ? m->zeros + (size_t)t * groups * TILE : NULL;
    __m512 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int b = 0; b < groups; b++) {
        __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int j = 0; j < group; j += 2) {
            const int8_t *w = q + (size_t)(group * b + j) * TILE;
            _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + TILE))));
            for (int r = 0; r < rows; r++) {
                const float *x = m->xf + (size_t)r * m->k + group * b + j;
                acc0[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[0]), acc0[r]);
                acc1[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[1]), acc1[r]);
            }
        }
        __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + b * TILE))), 16));
        for (int r = 0; r < rows; r++) total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc0[r], acc1[r]), sv, total[r]);
        if (z) {
            __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(z + b * TILE))), 16));
            for (int r = 0; r < rows; r++)
                total[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(m->xsum[(size_t)r * groups + b]), total[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * TILE, total[r]);
}

__attribute__((target("avx512f,avx512bw")))
static void int8_tile_avx512(const matmul *m, int t, float *y) {
    const int g16 = m->group == 16;  /* the group a constant in each instance: its loop unrolled */
    switch (m->rows) {
        case 1: g16 ? int8_tile_avx512_rows(m, t, y, 1, 16) : int8_tile_avx512_rows(m, t, y, 1, BLOCK); break;
        case 2: g16 ? int8_tile_avx512_rows(m, t, y, 2, 16) : int8_tile_avx512_rows(m, t, y, 2, BLOCK); break;
        default:
            g16 ? int8_tile_avx512_rows(m, t, y, m->rows, 16) : int8_tile_avx512_rows(m, t, y, m->rows, BLOCK);
            break;
    }
}
#endif

CLONES
static void int8_tile_plain(const matmul *m, int t, float *y) {
    const int group = m->group, groups = m->k / group;
    const int8_t *q = (const int8_t *)m->q + (size_t)t * TILE * m->k;
    const uint16_t *s = m->scales + (size_t)t * groups * TILE;
    const uint16_t *z = m->zeros ? m->zeros + (size_t)t * groups * TILE : NULL;
    for (int r = 0; r < m->rows; r++) {
        const float *x = m->xf + (size_t)r * m->k;
        float total[TILE] = {0};
        for (int b = 0; b < groups; b++) {
            float acc[TILE] = {0};
            for (int j = 0; j < group; j++) {
                const float xj = x[group * b + j];
                const int8_t *w = q + (size_t)(group * b + j) * TILE;
#pragma omp simd
                for (int lane = 0; lane < TILE; lane++) acc[lane] += xj * (float)w[lane];
            }
#pragma omp simd
            for (int lane = 0; lane < TILE; lane++) total[lane] += acc[lane] * bf16_to_f32(s[b * TILE + lane]);
            if (z) {
                const float xs = m->xsum[(size_t)r * groups + b];
#pragma omp simd
                for (int lane = 0; lane < TILE; lane++) total[lane] += bf16_to_f32(z[b * TILE + lane]) * xs;
            }
        }
        memcpy(y + r * TILE, total, sizeof total);
    }
}

static inline void int8_tile(const matmul *m, int t, float *y) {
#if defined(__x86_64__)
    if (use_avx512bf16()) {  /* the CPUs with AVX-512 BF16 have AVX-512 F and BW */
        int8_tile_avx512(m, t, y);
        return;
    }
#endif
    int8_tile_plain(m, t, y);
}

/* ---- 5- and 6-bit tiles (kind 5: q5_0 / q5_1 / q5_k, group 32; kind 6: q6_k, group 16) --------------
 * Codes 0 <= q < 2^kind, w = scale * q + zero per group. Layout per tile: int4's low nibbles (the
 * same words), then the high bits: kind 5, one 64-byte vector per block whose word holds bit
 * 4i + n for iteration i, nibble n; kind 6, two vectors per block, vector i / 2 holding 2 bits at
 * 8 (i % 2) + 2n. bf16 bits 0x4300 | q are 128 + q (q < 128): sum w x = scale (sum (128 + q) x -
 * 128 sum x) + zero sum x. */

#if defined(__x86_64__)
/* low | the high bits of nibble n of iteration i (moved to bits 4.. of each 16-bit word): one shift
 * and one ternary-logic op ((moved & mask) | low) */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline __m512i with_high_bits(__m512i low, __m512i h, const int kind, const int i, const int n) {
    const int hb = kind - 4, at = hb == 1 ? 4 * i + n : 8 * (i % 2) + 2 * n;
    const __m512i mask = _mm512_set1_epi16((short)(((1 << hb) - 1) << 4));
    const __m512i moved = at == 4 ? h : at < 4 ? _mm512_slli_epi16(h, 4 - at) : _mm512_srli_epi16(h, at - 4);
    return _mm512_ternarylogic_epi32(moved, mask, low, 0xea);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void wide_tile_avx512bf16_rows(const matmul *m, int t, float *y, const int rows, const int kind) {
    const __m512i low4 = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300);
    const int blocks = m->k / BLOCK, hvec = kind - 4;  /* high-bit vectors a block */
    const int group = kind == 6 ? 16 : BLOCK, gpb = BLOCK / group, groups = m->k / group;
    const uint8_t *q = m->q + (size_t)t * TILE * (m->k / 2);
    const uint8_t *hq = m->q + (size_t)m->n * (m->k / 2) + (size_t)t * blocks * hvec * 64;
    const uint16_t *s = m->scales + (size_t)t * groups * TILE, *z = m->zeros + (size_t)t * groups * TILE;
    __m512 total[MAX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];  /* group 16: inputs 0..15, 16..31; group 32: halves of one sum */
        for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)(q + (4 * b + i) * 64 + PREFETCH), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(q + (4 * b + i) * 64);
            const __m512i h = _mm512_loadu_si512(hq + (size_t)(hvec * b + (kind == 6 ? i / 2 : 0)) * 64);
            __m512bh w0 = (__m512bh)with_high_bits(_mm512_ternarylogic_epi32(w, low4, bias, 0xea), h, kind, i, 0);
            __m512bh w1 = (__m512bh)with_high_bits(
                _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low4, bias, 0xea), h, kind, i, 1);
            __m512bh w2 = (__m512bh)with_high_bits(
                _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low4, bias, 0xea), h, kind, i, 2);
            __m512bh w3 = (__m512bh)with_high_bits(_mm512_or_si512(_mm512_srli_epi16(w, 12), bias), h, kind, i, 3);
            for (int r = 0; r < rows; r++) {
                const uint32_t *xw = (const uint32_t *)(m->x + (size_t)r * m->k) + 16 * b + i;  /* input pairs */
                acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)xw[0]), w0);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)xw[4]), w1);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)_mm512_set1_epi32((int)xw[8]), w2);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)_mm512_set1_epi32((int)xw[12]), w3);
            }
        }
        for (int g = 0; g < gpb; g++) {
            const int at = b * gpb + g;
            __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + at * TILE))), 16));
            __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(z + at * TILE))), 16));
            zv = _mm512_fnmadd_ps(sv, _mm512_set1_ps(128.0f), zv);
            for (int r = 0; r < rows; r++) {
                __m512 acc = gpb == 1 ? _mm512_add_ps(acc0[r], acc1[r]) : g == 0 ? acc0[r] : acc1[r];
                total[r] = _mm512_fmadd_ps(acc, sv, total[r]);
                total[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(m->xsum[(size_t)r * groups + at]), total[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * TILE, total[r]);
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void wide_tile_avx512bf16(const matmul *m, int t, float *y, const int kind) {
    switch (m->rows) {
        case 1: kind == 6 ? wide_tile_avx512bf16_rows(m, t, y, 1, 6) : wide_tile_avx512bf16_rows(m, t, y, 1, 5); break;
        case 2: kind == 6 ? wide_tile_avx512bf16_rows(m, t, y, 2, 6) : wide_tile_avx512bf16_rows(m, t, y, 2, 5); break;
        default:
            kind == 6 ? wide_tile_avx512bf16_rows(m, t, y, m->rows, 6) : wide_tile_avx512bf16_rows(m, t, y, m->rows, 5);
            break;
    }
}
#endif

CLONES
static void wide_tile_plain(const matmul *m, int t, float *y, const int kind) {
    const int blocks = m->k / BLOCK, hvec = kind - 4, hb = kind - 4;
    const int group = kind == 6 ? 16 : BLOCK, groups = m->k / group;
    const uint8_t *q = m->q + (size_t)t * TILE * (m->k / 2);
    const uint8_t *hq = m->q + (size_t)m->n * (m->k / 2) + (size_t)t * blocks * hvec * 64;
    const uint16_t *s = m->scales + (size_t)t * groups * TILE, *z = m->zeros + (size_t)t * groups * TILE;
    for (int r = 0; r < m->rows; r++) {
        const float *x = m->xf + (size_t)r * m->k;
        float total[TILE] = {0};
        for (int g = 0; g < groups; g++) {
            float acc[TILE] = {0};
            for (int e = group * g; e < group * (g + 1); e++) {  /* input e: pair v = (e % 32) / 2 */
                const int b = e / BLOCK, v = (e % BLOCK) / 2, p = e % 2, i = v % 4, n = v / 4;
                uint16_t lo[2 * TILE], hi[2 * TILE];
                memcpy(lo, q + (4 * b + i) * 64, sizeof lo);
                memcpy(hi, hq + (size_t)(hvec * b + (kind == 6 ? i / 2 : 0)) * 64, sizeof hi);
                const int at = hb == 1 ? 4 * i + n : 8 * (i % 2) + 2 * n;
#pragma omp simd
                for (int lane = 0; lane < TILE; lane++) {
                    const int code = ((lo[2 * lane + p] >> (4 * n)) & 15) | (((hi[2 * lane + p] >> at) & ((1 << hb) - 1)) << 4);
                    acc[lane] += (float)code * x[e];
                }
            }
            const float xs = m->xsum[(size_t)r * groups + g];
#pragma omp simd
            for (int lane = 0; lane < TILE; lane++)
                total[lane] += acc[lane] * bf16_to_f32(s[g * TILE + lane]) + bf16_to_f32(z[g * TILE + lane]) * xs;
        }
        memcpy(y + r * TILE, total, sizeof total);
    }
}

static inline void wide_tile(const matmul *m, int t, float *y, const int kind) {
#if defined(__x86_64__)
    if (use_avx512bf16()) {
        wide_tile_avx512bf16(m, t, y, kind);
        return;
    }
#endif
    wide_tile_plain(m, t, y, kind);
}

/* A tile of any kind (4, 5, 6, 8), and the inputs per scale of a kind (int8: as given). */
static inline void tile_of(const matmul *m, int kind, int t, float *y) {
    if (kind == 4) int4_tile(m, t, y);
    else if (kind == 8) int8_tile(m, t, y);
    else wide_tile(m, t, y, kind);
}

static inline int group_of(int kind, int group) { return kind == 8 ? group : kind == 6 ? 16 : BLOCK; }

/* ---- inputs, and the split of tiles over the team ------------------------------------------------ */

CLONES
static void prepare_inputs(matmul *m, float *xf, float *xsum) {
    for (int i = 0; i < m->rows * m->k; i++) xf[i] = bf16_to_f32(m->x[i]);
    const int g = m->group;
    for (int i = 0; i < m->rows * (m->k / g); i++) {
        float a = 0.0f;
        for (int j = 0; j < g; j++) a += xf[g * i + j];
        xsum[i] = a;
    }
    m->xf = xf;
    m->xsum = xsum;
}

/* This thread's share [*t0, *t1) of n tiles. */
static void my_tiles(int n, int *t0, int *t1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int per = (n + nt - 1) / nt;
    *t0 = t * per < n ? t * per : n;
    *t1 = *t0 + per < n ? *t0 + per : n;
}

/* Worth a parallel region: below this many weight bytes one thread is done before a team wakes. */
#define PARALLEL_BYTES (64 * 1024)

/* ---- entry points -------------------------------------------------------------------------------- */

EXPORT int nf_abi(void) { return 5; }

EXPORT int nf_isa(void) {
#if defined(__x86_64__)
    return use_avx512bf16() ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

EXPORT void nf_allow_avx512bf16(int allow) { avx512bf16_allowed = allow; }

/* y = x @ w^T over an int4 (kind 4, group 32), int8 (kind 8, group 32 or 16, zeros or NULL), 5-bit
 * (kind 5, group 32) or 6-bit (kind 6, group 16) weight:
 * y_bf16 [rows][n] rounded to bf16, and/or y_f32 [rows][n] (the bf16-rounded value widened, as the
 * torch route's `.to(float32)` gives). */
EXPORT void nf_linear(int kind, const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *scales,
                      const uint16_t *zeros, int n, int group, uint16_t *y_bf16, float *y_f32) {
    matmul m = {x, rows, k, n, q, scales, zeros, group_of(kind, group), NULL, NULL};
    float *xf = malloc(sizeof(float) * (size_t)rows * (k + k / m.group));
    prepare_inputs(&m, xf, xf + (size_t)rows * k);
    size_t bytes = (size_t)n * k * kind / 8;
#pragma omp parallel if (bytes >= PARALLEL_BYTES)
    {
        int t0, t1;
        my_tiles(n / TILE, &t0, &t1);
        float y[MAX_ROWS * TILE];
        for (int t = t0; t < t1; t++) {
            tile_of(&m, kind, t, y);
            for (int r = 0; r < rows; r++)
                for (int lane = 0; lane < TILE; lane++) {
                    uint16_t h = f32_to_bf16(y[r * TILE + lane]);
                    size_t at = (size_t)r * n + (size_t)t * TILE + lane;
                    if (y_bf16) y_bf16[at] = h;
                    if (y_f32) y_f32[at] = bf16_to_f32(h);
                }
        }
    }
    free(xf);
}

/* out [rows][n/2] = silu(gate) * up over a weight of any kind whose rows are [gate; up] (n rows), each
 * product rounded to bf16 as torch's bf16 ops round: silu(bf16 gate) -> bf16, times bf16 up -> bf16. */
EXPORT void nf_gated_silu(int kind, const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *scales,
                          const uint16_t *zeros, int n, int group, uint16_t *out) {
    matmul m = {x, rows, k, n, q, scales, zeros, group_of(kind, group), NULL, NULL};
    float *xf = malloc(sizeof(float) * (size_t)rows * (k + k / m.group));
    prepare_inputs(&m, xf, xf + (size_t)rows * k);
    const int half = n / 2;
#pragma omp parallel if ((size_t)n * k * kind / 8 >= PARALLEL_BYTES)
    {
        int t0, t1;
        my_tiles(half / TILE, &t0, &t1);
        float g[MAX_ROWS * TILE], u[MAX_ROWS * TILE];
        for (int t = t0; t < t1; t++) {
            tile_of(&m, kind, t, g);
            tile_of(&m, kind, half / TILE + t, u);
            for (int r = 0; r < rows; r++)
                for (int lane = 0; lane < TILE; lane++) {
                    float gate = round_bf16(g[r * TILE + lane]);
                    float silu = round_bf16(gate / (1.0f + expf(-gate)));
                    out[(size_t)r * half + (size_t)t * TILE + lane] = f32_to_bf16(silu * round_bf16(u[r * TILE + lane]));
                }
        }
    }
    free(xf);
}

/* RMSNorm of x [d] float32 times weight, into out bf16 (transformers' order: x * rsqrt(mean x^2 + eps),
 * then * weight, in float32). */
CLONES
static void rms_norm_row(const float *x, const float *weight, int d, float eps, uint16_t *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = f32_to_bf16(weight[i] * (x[i] * inv));
}

/* residual [rows][n] += x @ w^T (the product rounded to bf16 first, as the torch route's), then
 * out [rows][n] = bf16(RMSNorm(residual) * norm). */
EXPORT void nf_linear_add_rms_norm(int kind, const uint16_t *x, int rows, int k, const uint8_t *q,
                                   const uint16_t *scales, const uint16_t *zeros, int n, int group, float *residual,
                                   const float *norm, float eps, uint16_t *out) {
    nf_linear(kind, x, rows, k, q, scales, zeros, n, group, out, NULL);
    for (int r = 0; r < rows; r++) {
        float *h = residual + (size_t)r * n;
        const uint16_t *y = out + (size_t)r * n;
        for (int i = 0; i < n; i++) h[i] += bf16_to_f32(y[i]);
        rms_norm_row(h, norm, n, eps, out + (size_t)r * n);
    }
}

/* One query row's attention at position pos, float32, the cache paged:
 *   qkv [(heads + 2 kv_heads) d] bf16 (q | k | v); cos, sin [d] this position's RoPE row (sin signed
 *   as torch_ops.RotaryEmbedding keeps it: x' = x cos + roll(x, d/2) sin); k_cache, v_cache
 *   [pages * page_size][kv_heads][d] float32; block_table: the sequence's pages; d % 16 == 0.
 * RoPE on q and k, k and v stored at pos, then softmax(q k^T / sqrt(d)) v over positions 0..pos
 * -> out [heads d] bf16. The query heads of one kv head share each pass over its keys. */
CLONES
EXPORT void nf_attention_decode(const uint16_t *qkv, int heads, int kv_heads, int d, const float *cos,
                                const float *sin, float *k_cache, float *v_cache, const int64_t *block_table,
                                int page_size, int pos, uint16_t *out) {
    const int rows_qk = heads + kv_heads, half = d / 2, group = heads / kv_heads, ctx = pos + 1;
    const int padded = (ctx + 15) & ~15;  /* score rows padded to whole vectors */
    float *qk = malloc(sizeof(float) * ((size_t)rows_qk * d + (size_t)group * padded));
    float *scores = qk + (size_t)rows_qk * d;  /* [group][padded] */
    for (int h = 0; h < rows_qk; h++) {
        const uint16_t *src = qkv + (size_t)h * d;
        for (int i = 0; i < d; i++) {
            float x = bf16_to_f32(src[i]), rolled = bf16_to_f32(src[i < half ? i + half : i - half]);
            qk[(size_t)h * d + i] = x * cos[i] + rolled * sin[i];
        }
    }
    const size_t row = (size_t)kv_heads * d;
    const size_t slot = (size_t)block_table[pos / page_size] * page_size + pos % page_size;
    memcpy(k_cache + slot * row, qk + (size_t)heads * d, sizeof(float) * row);
    for (size_t i = 0; i < row; i++) v_cache[slot * row + i] = bf16_to_f32(qkv[(size_t)rows_qk * d + i]);
    const float scale = (float)(1.0 / sqrt((double)d));  /* torch_ops: q * d ** -0.5 */
    for (int i = 0; i < heads * d; i++) qk[i] *= scale;
    for (int g = 0; g < kv_heads; g++) {
        const float *qg = qk + (size_t)g * group * d;  /* the group's query heads, [group][d] */
        for (int j = 0; j < group; j++)
            for (int t = ctx; t < padded; t++) scores[(size_t)j * padded + t] = -INFINITY;
        for (int t0 = 0; t0 < ctx; t0 += page_size) {  /* scores, a page at a time */
            const float *keys = k_cache + (size_t)block_table[t0 / page_size] * page_size * row + (size_t)g * d;
            const int n = ctx - t0 < page_size ? ctx - t0 : page_size;
            for (int t = 0; t < n; t++)
                for (int j = 0; j < group; j++) {
                    const float *qj = qg + (size_t)j * d, *kt = keys + (size_t)t * row;
                    v16f part = load16(qj) * load16(kt);
                    for (int i = 16; i < d; i += 16) part += load16(qj + i) * load16(kt + i);
                    scores[(size_t)j * padded + t0 + t] = sum16(part);
                }
        }
        for (int j = 0; j < group; j++) {  /* softmax: exp(s - max) / sum */
            float *sj = scores + (size_t)j * padded, sum = 0.0f;
            v16f top = load16(sj);
            for (int t = 16; t < padded; t += 16) {
                v16f v = load16(sj + t);
                const v16i more = v > top;
                top = (v16f)((more & (v16i)v) | (~more & (v16i)top));
            }
            float m = top[0];
            for (int i = 1; i < 16; i++) m = top[i] > m ? top[i] : m;
            for (int t = 0; t < padded; t += 16) {  /* the padding's exp(-inf) is ~0: not summed */
                v16f e = exp16_nonpositive(load16(sj + t) - m);
                memcpy(sj + t, &e, sizeof e);
            }
            for (int t = 0; t < ctx; t++) sum += sj[t];
            for (int t = 0; t < padded; t += 16) {
                v16f p = load16(sj + t) / sum;
                memcpy(sj + t, &p, sizeof p);
            }
        }
        for (int j = 0; j < group; j++) {  /* out = probs v, 16 dims at a time in a register */
            const float *pj = scores + (size_t)j * padded;
            uint16_t *oj = out + (size_t)(g * group + j) * d;
            for (int i = 0; i < d; i += 16) {
                v16f acc = {0};
                for (int t0 = 0; t0 < ctx; t0 += page_size) {
                    const float *values = v_cache + (size_t)block_table[t0 / page_size] * page_size * row + (size_t)g * d + i;
                    const int n = ctx - t0 < page_size ? ctx - t0 : page_size;
                    for (int t = 0; t < n; t++) acc += pj[t0 + t] * load16(values + (size_t)t * row);
                }
                for (int l = 0; l < 16; l++) oj[i + l] = f32_to_bf16(acc[l]);
            }
        }
    }
    free(qk);
}
