// Fused decode attention over packed KVarN tiles (kvarn.kernels.cpu; the Python side documents the arithmetic).
//
// One work item = (batch row b, KV head h, context split s). It walks its tiles through the block table, computes the
// logits of all M = groups * L query rows of the KV head straight from the 2/4-bit codes, keeps an online softmax
// state (max, sum, two value accumulators: tiles stored rotated and plain), and the last split also walks the dense
// segments (sink, tail, fresh tokens) and the indexed rows (vLLM's fp slots, read in place through row ids). The splits of a (b, h) are then combined exactly:
//     m* = max_s m_s,  l = sum_s exp(m_s - m*) l_s,  acc = sum_s exp(m_s - m*) acc_s,  out = acc / l  (0 if l = 0).
//
// Codes of a row are packed in planes (kvarn/ops/packing.py): byte j of a row of C codes holds codes j + k * C/per,
// k < per = 8/bits, so one load of W bytes and `per` shifts give W consecutive codes of each plane (1/2/4/8 bits;
// 3-bit rows pack groups of 8 codes in 3 bytes and are unpacked to bytes first).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "lanes.h"
#include "packing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef int32_t i __attribute__((vector_size(W * 4)));
  typedef uint8_t u8 __attribute__((vector_size(W)));
};

// VW lanes (lanes.h). Where a sum's order depends on the lane count (a row's dot product, the softmax's total) it
// stays that of 16 lanes, kept in HALVES vectors of VW, so both widths add in one order and give the same bits.
constexpr int VW = KVARN_VW;
constexpr int HALVES = 16 / VW;
using VF = Vec<VW>::f;

// W bytes widened to W int32 lanes (one instruction with AVX-512 / AVX2; the generic form is scalarized by gcc)
template <int W>
inline typename Vec<W>::i load_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  if constexpr (W == 16) return (typename Vec<W>::i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) return (typename Vec<W>::i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
  typename Vec<W>::u8 bytes;
  std::memcpy(&bytes, p, W);
  return __builtin_convertvector(bytes, typename Vec<W>::i);
}

// Plane k of W widened code bytes x as floats: (x >> k * BITS) & MASK. With AVX-512 and W = 16 one permute does the
// mask and the conversion (vpermps reads the low 4 bits of each lane, the table maps them to their low BITS bits as
// floats); the same values, so the same sums as the generic shift, mask and convert.
template <int W, int BITS>
inline typename Vec<W>::f code_plane(typename Vec<W>::i x, int k) {
  constexpr int MASK = (1 << BITS) - 1;
#if defined(__AVX512F__)
  if constexpr (W == 16 && BITS <= 4) {
    const __m512 table = _mm512_setr_ps(0 & MASK, 1 & MASK, 2 & MASK, 3 & MASK, 4 & MASK, 5 & MASK, 6 & MASK,
                                        7 & MASK, 8 & MASK, 9 & MASK, 10 & MASK, 11 & MASK, 12 & MASK, 13 & MASK,
                                        14 & MASK, 15 & MASK);
    return (typename Vec<W>::f)_mm512_permutexvar_ps((__m512i)(x >> (k * BITS)), table);
  }
#endif
  return __builtin_convertvector((x >> (k * BITS)) & MASK, typename Vec<W>::f);
}

// out[m][c] = sum_r w[m][r] * code[r][c] for MB rows m; codes [R][C*BITS/8] in planes, W bytes per step.
template <int W, int BITS, int MB>
void codes_mm_vec(const uint8_t* codes, int R, int C, const float* w, int ws, float* out, int os) {
  constexpr int PER = 8 / BITS;
  using vf = typename Vec<W>::f;
  using vi = typename Vec<W>::i;
  const int mb = C / PER;  // bytes per row = codes per plane
  for (int j0 = 0; j0 < mb; j0 += W) {
    vf acc[MB][PER];
    for (int m = 0; m < MB; ++m)
      for (int k = 0; k < PER; ++k) acc[m][k] = vf{};
    const uint8_t* p = codes + j0;
    for (int r = 0; r < R; ++r, p += mb) {
      const vi x = load_u8<W>(p);
      vf plane[PER];
      for (int k = 0; k < PER; ++k) plane[k] = code_plane<W, BITS>(x, k);
      for (int m = 0; m < MB; ++m) {
        const float wm = w[m * ws + r];
        for (int k = 0; k < PER; ++k) acc[m][k] += wm * plane[k];
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int k = 0; k < PER; ++k) std::memcpy(out + m * os + k * mb + j0, &acc[m][k], W * 4);
  }
}

// The same product, one code at a time (rows whose byte count is not a multiple of 8).
template <int BITS>
void codes_mm_scalar(const uint8_t* codes, int R, int C, const float* w, int ws, int M, float* out, int os) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int mb = C / PER;
  for (int m = 0; m < M; ++m) std::fill(out + m * os, out + m * os + C, 0.f);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < PER; ++k)
      for (int j = 0; j < mb; ++j) {
        const float c = static_cast<float>((codes[r * mb + j] >> (k * BITS)) & MASK);
        for (int m = 0; m < M; ++m) out[m * os + k * mb + j] += w[m * ws + r] * c;
      }
}

// Rows m in groups of up to 4 (AVX-512's 32 registers), or of as many as keep MB * PER accumulators within 8 of AVX2's
// 16 (each output element sums over r in one order whatever the grouping).
template <int W, int BITS>
void codes_mm_rows(const uint8_t* codes, int R, int C, const float* w, int ws, int M, float* out, int os) {
  constexpr int MBMAX = VW == 16 ? 4 : std::clamp(BITS, 1, 4);  // BITS = 8 / PER
  for (int m0 = 0; m0 < M; m0 += MBMAX) {
    const float* wm = w + m0 * ws;
    float* om = out + m0 * os;
    switch (std::min(MBMAX, M - m0)) {
      case 1: codes_mm_vec<W, BITS, 1>(codes, R, C, wm, ws, om, os); break;
      case 2: codes_mm_vec<W, BITS, 2>(codes, R, C, wm, ws, om, os); break;
      case 3: codes_mm_vec<W, BITS, 3>(codes, R, C, wm, ws, om, os); break;
      default: codes_mm_vec<W, BITS, 4>(codes, R, C, wm, ws, om, os); break;
    }
  }
}

