// Runs blocks.cu's load_chunk on the host: stdin int32 block count then the raw blocks; stdout the
// float32 weights w = fmaf(s, q, o) of every chunk in order (what dequant_blocks writes in fp32).
#include "blocks.cu"
#include <cstdio>
#include <vector>

float smem[1];  // gemv_blocks' dynamic shared memory: declared by blocks.cu, never used here

int main() {
  int nb = 0;
  if (fread(&nb, 4, 1, stdin) != 1) return 1;
  std::vector<u8> data((size_t)nb * BLK_BYTES);
  if (fread(data.data(), 1, data.size(), stdin) != data.size()) return 2;
  const int chunks = nb * QK / 32;
  std::vector<float> out((size_t)chunks * 32);
  for (int c = 0; c < chunks; ++c) {
    Chunk ch;
    load_chunk(data.data(), c, ch, KVALUES);
    for (int l = 0; l < 32; ++l) out[(size_t)c * 32 + l] = fmaf(ch.s[l >> 4], ch.q[l], ch.o[l >> 4]);
  }
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
