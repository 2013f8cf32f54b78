// Packed codes (kvarn/ops/packing.py) unpacked to one code a byte, for the kernels that read them (decode.cpp,
// store.cpp): planes for 1/2/4 bits (byte j of a row holds codes j, j + m, ... at bits [k b, (k + 1) b)), groups of
// 8 codes in 3 bytes for 3 bits (code j at bits [3j, 3j + 3)), bytes for 8.
#pragma once

#include <cstdint>
#include <cstring>

// 3-bit rows -> one code a byte.
inline void unpack3(const uint8_t* codes, int R, int C, uint8_t* out) {
  const int groups = R * C / 8;
  for (int i = 0; i < groups; ++i) {
    const uint8_t* p = codes + 3 * i;
    const uint32_t word = p[0] | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16);
    for (int j = 0; j < 8; ++j) out[8 * i + j] = static_cast<uint8_t>((word >> (3 * j)) & 7);
  }
}

// R rows of C codes of any width -> out [R][C], one code a byte.
inline void unpack_codes(const uint8_t* codes, int R, int C, int bits, uint8_t* out) {
  if (bits == 3) return unpack3(codes, R, C, out);
  if (bits == 8) {
    std::memcpy(out, codes, static_cast<size_t>(R) * C);
    return;
  }
  const int per = 8 / bits, m = C / per, mask = (1 << bits) - 1;
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = codes + static_cast<int64_t>(r) * m;
    uint8_t* q = out + static_cast<int64_t>(r) * C;
    for (int k = 0; k < per; ++k)
#pragma omp simd
      for (int j = 0; j < m; ++j) q[k * m + j] = static_cast<uint8_t>((p[j] >> (k * bits)) & mask);
  }
}