template <int BITS>
void codes_mm_bits(const uint8_t* codes, int R, int C, const float* w, int ws, int M, float* out, int os) {
  const int mb = C * BITS / 8;
  if constexpr (VW == 16)
    if (mb % 16 == 0) return codes_mm_rows<16, BITS>(codes, R, C, w, ws, M, out, os);
  if (mb % 8 == 0) codes_mm_rows<8, BITS>(codes, R, C, w, ws, M, out, os);
  else codes_mm_scalar<BITS>(codes, R, C, w, ws, M, out, os);
}

// out [M][C] = w [M][R] @ codes [R][C]
void codes_mm(int bits, const uint8_t* codes, int R, int C, const float* w, int ws, int M, float* out, int os) {
  switch (bits) {
    case 3: {  // not a plane layout: unpacked to bytes once per tile, then the 8-bit product (same sums, same order)
      thread_local std::vector<uint8_t> buf;
      buf.resize(static_cast<size_t>(R) * C);
      unpack3(codes, R, C, buf.data());
      codes_mm_bits<8>(buf.data(), R, C, w, ws, M, out, os);
      break;
    }
    case 1: codes_mm_bits<1>(codes, R, C, w, ws, M, out, os); break;
    case 2: codes_mm_bits<2>(codes, R, C, w, ws, M, out, os); break;
    case 4: codes_mm_bits<4>(codes, R, C, w, ws, M, out, os); break;
    default: codes_mm_bits<8>(codes, R, C, w, ws, M, out, os); break;
  }
}

// s[i] <- exp(s[i] - mx), returns the sum. exp by range reduction: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor
// polynomial of degree 7 (relative error < 1e-8, below float32 rounding), 2^n through the exponent bits; x < -87
// (and -inf) gives exactly 0, NaN stays NaN.
float exp_shifted(float* s, int n, float mx) {
  using vf = Vec<VW>::f;
  using vi = Vec<VW>::i;
  vf total[HALVES] = {};  // lane l of 16 in total[l / VW]
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int part = 0; part < HALVES; ++part) {
      vf x;
      std::memcpy(&x, s + i + part * VW, sizeof(vf));
      x -= mx;
      const vi dead = x < -87.0f;
      vf t = x * 1.44269504088896341f + 12582912.0f;  // round(x / ln2) by the 1.5 * 2^23 trick
      const vf nf = t - 12582912.0f;
      vf r = x - nf * 0.693145751953125f - nf * 1.42860682030941723212e-6f;  // ln2 split in two
      vf p = vf{} + 1.f / 5040.f;
      p = p * r + 1.f / 720.f;
      p = p * r + 1.f / 120.f;
      p = p * r + 1.f / 24.f;
      p = p * r + 1.f / 6.f;
      p = p * r + 0.5f;
      p = p * r + 1.f;
      p = p * r + 1.f;
      const vi ni = __builtin_convertvector(nf, vi);
      const vf y0 = p * (vf)((ni + 127) << 23);  // GCC vector casts reinterpret the bits
      const vf y = (vf)((vi)y0 & ~dead);
      std::memcpy(s + i + part * VW, &y, sizeof(vf));
      total[part] += y;
    }
  float sum = 0.f;
  for (int part = 0; part < HALVES; ++part)
    for (int k = 0; k < VW; ++k) sum += total[part][k];
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      c10::Float8_e4m3fn x;
      x.x = static_cast<uint8_t>(i);
      t[i] = static_cast<float>(x);
    }
    return t;
  }();
  return table.data();
}

