// Runs blocks.cu's gemv_blocks_tile on the host, all 32 lanes of every warp: each lane's tile_load,
// tile_scales, tile_a and tile_b as the kernel calls them, the mma.m16n8k16 emulated from the lanes'
// fragments (PTX's fragment layout), the scales applied and the warps' sums added as the kernel does.
// stdin: int32 N, K, M, then the weight rows (N * K / QK * BLK_BYTES bytes), then x as bf16 bits
// [M, K]; stdout: y [M, N] float32. Compile with -DBLK_FMT=<a TILE_FMT format> (and -DTILE_BLOCKS=B for the 32-element formats).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "blocks.cu"

static inline float bf16f(u32 h) { return __uint_as_float(h << 16); }

float smem[1];  // gemv_blocks' dynamic shared memory: declared by blocks.cu, never used here

// c (per lane 4) += A (from the lanes' a0..a3) x B (from b0, b1), fp32 accumulation per product in k order.
static void mma(float c[32][4], const u32 a[32][4], const u32 b[32][2]) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = bf16f((a[lane][0] >> (16 * h)) & 0xffffu);
      A[g + 8][2 * t + h] = bf16f((a[lane][1] >> (16 * h)) & 0xffffu);
      A[g][2 * t + 8 + h] = bf16f((a[lane][2] >> (16 * h)) & 0xffffu);
      A[g + 8][2 * t + 8 + h] = bf16f((a[lane][3] >> (16 * h)) & 0xffffu);
      B[2 * t + h][g] = bf16f((b[lane][0] >> (16 * h)) & 0xffffu);
      B[2 * t + 8 + h][g] = bf16f((b[lane][1] >> (16 * h)) & 0xffffu);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
      const int row = g + (j >= 2 ? 8 : 0), col = 2 * t + (j & 1);
      double sum = 0.0;
      for (int k = 0; k < 16; ++k) sum += (double)A[row][k] * B[k][col];
      c[lane][j] += (float)sum;
    }
  }
}

int main() {
  int N, K, M;
  if (fread(&N, 4, 1, stdin) != 1 || fread(&K, 4, 1, stdin) != 1 || fread(&M, 4, 1, stdin) != 1) return 1;
  const size_t row_bytes = (size_t)(K / QK) * BLK_BYTES;
  std::vector<u8> w(row_bytes * N + 16);
  std::vector<u16> x((size_t)M * K);
  if (fread(w.data(), 1, row_bytes * N, stdin) != row_bytes * N) return 2;
  if (fread(x.data(), 2, x.size(), stdin) != x.size()) return 3;
  std::vector<float> y((size_t)M * N);
  const int nb = K / TILE_QK;
  static u32 a[32][4], b[32][2], ones[32][4];
  u32 kc[TILE_NK];
  tile_consts(0u, kc);
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j) ones[lane][j] = TILE_ONES;
  for (int n0 = 0; n0 < N; n0 += 16) {
    float part[TILE_WARPS][32][4] = {};
    for (int warp = 0; warp < TILE_WARPS; ++warp) {
      for (int blk = warp; blk < nb; blk += TILE_WARPS) {
        static TileRows d[32];
        static float s[32][2][TILE_NG], o[32][2][TILE_NG];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane >> 2, t = lane & 3;
          const u8* w0 = w.data() + (size_t)std::min(n0 + g, N - 1) * row_bytes + (size_t)blk * TILE_BYTES;
          const u8* w1 = w.data() + (size_t)std::min(n0 + g + 8, N - 1) * row_bytes + (size_t)blk * TILE_BYTES;
          tile_load(w0, w1, t, d[lane]);
          tile_scales(d[lane], 0x4B000000u, s[lane], o[lane]);
        }
        for (int grp = 0; grp < TILE_NG; ++grp) {
          float c[32][4] = {}, cx[32][4] = {};
          for (int u = 0; u < TILE_GROUP; ++u) {
            const int i = grp * TILE_GROUP + u;
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane >> 2, t = lane & 3;
              const u16* xl = x.data() + (size_t)(g < M ? g : 0) * K + (size_t)blk * TILE_QK + tile_lane(t) + tile_elem(i);
              uint2 xv;
              xv.x = (u32)xl[0] | ((u32)xl[1] << 16);
              xv.y = (u32)xl[2] | ((u32)xl[3] << 16);
              tile_b(xv, b[lane][0], b[lane][1]);
              tile_a(d[lane], i, kc, a[lane]);
            }
            mma(c, a, b);
            if (TILE_OFFSET) mma(cx, ones, b);
            if (TILE_FOLD) mma(c, ones, b);
          }
          for (int lane = 0; lane < 32; ++lane) {
            float* acc = part[warp][lane];
            acc[0] = fmaf(c[lane][0], s[lane][0][grp], acc[0]);
            acc[1] = fmaf(c[lane][1], s[lane][0][grp], acc[1]);
            acc[2] = fmaf(c[lane][2], s[lane][1][grp], acc[2]);
            acc[3] = fmaf(c[lane][3], s[lane][1][grp], acc[3]);
            if (TILE_OFFSET) {
              acc[0] = fmaf(cx[lane][0], o[lane][0][grp], acc[0]);
              acc[1] = fmaf(cx[lane][1], o[lane][0][grp], acc[1]);
              acc[2] = fmaf(cx[lane][2], o[lane][1][grp], acc[2]);
              acc[3] = fmaf(cx[lane][3], o[lane][1][grp], acc[3]);
            }
          }
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane >> 2, t = lane & 3;
      for (int j = 0; j < 4; ++j) {
        float r = part[0][lane][j];
        for (int v = 1; v < TILE_WARPS; ++v) r += part[v][lane][j];
        const int n = n0 + g + (j >= 2 ? 8 : 0), m = 2 * t + (j & 1);
        if (n < N && m < M) y[(size_t)m * N + n] = r;
      }
    }
  }
  fwrite(y.data(), 4, y.size(), stdout);
  return 0;
}
