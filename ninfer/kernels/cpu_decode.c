/* CPU decode kernels of the torch backend (ninfer/kernels/cpu_native.py builds and loads this file).
 *
 * The few-row (decode) matmuls over int4 / int8 weights and the small ops around them, fused so a
 * decode step makes a handful of calls per layer instead of ~35 aten ops. Numerics follow the torch
 * route (torch_ops.Linear's `_weight_int4pack_mm_for_cpu`): bf16 activations times the dequantized
 * weight, accumulated in float32, the output rounded to bf16 where torch's is; activations are never
 * quantized.
 *
 * Weight layouts (cpu_native.py builds them):
 *   int4: q [n][k/2] bytes; in each chunk of 64 inputs, byte j (0..31) holds input j in its low
 *         nibble and input 32 + j in its high one; scales, zeros [n][k/32] bf16, one per 32 inputs:
 *         w = (q - 8) * scale + zero (torch's packed semantics; k % 64 == 0).
 *   int8: q [n][k] int8, scales [n][k/32] bf16: w = q * scale (k % 32 == 0).
 *
 * Threads: the matmuls split their output rows over an OpenMP team of the calling thread. This file
 * links the libgomp torch loaded (same soname, so the loader reuses it): torch's ops and these share
 * one runtime and, on the engine's worker thread, one team of torch.set_num_threads() threads.
 * The AVX-512 BF16 int4 kernel is picked at run time; everything else is plain C that the compiler
 * vectorizes for AVX2 and AVX-512 (target_clones), with a baseline x86-64 clone.
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

#define MAX_ROWS 8
#define BLOCK 32

/* One matmul's arguments: x [rows][k] bf16 times the weight of n rows. */
typedef struct {
    const uint16_t *x;
    int rows, k, n;
    const uint8_t *q;  /* int4: [n][k/2]; int8: [n][k] */
    const uint16_t *scales, *zeros;  /* [n][k/32] bf16 (zeros: int4 only) */
    const float *xf;  /* int8, and the int4 fallback: x as float32 [rows][k] */
    const float *xsum;  /* int4: sum of x over each block of 32 inputs, [rows][k/32] */
} matmul;

/* ---- int4: y[r][o] = sum over blocks b of scale * sum (q - 8) x + zero * sum x ------------------- */

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void int4_dot_avx512bf16(const matmul *m, int o, float *y /* [rows] */) {
    /* nibble -> bf16(q - 8): vpermw's table (entries 16..31 unused) */
    static const uint16_t table[32] = {
        0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};
    const __m512i lut = _mm512_loadu_si512(table);
    const __m512i low4 = _mm512_set1_epi16(0x0f);
    const int blocks = m->k / BLOCK;
    const uint8_t *q = m->q + (size_t)o * (m->k / 2);
    const uint16_t *s = m->scales + (size_t)o * blocks, *z = m->zeros + (size_t)o * blocks;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < m->rows; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < m->k / 64; c++) {
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * c)));
        __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low4), lut);
        __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut);
        __m512 s0 = _mm512_set1_ps(bf16_to_f32(s[2 * c])), s1 = _mm512_set1_ps(bf16_to_f32(s[2 * c + 1]));
        for (int r = 0; r < m->rows; r++) {
            const uint16_t *x = m->x + (size_t)r * m->k + 64 * c;
            __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x), w0);
            __m512 d1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x + 32), w1);
            acc[r] = _mm512_fmadd_ps(d0, s0, acc[r]);
            acc[r] = _mm512_fmadd_ps(d1, s1, acc[r]);
        }
    }
    for (int r = 0; r < m->rows; r++) {
        const float *xs = m->xsum + (size_t)r * blocks;
        float zsum = 0.0f;
        for (int b = 0; b < blocks; b++) zsum += bf16_to_f32(z[b]) * xs[b];
        y[r] = _mm512_reduce_add_ps(acc[r]) + zsum;
    }
}
#endif