// n 16-bit floats widened to float32: bf16 is the top half of a float; fp16 through F16C where the CPU has it.
inline void bf16_to_f32(const uint16_t* q, int n, float* out) {
  auto o = reinterpret_cast<uint32_t*>(out);
  for (int i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(q[i]) << 16;
}

inline void fp16_to_f32(const uint16_t* q, int n, float* out) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
#endif
  for (; i < n; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(q[i]);
}

// Scale fields come as fp32, fp16, bf16 or fp8 e4m3fn; read into float32.
struct Field {
  const char* base = nullptr;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  int64_t item = 1, sb = 0, sh = 0, sn = 0;  // element size; strides (elements) of batch, head, block
  bool present() const { return base != nullptr; }
  const char* at(int64_t b, int64_t h, int64_t blk) const { return base + (b * sb + h * sh + blk * sn) * item; }
  void floats(int64_t b, int64_t h, int64_t blk, int n, float* out) const {
    const char* p = at(b, h, blk);
    switch (dtype) {
      case c10::ScalarType::Float: std::memcpy(out, p, n * 4); break;
      case c10::ScalarType::Half: fp16_to_f32(reinterpret_cast<const uint16_t*>(p), n, out); break;
      case c10::ScalarType::BFloat16: bf16_to_f32(reinterpret_cast<const uint16_t*>(p), n, out); break;
      default: {
        const float* lut = e4m3_table();
        auto q = reinterpret_cast<const uint8_t*>(p);
        for (int i = 0; i < n; ++i) out[i] = lut[q[i]];
      }
    }
  }
};

Field make_field(const at::Tensor& t, const std::vector<int64_t>& strides, int which) {
  Field f;
  if (!t.defined() || t.numel() == 0) return f;
  f.base = static_cast<const char*>(t.data_ptr());
  f.dtype = t.scalar_type();
  f.item = t.element_size();
  f.sb = strides[3 * which];
  f.sh = strides[3 * which + 1];
  f.sn = strides[3 * which + 2];
  return f;
}

struct Kind {  // packed fields of keys or values: codes, row scale, row zero, col scale, rotated flag[, row widths]
  Field codes, a, z, col, rot, wid;
  int bits, rotate;  // rotate: 0 none, 1 hadamard, 2 per-tile flag
  bool rotated(int64_t b, int64_t h, int64_t blk) const {
    return rotate == 1 || (rotate == 2 && *reinterpret_cast<const uint8_t*>(rot.at(b, h, blk)) != 0);
  }
};

Kind make_kind(const std::vector<at::Tensor>& f, const std::vector<int64_t>& s, int64_t bits, int64_t rotate) {
  TORCH_CHECK((f.size() == 5 || f.size() == 6) && s.size() == 3 * f.size(),
              "kvarn decode: 5 packed fields (6 with row widths) and 3 strides each per kind");
  Kind k;
  k.codes = make_field(f[0], s, 0);
  k.a = make_field(f[1], s, 1);
  k.z = make_field(f[2], s, 2);
  k.col = make_field(f[3], s, 3);
  k.rot = make_field(f[4], s, 4);
  if (f.size() == 6) k.wid = make_field(f[5], s, 5);
  k.bits = static_cast<int>(bits);
  k.rotate = static_cast<int>(rotate);
  TORCH_CHECK(k.rotate != 2 || k.rot.present(), "kvarn decode: rotate='auto' needs the rotated flags");
  return k;
}

// max over s[0..n), NaN skipped (VW lanes at a time: a scalar max chain is a loop-carried dependency)
inline float row_max(const float* s, int n) {
  VF mv = VF{} + NEG_INF;
  int i = 0;
  for (; i + VW <= n; i += VW) {
    VF x;
    std::memcpy(&x, s + i, sizeof x);
    mv = x > mv ? x : mv;
  }
  float mt = NEG_INF;
  for (int k = 0; k < VW; ++k) mt = mv[k] > mt ? mv[k] : mt;
  for (; i < n; ++i) mt = s[i] > mt ? s[i] : mt;
  return mt;
}

struct State {  // online softmax of the M rows of one work item
  int M, D;
  std::vector<float> mx, l, acc_p, acc_r;
  State(int M_, int D_) : M(M_), D(D_), mx(M_, NEG_INF), l(M_, 0.f), acc_p(M_ * D_, 0.f), acc_r(M_ * D_, 0.f) {}

  // s [M][n] logits (masked = -inf) -> probabilities relative to the new running max; rescales the past.
  void update(float* s, int ss, int n) {
    for (int m = 0; m < M; ++m) {
      float* row = s + m * ss;
      float mt = row_max(row, n);  // a NaN logit reaches l (and the output) anyway
      const float mn = std::max(mx[m], mt);
      if (mn == NEG_INF) {  // nothing allowed so far; a NaN logit (also one the vector max skipped) makes l NaN
        bool nan = false;
        for (int i = 0; i < n; ++i) nan |= std::isnan(row[i]);
        if (nan) l[m] = std::numeric_limits<float>::quiet_NaN();
        std::fill(row, row + n, 0.f);
        continue;
      }
      const float alpha = std::exp(mx[m] - mn);
      if (alpha != 1.f) {
        l[m] *= alpha;
        for (int d = 0; d < D; ++d) {
          acc_p[m * D + d] *= alpha;
          acc_r[m * D + d] *= alpha;
        }
      }
      l[m] += exp_shifted(row, n, mn);
      mx[m] = mn;
    }
  }
};

struct Job {
  int64_t B, H, M, D, G, L, groups, T;
  const float *q, *qh, *hmat;
  float scale;
  Kind keys, values;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* nb;
  const int32_t* emap;
  int64_t emap_blocks;
  const float *ek, *ev;
  std::vector<at::Tensor> dk, dv;
  std::vector<int64_t> dpos;
  // rows read in place through an index (vLLM's fp slots): prows [N, H, R, D]; pidx [B, 2, pt] row ids n * R + r of
  // keys (0) and values (1), at positions ppos..
  at::Tensor prows;
  const int64_t* pidx = nullptr;
  int64_t pt = 0, ppos = 0, pR = 0, psN = 0, psH = 0, psR = 0;
  int64_t tiles_pos;
  const float* bias;
  int64_t bs0, bs1, bs2, bheads;
  float softcap;
};

// The bias row of query row m of work item (b, h): positions 0.. of the row's mask
inline const float* bias_row(const Job& J, int64_t b, int64_t h, int m) {
  const int64_t head = J.bheads == 1 ? 0 : h * J.groups + m / J.L;
  return J.bias + b * J.bs0 + head * J.bs1 + (m % J.L) * J.bs2;
}

// softcap and mask on logits s [M][n]; logit i sits at position pos + (idx ? idx[i] : i) of the bias row
void finish_logits(const Job& J, int64_t b, int64_t h, float* s, int ss, int n, int64_t pos,
                   const int* idx = nullptr) {
  for (int m = 0; m < J.M; ++m) {
    float* row = s + m * ss;
    if (J.softcap > 0.f)
      for (int i = 0; i < n; ++i) row[i] = std::tanh(row[i] / J.softcap) * J.softcap;
    if (J.bias != nullptr) {
      const float* br = bias_row(J, b, h, m) + pos;
      if (idx == nullptr) {
        for (int i = 0; i < n; ++i) row[i] = br[i] == NEG_INF ? NEG_INF : row[i] + br[i];
      } else {
        for (int i = 0; i < n; ++i) {
          const float x = br[idx[i]];
          row[i] = x == NEG_INF ? NEG_INF : row[i] + x;
        }
      }
    }
  }
}

// D elements of a dense row (float32, fp16 or bf16) as float32.
template <typename T>
inline void row_to_f32(const T* src, int D, float* dst) {
  if constexpr (std::is_same_v<T, float>)
    std::memcpy(dst, src, D * 4);
  else if constexpr (std::is_same_v<T, at::BFloat16>)
    bf16_to_f32(reinterpret_cast<const uint16_t*>(src), D, dst);
  else
    fp16_to_f32(reinterpret_cast<const uint16_t*>(src), D, dst);
}

using IV = Vec<VW>::i;

// out[r] = sum of the VW lanes of x[r], r < VW: a transpose-and-add butterfly (VW - 1 pairs of shuffles and adds)
// instead of VW horizontal sums. Lane l of the result holds input slot bitrev(l), so callers put row r in slot
// BITREV[r]. Each row's lanes are added pairwise at distance VW/2, then VW/4, ... (with 8 lanes, after the caller's
// step at distance 8: the order of 16 lanes).
#if KVARN_VW == 16
constexpr int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
constexpr int LEVELS = 4;
static const IV SHUF_LO[LEVELS] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                   {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                   {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                   {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const IV SHUF_HI[LEVELS] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                                   {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                                   {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                                   {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#else
constexpr int BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
constexpr int LEVELS = 3;
static const IV SHUF_LO[LEVELS] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13},
                                   {0, 8, 2, 10, 4, 12, 6, 14}};
static const IV SHUF_HI[LEVELS] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15},
                                   {1, 9, 3, 11, 5, 13, 7, 15}};
#endif

inline VF lane_sums(VF* x) {
#if defined(__clang__)  // no two-vector shuffle with a mask operand: plain sums, same lane order
  VF out = VF{};
  for (int l = 0; l < VW; ++l)
    for (int j = 0; j < VW; ++j) out[l] += x[BITREV[l]][j];
  return out;
#else
  int n = VW;
  for (int lvl = 0; lvl < LEVELS; ++lvl, n /= 2)
    for (int k = 0; k < n / 2; ++k)
      x[k] = __builtin_shuffle(x[2 * k], x[2 * k + 1], SHUF_LO[lvl]) +
             __builtin_shuffle(x[2 * k], x[2 * k + 1], SHUF_HI[lvl]);
  return x[0];
#endif
}

// s[m][i] = q[m] . k[i] for MB query rows m and n rows k [n][D] (float32, contiguous), VW rows at a time: each row's
// 16-lane partial sums over D (HALVES vectors, added at distance 8 first), then one butterfly per query row for the VW
// rows. A key row is loaded once for the MB query rows (MB independent sums in flight). Rows past n count as zero;
// s rows have room for n rounded up to 16.
template <int MB>
void logits_rows(const float* q, int D, const float* k, int n, float* s, int ss) {
  const int dv = D / 16 * 16;
  VF part[MB][VW];
  for (int i0 = 0; i0 < n; i0 += VW) {
    const int rows = std::min(VW, n - i0);
    for (int r = 0; r < VW; ++r) {
      VF acc[MB][HALVES] = {};
      if (r < rows) {
        const float* kr = k + (i0 + r) * D;
        for (int d = 0; d < dv; d += 16)
#pragma GCC unroll 2
          for (int h = 0; h < HALVES; ++h) {
            VF c;
            std::memcpy(&c, kr + d + h * VW, sizeof c);
#pragma GCC unroll 4
            for (int j = 0; j < MB; ++j) {
              VF a;
              std::memcpy(&a, q + j * D + d + h * VW, sizeof a);
              acc[j][h] += a * c;
            }
          }
        for (int d = dv; d < D; ++d)
          for (int j = 0; j < MB; ++j) acc[j][0][0] += q[j * D + d] * kr[d];
      }
#pragma GCC unroll 4
      for (int j = 0; j < MB; ++j) part[j][BITREV[r]] = HALVES == 1 ? acc[j][0] : acc[j][0] + acc[j][HALVES - 1];
    }
    for (int j = 0; j < MB; ++j) {
      const VF out = lane_sums(part[j]);
      std::memcpy(s + j * ss + i0, &out, sizeof out);
    }
  }
}

// f(std::integral_constant<int, MB>{}, m0) for the groups of up to 4 rows m0 .. m0 + MB of M (AVX-512's 32 registers
// hold 4 rows' sums; each row's sums keep their order whatever the grouping)
template <typename F>
inline void row_groups(int M, F f) {
  for (int m0 = 0; m0 < M; m0 += 4) switch (std::min(4, M - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      default: f(std::integral_constant<int, 4>{}, m0); break;
    }
}

void dense_logits(const float* q, int M, int D, const float* k, int n, float* s, int ss) {
  row_groups(M, [&](auto mb, int m0) { logits_rows<decltype(mb)::value>(q + m0 * D, D, k, n, s + m0 * ss, ss); });
}

// acc[m][d0 .. d0 + VW DV) += sum_i p[m][i] v[i][d0 ..] for MB rows m, accumulators held in registers over the rows;
// a zero probability adds nothing (a non-finite value behind an underflowed weight stays out, as a masked one does).
template <int MB, int DV>
void accumulate(const float* p, int ss, const float* v, int n, int D, int d0, float* acc) {
  VF a[MB][DV];  // fully unrolled so that gcc keeps a and x in registers (a rolled loop spilled them to the stack)
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) std::memcpy(&a[m][k], acc + m * D + d0 + VW * k, sizeof(VF));
  for (int i = 0; i < n; ++i) {
    VF x[DV];
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) std::memcpy(&x[k], v + i * D + d0 + VW * k, sizeof(VF));
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const float pm = p[m * ss + i];
      if (pm == 0.f) continue;
#pragma GCC unroll 4
      for (int k = 0; k < DV; ++k) a[m][k] += pm * x[k];
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) std::memcpy(acc + m * D + d0 + VW * k, &a[m][k], sizeof(VF));
}

// Columns in spans of DV vectors, MB * DV + DV registers within the CPU's 32 (AVX-512) or 16.
template <int MB>
void accumulate_rows(const float* p, int ss, const float* v, int n, int D, float* acc) {
  constexpr int DV = VW == 16 ? 4 : 2;
  int d0 = 0;
  for (; d0 + DV * VW <= D; d0 += DV * VW) accumulate<MB, DV>(p, ss, v, n, D, d0, acc);
  for (; d0 + VW <= D; d0 += VW) accumulate<MB, 1>(p, ss, v, n, D, d0, acc);
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < n; ++i) {
      const float pm = p[m * ss + i];
      if (pm != 0.f)
        for (int d = d0; d < D; ++d) acc[m * D + d] += pm * v[i * D + d];
    }
}

// acc [M][D] += p [M][n] @ v [n][D]
void dense_values(const float* p, int ss, int M, const float* v, int n, int D, float* acc) {
  row_groups(M, [&](auto mb, int m0) { accumulate_rows<decltype(mb)::value>(p + m0 * ss, ss, v, n, D, acc + m0 * D); });
}

// Dense rows are widened GR at a time: a float32 buffer of a whole logit chunk (128 rows, 32 KB at D = 64) left too
// little of L1 for the rest (scripts/vllm_layer_step.py --parts: a dense row ~54 -> ~50 ns). Same sums, same order.
constexpr int GR = 32;
constexpr int PF = 8;  // rows: ~1 KB of bf16 rows of D = 64 ahead

template <typename T>
inline void prefetch_row(const T* row, int D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int o = 0; o < D * static_cast<int>(sizeof(T)); o += 64) __builtin_prefetch(p + o);
}

struct DenseBuf {  // GR dense rows widened to float32, the chunk's unmasked row indices, the M bias rows
  std::vector<float> buf;
  std::vector<int> idx;
  std::vector<const float*> brows;
  DenseBuf(int ss, int D, int M) : buf(static_cast<size_t>(GR) * D), idx(ss), brows(M) {}
};

// Dense rows (key_at(i), value_at(i): row i's elements of type T) at positions pos.., plain basis, in chunks of the
// logit buffer. Rows the bias masks for every query row (the padding of a batched decode) are skipped, not read; the
// others are widened to float32 into db.buf [GR][D], GR rows at a time (keys, then values of the chunk).
template <typename T, typename KAt, typename VAt>
void dense_rows(const Job& J, int64_t b, int64_t h, State& st, const float* q, KAt key_at, VAt value_at, int64_t n,
                int64_t pos, float* s, int ss, DenseBuf& db) {
  const int M = J.M, D = J.D;
  float* buf = db.buf.data();
  int* idx = db.idx.data();
  const float** brows = db.brows.data();
  if (J.bias != nullptr)
    for (int m = 0; m < M; ++m) brows[m] = bias_row(J, b, h, m) + pos;
  for (int64_t c0 = 0; c0 < n; c0 += ss) {
    const int span = static_cast<int>(std::min<int64_t>(ss, n - c0));
    int cn = 0;
    if (J.bias == nullptr) {
      for (int i = 0; i < span; ++i) idx[cn++] = i;
    } else {
      for (int i = 0; i < span; ++i) {
        bool open = false;
        for (int m = 0; m < M && !open; ++m) open = brows[m][c0 + i] != NEG_INF;
        if (open) idx[cn++] = i;
      }
    }
    if (cn == 0) continue;
    // ask for the keys PF rows ahead and for this chunk's values, read after its logits: rows come through ids, and
    // in vLLM's fp slots each head's run ends after G rows (still ~0.015 ms a layer faster in the engine, 2026-12-07)
    for (int g0 = 0; g0 < cn; g0 += GR) {
      const int gn = std::min(GR, cn - g0);
      for (int i = g0; i < g0 + gn; ++i) {
        if (i + PF < cn) prefetch_row(key_at(c0 + idx[i + PF]), D);
        prefetch_row(value_at(c0 + idx[i]), D);
        row_to_f32<T>(key_at(c0 + idx[i]), D, buf + (i - g0) * D);
      }
      dense_logits(q, M, D, buf, gn, s + g0, ss);
    }
    finish_logits(J, b, h, s, ss, cn, pos + c0, idx);
    st.update(s, ss, cn);
    for (int g0 = 0; g0 < cn; g0 += GR) {
      const int gn = std::min(GR, cn - g0);
      for (int i = g0; i < g0 + gn; ++i) row_to_f32<T>(value_at(c0 + idx[i]), D, buf + (i - g0) * D);
      dense_values(s + g0, ss, M, buf, gn, D, st.acc_p.data());
    }
  }
}