CLONES
static void int4_dot_generic(const matmul *m, int o, float *y) {
    const int blocks = m->k / BLOCK;
    const uint8_t *q = m->q + (size_t)o * (m->k / 2);
    const uint16_t *s = m->scales + (size_t)o * blocks, *z = m->zeros + (size_t)o * blocks;
    for (int r = 0; r < m->rows; r++) {
        const float *x = m->xf + (size_t)r * m->k, *xs = m->xsum + (size_t)r * blocks;
        float total = 0.0f;
        for (int c = 0; c < m->k / 64; c++) {
            float a0 = 0.0f, a1 = 0.0f;
#pragma omp simd reduction(+ : a0, a1)
            for (int j = 0; j < 32; j++) {
                int b = q[32 * c + j];
                a0 += (float)((b & 15) - 8) * x[64 * c + j];
                a1 += (float)((b >> 4) - 8) * x[64 * c + 32 + j];
            }
            total += a0 * bf16_to_f32(s[2 * c]) + a1 * bf16_to_f32(s[2 * c + 1]);
        }
        float zsum = 0.0f;
        for (int b = 0; b < blocks; b++) zsum += bf16_to_f32(z[b]) * xs[b];
        y[r] = total + zsum;
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

static inline void int4_dot(const matmul *m, int o, float *y) {
#if defined(__x86_64__)
    if (use_avx512bf16()) {
        int4_dot_avx512bf16(m, o, y);
        return;
    }
#endif
    int4_dot_generic(m, o, y);
}

/* ---- int8: y[r][o] = sum over blocks of scale * sum q x ---------------------------------------- */

CLONES
static void int8_dot(const matmul *m, int o, float *y) {
    const int blocks = m->k / BLOCK;
    const int8_t *q = (const int8_t *)m->q + (size_t)o * m->k;
    const uint16_t *s = m->scales + (size_t)o * blocks;
    for (int r = 0; r < m->rows; r++) {
        const float *x = m->xf + (size_t)r * m->k;
        float total = 0.0f;
        for (int b = 0; b < blocks; b++) {
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (int j = 0; j < BLOCK; j++) a += (float)q[BLOCK * b + j] * x[BLOCK * b + j];
            total += a * bf16_to_f32(s[b]);
        }
        y[r] = total;
    }
}

/* ---- inputs, and the split of output rows over the team ------------------------------------------ */

CLONES
static void prepare_inputs(matmul *m, float *xf, float *xsum) {
    for (int i = 0; i < m->rows * m->k; i++) xf[i] = bf16_to_f32(m->x[i]);
    for (int i = 0; i < m->rows * (m->k / BLOCK); i++) {
        float a = 0.0f;
        for (int j = 0; j < BLOCK; j++) a += xf[BLOCK * i + j];
        xsum[i] = a;
    }
    m->xf = xf;
    m->xsum = xsum;
}

/* This thread's share [*o0, *o1) of n output rows, in multiples of 16. */
static void my_rows(int n, int *o0, int *o1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int per = ((n + nt - 1) / nt + 15) & ~15;
    *o0 = t * per < n ? t * per : n;
    *o1 = *o0 + per < n ? *o0 + per : n;
}

/* Worth a parallel region: below this many weight bytes one thread is done before a team wakes. */
#define PARALLEL_BYTES (64 * 1024)

/* ---- entry points -------------------------------------------------------------------------------- */

EXPORT int nf_abi(void) { return 1; }

EXPORT int nf_isa(void) {
#if defined(__x86_64__)
    return use_avx512bf16() ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

EXPORT void nf_allow_avx512bf16(int allow) { avx512bf16_allowed = allow; }

/* y = x @ w^T over an int4 (kind 4) or int8 (kind 8) weight: y_bf16 [rows][n] rounded to bf16, and/or
 * y_f32 [rows][n] (the bf16-rounded value widened, as the torch route's `.to(float32)` gives). */
EXPORT void nf_linear(int kind, const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *scales,
                      const uint16_t *zeros, int n, uint16_t *y_bf16, float *y_f32) {
    matmul m = {x, rows, k, n, q, scales, zeros, NULL, NULL};
    float *xf = malloc(sizeof(float) * (size_t)rows * (k + k / BLOCK));
    prepare_inputs(&m, xf, xf + (size_t)rows * k);
    size_t bytes = (size_t)n * k / (kind == 4 ? 2 : 1);
#pragma omp parallel if (bytes >= PARALLEL_BYTES)
    {
        int o0, o1;
        my_rows(n, &o0, &o1);
        float y[MAX_ROWS];
        for (int o = o0; o < o1; o++) {
            if (kind == 4) int4_dot(&m, o, y);
            else int8_dot(&m, o, y);
            for (int r = 0; r < rows; r++) {
                uint16_t h = f32_to_bf16(y[r]);
                if (y_bf16) y_bf16[(size_t)r * n + o] = h;
                if (y_f32) y_f32[(size_t)r * n + o] = bf16_to_f32(h);
            }
        }
    }
    free(xf);
}

/* out [rows][n/2] = silu(gate) * up over an int4 weight whose rows are [gate; up] (n rows), each
 * product rounded to bf16 as torch's bf16 ops round: silu(bf16 gate) -> bf16, times bf16 up -> bf16. */
EXPORT void nf_gated_silu(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *scales,
                          const uint16_t *zeros, int n, uint16_t *out) {
    matmul m = {x, rows, k, n, q, scales, zeros, NULL, NULL};
    float *xf = malloc(sizeof(float) * (size_t)rows * (k + k / BLOCK));
    prepare_inputs(&m, xf, xf + (size_t)rows * k);
    const int half = n / 2;
#pragma omp parallel if ((size_t)n * k / 2 >= PARALLEL_BYTES)
    {
        int o0, o1;
        my_rows(half, &o0, &o1);
        float g[MAX_ROWS], u[MAX_ROWS];
        for (int o = o0; o < o1; o++) {
            int4_dot(&m, o, g);
            int4_dot(&m, half + o, u);
            for (int r = 0; r < rows; r++) {
                float gate = round_bf16(g[r]);
                float silu = round_bf16(gate / (1.0f + expf(-gate)));
                out[(size_t)r * half + o] = f32_to_bf16(silu * round_bf16(u[r]));
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
EXPORT void nf_linear_add_rms_norm(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *scales,
                                   const uint16_t *zeros, int n, float *residual, const float *norm, float eps,
                                   uint16_t *out) {
    nf_linear(4, x, rows, k, q, scales, zeros, n, out, NULL);
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
 *   [pages * page_size][kv_heads][d] float32; block_table: the sequence's pages.
 * RoPE on q and k, k and v stored at pos, then softmax(q k^T / sqrt(d)) v over positions 0..pos
 * -> out [heads d] bf16. */
CLONES
EXPORT void nf_attention_decode(const uint16_t *qkv, int heads, int kv_heads, int d, const float *cos,
                                const float *sin, float *k_cache, float *v_cache, const int64_t *block_table,
                                int page_size, int pos, uint16_t *out) {
    const int rows_qk = heads + kv_heads, half = d / 2, group = heads / kv_heads;
    float *qk = malloc(sizeof(float) * ((size_t)rows_qk * d + (size_t)(pos + 1) + d));
    float *scores = qk + (size_t)rows_qk * d, *acc = scores + pos + 1;
    for (int h = 0; h < rows_qk; h++) {
        const uint16_t *src = qkv + (size_t)h * d;
        for (int i = 0; i < d; i++) {
            float x = bf16_to_f32(src[i]), rolled = bf16_to_f32(src[(i + half) % d]);
            qk[(size_t)h * d + i] = x * cos[i] + rolled * sin[i];
        }
    }
    const size_t row = (size_t)kv_heads * d;
    const size_t slot = (size_t)block_table[pos / page_size] * page_size + pos % page_size;
    memcpy(k_cache + slot * row, qk + (size_t)heads * d, sizeof(float) * row);
    for (size_t i = 0; i < row; i++) v_cache[slot * row + i] = bf16_to_f32(qkv[(size_t)rows_qk * d + i]);
    const float scale = (float)(1.0 / sqrt((double)d));  /* torch_ops: q * d ** -0.5 */
    for (int h = 0; h < heads; h++) {
        const int g = h / group;
        float *qh = qk + (size_t)h * d;
        for (int i = 0; i < d; i++) qh[i] *= scale;
        float top = -INFINITY;
        for (int t = 0; t <= pos; t++) {
            const float *kt = k_cache + ((size_t)block_table[t / page_size] * page_size + t % page_size) * row + (size_t)g * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < d; i++) dot += qh[i] * kt[i];
            scores[t] = dot;
            top = dot > top ? dot : top;
        }
        float sum = 0.0f;
        for (int t = 0; t <= pos; t++) {
            scores[t] = expf(scores[t] - top);
            sum += scores[t];
        }
        for (int i = 0; i < d; i++) acc[i] = 0.0f;
        for (int t = 0; t <= pos; t++) {
            const float p = scores[t] / sum;
            const float *vt = v_cache + ((size_t)block_table[t / page_size] * page_size + t % page_size) * row + (size_t)g * d;
#pragma omp simd
            for (int i = 0; i < d; i++) acc[i] += p * vt[i];
        }
        for (int i = 0; i < d; i++) out[(size_t)h * d + i] = f32_to_bf16(acc[i]);
    }
    free(qk);
}