// Rows at K + i * ks, V + i * vs.
template <typename T>
void strided_rows(const Job& J, int64_t b, int64_t h, State& st, const float* q, const T* K, int64_t ks, const T* V,
                  int64_t vs, int64_t n, int64_t pos, float* s, int ss, DenseBuf& db) {
  dense_rows<T>(J, b, h, st, q, [=](int64_t i) { return K + i * ks; }, [=](int64_t i) { return V + i * vs; }, n, pos,
                s, ss, db);
}

// One dense segment (k, v [B, H, t, D] of float32, fp16 or bf16, unit stride on D) of row b, head h.
void dense_segment(const Job& J, int64_t b, int64_t h, State& st, const float* q, const at::Tensor& k,
                   const at::Tensor& v, int64_t pos, float* s, int ss, DenseBuf& db) {
  const int64_t ko = b * k.stride(0) + h * k.stride(1), vo = b * v.stride(0) + h * v.stride(1);
  switch (k.scalar_type()) {
    case at::kHalf:
      strided_rows(J, b, h, st, q, k.data_ptr<at::Half>() + ko, k.stride(2), v.data_ptr<at::Half>() + vo,
                   v.stride(2), k.size(2), pos, s, ss, db);
      break;
    case at::kBFloat16:
      strided_rows(J, b, h, st, q, k.data_ptr<at::BFloat16>() + ko, k.stride(2), v.data_ptr<at::BFloat16>() + vo,
                   v.stride(2), k.size(2), pos, s, ss, db);
      break;
    default:
      strided_rows(J, b, h, st, q, k.data_ptr<float>() + ko, k.stride(2), v.data_ptr<float>() + vo, v.stride(2),
                   k.size(2), pos, s, ss, db);
  }
}

// The indexed rows of batch row b (Job::prows), read in place: row i of keys at prows[id / R, h, id % R].
template <typename T>
void indexed_rows_t(const Job& J, int64_t b, int64_t h, State& st, const float* q, float* s, int ss, DenseBuf& db) {
  const T* base = J.prows.data_ptr<T>() + h * J.psH;
  const int64_t *ki = J.pidx + b * 2 * J.pt, *vi = ki + J.pt;
  const int64_t R = J.pR, sN = J.psN, sR = J.psR;
  if ((R & (R - 1)) == 0) {  // rows per slot a power of two (vLLM's block sizes): no int64 division per row
    const int shift = __builtin_ctzll(static_cast<uint64_t>(R));
    const auto at = [=](int64_t id) { return base + (id >> shift) * sN + (id & (R - 1)) * sR; };
    dense_rows<T>(J, b, h, st, q, [=](int64_t i) { return at(ki[i]); }, [=](int64_t i) { return at(vi[i]); }, J.pt,
                  J.ppos, s, ss, db);
  } else {
    dense_rows<T>(J, b, h, st, q, [=](int64_t i) { return base + ki[i] / R * sN + ki[i] % R * sR; },
                  [=](int64_t i) { return base + vi[i] / R * sN + vi[i] % R * sR; }, J.pt, J.ppos, s, ss, db);
  }
}

void indexed_rows(const Job& J, int64_t b, int64_t h, State& st, const float* q, float* s, int ss, DenseBuf& db) {
  switch (J.prows.scalar_type()) {
    case at::kHalf:
      indexed_rows_t<at::Half>(J, b, h, st, q, s, ss, db);
      break;
    case at::kBFloat16:
      indexed_rows_t<at::BFloat16>(J, b, h, st, q, s, ss, db);
      break;
    default:
      indexed_rows_t<float>(J, b, h, st, q, s, ss, db);
  }
}

// out [M][D] = x [M][D] @ H [D][D]
void matmul_h(const float* x, const float* hm, int64_t M, int64_t D, float* out) {
  std::fill(out, out + M * D, 0.f);
  dense_values(x, static_cast<int>(D), static_cast<int>(M), hm, static_cast<int>(D), static_cast<int>(D), out);
}

// One packed tile: keys per channel (codes [D][G]), values per token (codes [G][D]).
struct Scratch {
  std::vector<float> s, w, t, a, z, col, pz, ws, s2;  // ws, s2: rows of one width (key tiles with row widths)
  std::vector<uint8_t> width;
  std::vector<int> rows;
  Scratch(int M, int D, int G, int ss) : s(M * ss), w(M * std::max(D, G)), t(M * D), a(std::max(D, G)),
                                         z(std::max(D, G)), col(std::max(D, G)), pz(M) {}
};

// s [M][G] = w [M][D] @ codes of a key tile whose rows have their own widths (kvarn/ops/widths.py): three products of
// one width each, over the 4-bit block (the 4-bit rows), the 2-bit block (the 3-bit rows' low bits, then the 2-bit
// rows) and the 1-bit block (the 3-bit rows' high bit, weighing 4, then the 1-bit rows); width-0 rows add nothing.
void codes_mm_widths(const uint8_t* codes, const uint8_t* widths, int D, int G, const float* w, int M, float* s,
                     int ss, Scratch& sc) {
  sc.width.resize(D);
  sc.rows.resize(D);
  sc.ws.resize(static_cast<size_t>(M) * D);
  sc.s2.resize(static_cast<size_t>(M) * ss);
  unpack3(widths, 1, D, sc.width.data());
  bool first = true;
  for (const int bits : {4, 2, 1}) {
    int n = 0;  // rows of the block: the 3-bit rows' parts first (2- and 1-bit blocks), then the rows of its width
    if (bits < 4)
      for (int r = 0; r < D; ++r)
        if (sc.width[r] == 3) sc.rows[n++] = r;
    const int split = n;
    for (int r = 0; r < D; ++r)
      if (sc.width[r] == bits) sc.rows[n++] = r;
    if (n == 0) continue;
    const float high = bits == 1 ? 4.f : 1.f;  // a 3-bit row's high bit
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < n; ++i) sc.ws[m * n + i] = i < split ? high * w[m * D + sc.rows[i]] : w[m * D + sc.rows[i]];
    float* out = first ? s : sc.s2.data();
    codes_mm(bits, codes, n, G, sc.ws.data(), n, M, out, ss);
    if (!first)
      for (int m = 0; m < M; ++m)
        for (int g = 0; g < G; ++g) s[m * ss + g] += out[m * ss + g];
    first = false;
    codes += static_cast<size_t>(n) * G * bits / 8;
  }
  if (first)
    for (int m = 0; m < M; ++m) std::fill(s + m * ss, s + m * ss + G, 0.f);
}

// The per-row scale a and zero z of a tile folded into the left operand of its code matmul, for M rows x of length
// n (leading dimension ldx): w[m, i] = x[m, i] a[i] and zsum[m] = sum_i x[m, i] z[i] (the zero's whole contribution).
static inline void fold_rows(const float* x, int ldx, const float* a, const float* z, int M, int n, float* w,
                             float* zsum) {
  for (int m = 0; m < M; ++m) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; ++i) {
      w[m * n + i] = x[m * ldx + i] * a[i];
      acc += x[m * ldx + i] * z[i];
    }
    zsum[m] = acc;
  }
}

void packed_tile(const Job& J, int64_t b, int64_t h, int64_t blk, State& st, Scratch& sc, int64_t pos,
                 const float* qp, const float* qr) {
  const int M = J.M, D = J.D, G = J.G;
  const int ss = static_cast<int>(sc.s.size() / M);
  float* s = sc.s.data();
  // keys: logit_g = t_g (sum_d (q~_d a_d) code[d, g] + sum_d q~_d z_d)
  const Kind& K = J.keys;
  const float* q = K.rotated(b, h, blk) ? qr : qp;
  K.a.floats(b, h, blk, D, sc.a.data());
  K.z.floats(b, h, blk, D, sc.z.data());
  std::vector<float>& c0 = sc.t;  // M values, reused
  fold_rows(q, D, sc.a.data(), sc.z.data(), M, D, sc.w.data(), c0.data());
  if (K.wid.present())
    codes_mm_widths(reinterpret_cast<const uint8_t*>(K.codes.at(b, h, blk)),
                    reinterpret_cast<const uint8_t*>(K.wid.at(b, h, blk)), D, G, sc.w.data(), M, s, ss, sc);
  else
    codes_mm(K.bits, reinterpret_cast<const uint8_t*>(K.codes.at(b, h, blk)), D, G, sc.w.data(), D, M, s, ss);
  if (K.col.present()) K.col.floats(b, h, blk, G, sc.col.data());
  for (int m = 0; m < M; ++m) {
    float* row = s + m * ss;
    const float zc = c0[m];
    if (K.col.present())
      for (int g = 0; g < G; ++g) row[g] = (row[g] + zc) * sc.col[g];
    else
      for (int g = 0; g < G; ++g) row[g] += zc;
  }
  finish_logits(J, b, h, s, ss, G, pos);
  st.update(s, ss, G);
  // values: o~_d += c_d (sum_g (p_g a_g) code[g, d] + sum_g p_g z_g)
  const Kind& V = J.values;
  V.a.floats(b, h, blk, G, sc.a.data());
  V.z.floats(b, h, blk, G, sc.z.data());
  float* pz = sc.pz.data();
  fold_rows(s, ss, sc.a.data(), sc.z.data(), M, G, sc.w.data(), pz);
  codes_mm(V.bits, reinterpret_cast<const uint8_t*>(V.codes.at(b, h, blk)), G, D, sc.w.data(), G, M, sc.t.data(), D);
  const bool vc = V.col.present();
  if (vc) V.col.floats(b, h, blk, D, sc.col.data());
  float* acc = V.rotated(b, h, blk) ? st.acc_r.data() : st.acc_p.data();
  for (int m = 0; m < M; ++m) {
    const float* t = sc.t.data() + m * D;
    float* o = acc + m * D;
    if (vc)
      for (int d = 0; d < D; ++d) o[d] += (t[d] + pz[m]) * sc.col[d];
    else
      for (int d = 0; d < D; ++d) o[d] += t[d] + pz[m];
  }
}

}  // namespace

std::vector<at::Tensor> decode_attention(
    const at::Tensor& q, const at::Tensor& qh, const at::Tensor& hmat, double scale, const std::vector<at::Tensor>& kf, const std::vector<int64_t>& ks,
    int64_t k_bits, int64_t k_rotate, const std::vector<at::Tensor>& vf, const std::vector<int64_t>& vs,
    int64_t v_bits, int64_t v_rotate, const at::Tensor& block_table, const at::Tensor& n_blocks, int64_t tile,
    const at::Tensor& exact_map, const at::Tensor& exact_k, const at::Tensor& exact_v,
    const std::vector<at::Tensor>& dense_k, const std::vector<at::Tensor>& dense_v,
    const std::vector<int64_t>& dense_pos, int64_t tiles_pos, const at::Tensor& bias, int64_t L, double softcap,
    int64_t splits, const at::Tensor& paged_rows, const at::Tensor& paged_index, int64_t paged_pos) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "kvarn decode: q float32 [B,H,M,D]");
  Job J;
  J.B = q.size(0);
  J.H = q.size(1);
  J.M = q.size(2);
  J.D = q.size(3);
  J.G = tile;
  J.L = L;
  TORCH_CHECK(L > 0 && J.M % L == 0, "kvarn decode: M query rows per KV head must be groups * L");
  J.groups = J.M / L;
  J.q = q.data_ptr<float>();
  J.qh = qh.numel() ? qh.data_ptr<float>() : nullptr;
  J.hmat = hmat.numel() ? hmat.data_ptr<float>() : nullptr;
  J.scale = static_cast<float>(scale);
  TORCH_CHECK(!J.hmat || (hmat.scalar_type() == at::kFloat && hmat.is_contiguous() && hmat.numel() == J.D * J.D),
              "kvarn decode: H must be float32 [D, D]");
  J.keys = make_kind(kf, ks, k_bits, k_rotate);
  J.values = make_kind(vf, vs, v_bits, v_rotate);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && n_blocks.scalar_type() == at::kInt, "kvarn decode: int32 tables");
  J.bt = block_table.data_ptr<int32_t>();
  J.bt_stride = block_table.stride(0);
  J.nb = n_blocks.data_ptr<int32_t>();
  J.emap = exact_map.numel() ? exact_map.data_ptr<int32_t>() : nullptr;
  J.emap_blocks = exact_map.numel() ? exact_map.size(2) : 0;
  J.ek = exact_k.numel() ? exact_k.data_ptr<float>() : nullptr;
  J.ev = exact_v.numel() ? exact_v.data_ptr<float>() : nullptr;
  TORCH_CHECK(dense_k.size() == dense_v.size() && dense_k.size() == dense_pos.size(), "kvarn decode: dense lists");
  for (size_t i = 0; i < dense_k.size(); ++i) {
    const at::Tensor &k = dense_k[i], &v = dense_v[i];
    const auto t = k.scalar_type();
    TORCH_CHECK((t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && v.scalar_type() == t,
                "kvarn decode: dense rows must be float32, float16 or bfloat16, keys and values alike");
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(3) == J.D && v.size(3) == J.D && k.stride(3) == 1 &&
                    v.stride(3) == 1 && v.size(2) == k.size(2),
                "kvarn decode: dense rows must be [B, H, t, D] with unit stride on D");
  }
  J.dk = dense_k;
  J.dv = dense_v;
  J.dpos = dense_pos;
  if (paged_index.numel()) {
    const auto t = paged_rows.scalar_type();
    TORCH_CHECK((t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && paged_rows.dim() == 4 &&
                    paged_rows.size(1) == J.H && paged_rows.size(3) == J.D && paged_rows.stride(3) == 1,
                "kvarn decode: paged rows must be float32, float16 or bfloat16 [N, H, R, D] with unit stride on D");
    TORCH_CHECK(paged_index.scalar_type() == at::kLong && paged_index.is_contiguous() && paged_index.dim() == 3 &&
                    paged_index.size(0) == J.B && paged_index.size(1) == 2,
                "kvarn decode: paged index must be contiguous int64 [B, 2, t]");
    J.prows = paged_rows;
    J.pidx = paged_index.data_ptr<int64_t>();
    J.pt = paged_index.size(2);
    J.ppos = paged_pos;
    J.pR = paged_rows.size(2);
    J.psN = paged_rows.stride(0);
    J.psH = paged_rows.stride(1);
    J.psR = paged_rows.stride(2);
  }
  J.tiles_pos = tiles_pos;
  J.bias = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (J.bias) {
    J.bs0 = bias.stride(0);
    J.bs1 = bias.stride(1);
    J.bs2 = bias.stride(2);
    J.bheads = bias.size(1);
  }
  J.softcap = static_cast<float>(softcap);
  const int64_t S = std::max<int64_t>(1, splits);
  const int64_t B = J.B, H = J.H, M = J.M, D = J.D;
  auto opts = q.options();
  at::Tensor smx = at::empty({B, H, S, M}, opts), sl = at::empty({B, H, S, M}, opts);
  at::Tensor sp = at::empty({B, H, S, M, D}, opts), sr = at::empty({B, H, S, M, D}, opts);
  float *pmx = smx.data_ptr<float>(), *pl = sl.data_ptr<float>(), *pp = sp.data_ptr<float>(),
        *pr = sr.data_ptr<float>();
  const int ss = static_cast<int>((std::max<int64_t>(J.G, 128) + 15) / 16 * 16);  // dense_logits writes 16 at a time

  at::parallel_for(0, B * H * S, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(static_cast<int>(M), static_cast<int>(D), static_cast<int>(J.G), ss);
    std::vector<float> qbuf(2 * M * D);
    DenseBuf db(ss, static_cast<int>(D), static_cast<int>(M));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * S), h = item / S % H, s = item % S;
      State st(static_cast<int>(M), static_cast<int>(D));
      // the item's queries: scaled, and in the rotated basis (q~ = q H) when H is given, else the caller's qh
      const float* qin = J.q + (b * H + h) * M * D;
      for (int64_t i = 0; i < M * D; ++i) qbuf[i] = qin[i] * J.scale;
      const float* qp = qbuf.data();
      const float* qr = J.qh ? J.qh + (b * H + h) * M * D : qp;
      if (J.hmat) {
        matmul_h(qp, J.hmat, M, D, qbuf.data() + M * D);
        qr = qbuf.data() + M * D;
      }
      const int64_t nb = J.nb[b];
      const int64_t j0 = nb * s / S, j1 = nb * (s + 1) / S;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t pos = J.tiles_pos + j * J.G;
        const int32_t e = J.emap ? J.emap[(b * H + h) * J.emap_blocks + j] : -1;
        if (e >= 0) {  // kept exact (non-finite input): its exact copy, in the plain basis
          strided_rows(J, b, h, st, qp, J.ek + e * J.G * D, D, J.ev + e * J.G * D, D, J.G, pos, sc.s.data(), ss,
                       db);
        } else {
          packed_tile(J, b, h, J.bt[b * J.bt_stride + j], st, sc, pos, qp, qr);
        }
      }
      if (s == S - 1) {
        for (size_t i = 0; i < J.dk.size(); ++i)
          dense_segment(J, b, h, st, qp, J.dk[i], J.dv[i], J.dpos[i], sc.s.data(), ss, db);
        if (J.pidx) indexed_rows(J, b, h, st, qp, sc.s.data(), ss, db);
      }
      std::memcpy(pmx + item * M, st.mx.data(), M * 4);
      std::memcpy(pl + item * M, st.l.data(), M * 4);
      std::memcpy(pp + item * M * D, st.acc_p.data(), M * D * 4);
      std::memcpy(pr + item * M * D, st.acc_r.data(), M * D * 4);
    }
  });

  at::Tensor out_p = at::empty({B, H, M, D}, opts), out_r = at::empty({B, H, M, D}, opts);
  float *op = out_p.data_ptr<float>(), *orr = out_r.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t m = 0; m < M; ++m) {
        float top = NEG_INF;
        for (int64_t s = 0; s < S; ++s) top = std::max(top, pmx[(bh * S + s) * M + m]);
        float* o1 = op + (bh * M + m) * D;
        float* o2 = orr + (bh * M + m) * D;
        std::fill(o1, o1 + D, 0.f);
        std::fill(o2, o2 + D, 0.f);
        if (top == NEG_INF) {  // a fully masked row gives 0, as SDPA does (NaN if a NaN logit was met)
          bool nan = false;
          for (int64_t s = 0; s < S; ++s) nan |= std::isnan(pl[(bh * S + s) * M + m]);
          if (nan) std::fill(o1, o1 + D, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        float total = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t at = (bh * S + s) * M + m;
          if (pmx[at] == NEG_INF) continue;
          const float w = std::exp(pmx[at] - top);
          total += w * pl[at];
          for (int64_t d = 0; d < D; ++d) {
            o1[d] += w * pp[at * D + d];
            o2[d] += w * pr[at * D + d];
          }
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) {
          o1[d] *= inv;
          o2[d] *= inv;
        }
      }
    if (J.hmat) {  // out = plain + rotated H, once per row
      std::vector<float> tmp(M * D);
      for (int64_t bh = begin; bh < end; ++bh) {
        matmul_h(orr + bh * M * D, J.hmat, M, D, tmp.data());
        for (int64_t i = 0; i < M * D; ++i) op[bh * M * D + i] += tmp[i];
      }
    }
  });
  if (J.hmat) return {out_p, at::Tensor()};
  return {out_p, out_r};
}

// A decode step's fresh K and V rows into their full-precision slots (vLLM's pages, kvarn.integrations.vllm.paged):
//     rows[blk[b, 0], h, sub[b, 0]] = key[tok[b], h],  rows[blk[b, 1], h, sub[b, 1]] = value[tok[b], h]
// for every row b and head h: what `rows[blk, :, sub] = stack([key[tok], value[tok]], 1)` does, as plain copies in
// one call (two torch calls a layer and step fewer). rows [N, H, R, D], key and value [T, H, D] of rows' dtype, unit
// stride on D; tok int64 [B], blk and sub int64 [B, 2] contiguous; every index is checked before anything is written.
void write_rows(at::Tensor rows, const at::Tensor& key, const at::Tensor& value, const at::Tensor& tok,
                const at::Tensor& blk, const at::Tensor& sub) {
  TORCH_CHECK(rows.dim() == 4 && key.dim() == 3 && value.dim() == 3,
              "kvarn write_rows: rows [N,H,R,D], key/value [T,H,D]");
  TORCH_CHECK(key.scalar_type() == rows.scalar_type() && value.scalar_type() == rows.scalar_type(),
              "kvarn write_rows: key, value and rows must share a dtype");
  const int64_t H = rows.size(1), D = rows.size(3);
  TORCH_CHECK(key.size(1) == H && value.size(1) == H && key.size(2) == D && value.size(2) == D &&
                  value.size(0) == key.size(0),
              "kvarn write_rows: key/value [T, H, D] must match rows' H and D");
  TORCH_CHECK(rows.stride(3) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "kvarn write_rows: unit stride on D");
  TORCH_CHECK(tok.scalar_type() == at::kLong && blk.scalar_type() == at::kLong && sub.scalar_type() == at::kLong &&
                  tok.dim() == 1 && blk.dim() == 2 && sub.dim() == 2 && blk.size(1) == 2 && sub.size(1) == 2 &&
                  blk.size(0) == tok.size(0) && sub.size(0) == tok.size(0) && tok.is_contiguous() &&
                  blk.is_contiguous() && sub.is_contiguous(),
              "kvarn write_rows: tok int64 [B], blk and sub int64 [B, 2], contiguous");
  const int64_t B = tok.size(0), T = key.size(0), N = rows.size(0), R = rows.size(2);
  const int64_t *pt = tok.data_ptr<int64_t>(), *pb = blk.data_ptr<int64_t>(), *ps = sub.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pt[b] >= 0 && pt[b] < T, "kvarn write_rows: token index out of range");
    for (int k = 0; k < 2; ++k)
      TORCH_CHECK(pb[2 * b + k] >= 0 && pb[2 * b + k] < N && ps[2 * b + k] >= 0 && ps[2 * b + k] < R,
                  "kvarn write_rows: slot row out of range");
  }
  const int64_t e = rows.element_size();
  char* dst = static_cast<char*>(rows.data_ptr());
  const char* src[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const int64_t s0[2] = {key.stride(0), value.stride(0)}, s1[2] = {key.stride(1), value.stride(1)};
  for (int64_t b = 0; b < B; ++b)
    for (int k = 0; k < 2; ++k)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + (pb[2 * b + k] * rows.stride(0) + h * rows.stride(1) + ps[2 * b + k] * rows.stride(2)) * e,
                    src[k] + (pt[b] * s0[k] + h * s1[k]) * e, D * e);
}
