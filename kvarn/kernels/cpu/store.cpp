// Fused tile store over AffineQuantizer tiles (kvarn.kernels.cpu.store documents the arithmetic; kvarn.quant.affine
// is the reference). One work item = one tile [G][D]: optional Hadamard, rows per axis, VarN, RTN per row, fold,
// cast, pack; rotate = auto encodes both bases, decodes both and keeps the lower weighted error.
//
// Every float32 operation is the reference's, in its order (x / c / r, q * a + z, then * t), without fused
// multiply-adds (the pragma below); statistics accumulate in double, with explicit fused multiply-adds. What can still
// differ: expf / logf (Sleef here, MKL in torch: 1 ulp at most) and the last bits of a std (exact quotients summed
// here, torch sums their float32 roundings).
#pragma GCC optimize("fp-contract=off")

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
#if defined(__AVX512F__) && __has_include(<sleef.h>)  // torch ships Sleef (its vectorized exp/log)
#include <sleef.h>
#define KVARN_SLEEF 1
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

enum Dtype { F32 = 0, F16 = 1, BF16 = 2, E4M3 = 3 };

constexpr float STD_LO = 1e-3f, STD_HI = 1e3f, LOG_LO = -0.3f, LOG_HI = 10.0f, IMB_FLOOR = 1e-8f;
constexpr float RANGE_GUARD = 1e-10f, E4M3_TINY = 0.015625f;  // finfo(float8_e4m3fn).tiny = 2^-6

int item_size(int dt) { return dt == F32 ? 4 : dt == E4M3 ? 1 : 2; }

c10::ScalarType scalar_type(int dt) {
  switch (dt) {
    case F32: return at::kFloat;
    case F16: return at::kHalf;
    case BF16: return at::kBFloat16;
    default: return at::ScalarType::Float8_e4m3fn;
  }
}

// the inverse: a stored field's dtype as its code
int dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return F32;
    case at::kHalf: return F16;
    case at::kBFloat16: return BF16;
    case at::ScalarType::Float8_e4m3fn: return E4M3;
    default: TORCH_CHECK(false, "kvarn: scales in ", x.scalar_type()); return F32;
  }
}

// a float32 value cast to storage dtype dt at p (round to nearest even; fp16 overflows to inf, as torch's .to();
// e4m3 would saturate, so out-of-range values become NaN first, as kvarn.quant.affine.store_scale does)
void put(int dt, char* p, int i, float v) {
  constexpr float E4M3_MAX = 448.f;
  switch (dt) {
    case F32: reinterpret_cast<float*>(p)[i] = v; break;
    case F16: reinterpret_cast<c10::Half*>(p)[i] = c10::Half(v); break;
    case BF16: reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v); break;
    default:
      reinterpret_cast<c10::Float8_e4m3fn*>(p)[i] =
          c10::Float8_e4m3fn(std::fabs(v) <= E4M3_MAX ? v : std::numeric_limits<float>::quiet_NaN());
  }
}

float get(int dt, const char* p, int i) {
  switch (dt) {
    case F32: return reinterpret_cast<const float*>(p)[i];
    case F16: return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]);
    case BF16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]);
    default: return static_cast<float>(reinterpret_cast<const c10::Float8_e4m3fn*>(p)[i]);
  }
}

struct Config {
  int G, D, R, C;  // tile tokens, head_dim; rows and columns of the quantization layout
  bool channel;    // keys: rows = channels (X = w^T [D][G]); values: rows = tokens (X = w [G][D])
  int bits, rotate, iters;  // rotate: 0 none, 1 hadamard, 2 auto
  bool varn, relative, weighted;
  int scale_dt, zero_dt, col_dt;  // zero_dt: fp16 when the scales are 8-bit (kvarn.quant.affine.zero_dtype)
  bool clipped;                   // clip < 1 (kvarn.ops.rtn.row_range); else the range is the row's min and max
  float half_clip;                // 0.5 * clip in float32
  int widths;                     // keys at row widths (kvarn.ops.widths): the bits of codes a column holds; 0: off
  int mb() const { return C * bits / 8; }
  int code_bytes() const { return widths ? widths * C / 8 : R * mb(); }
};

// x @ H along the rows of T [d][n] (channel-major: row i = channel i of n vectors), in place: kvarn.ops.hadamard's
// power-of-two blocks (binary expansion of d, largest first), each a butterfly (a + b, a - b) with h = 1, 2, 4, ...
// then divided by sqrt(block). Whole rows at a time, so the butterflies are vector operations over the n vectors.
template <typename T_>
void fwht_rows(T_* T, int d, int n) {
  int off = 0;
  for (int bit = 30; bit >= 0; --bit) {
    if (!((d >> bit) & 1)) continue;
    const int m = 1 << bit;
    T_* v = T + static_cast<int64_t>(off) * n;
    for (int h = 1; h < m; h *= 2)
      for (int i = 0; i < m; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          T_* p = v + static_cast<int64_t>(j) * n;
          T_* q = p + static_cast<int64_t>(h) * n;
#pragma omp simd
          for (int k = 0; k < n; ++k) {
            const T_ a = p[k], b = q[k];
            p[k] = a + b;
            q[k] = a - b;
          }
        }
    const T_ s = static_cast<T_>(std::sqrt(static_cast<double>(m)));
#pragma omp simd
    for (int k = 0; k < m * n; ++k) v[k] /= s;
    off += m;
  }
}

// One encoding of a tile, fields in storage dtypes (raw bytes), plus its codes unpacked (for the auto decode).
struct Encoded {
  std::vector<uint8_t> q, codes, wid;  // wid: the rows' widths, 3 bits each (row widths only)
  std::vector<char> a, z, col;
  Encoded(const Config& c)
      : q(c.R * c.C), codes(c.code_bytes()), wid(c.widths ? c.R * 3 / 8 : 0), a(c.R * item_size(c.scale_dt)),
        z(c.R * item_size(c.zero_dt)), col(c.C * item_size(c.col_dt)) {}
};

// A thread's scratch for one tile shape (kept between calls: allocating and zeroing it cost as much as a small call)
struct Work {
  int G, D, R;
  std::vector<float> x0, x, dec, b, sc, sr, lc, lr, ec, er, bc, br, tf, rec, u, m, step, err, top;
  std::vector<double> zsd, iec, ier;
  // row widths: per row and width its error, grid (lo, delta), the dynamic program's costs and choices, the widths
  std::vector<float> werr, wlo, wdelta, cost, cost2, wt;
  std::vector<uint8_t> choice, width;
  Work(const Config& c)
      : G(c.G), D(c.D), R(c.R), x0(c.G * c.D), x(c.R * c.C), dec(c.R * c.C), b(c.R * c.C), sc(c.C), sr(c.R),
        lc(c.C), lr(c.R), ec(c.C), er(c.R), bc(c.C), br(c.R), tf(c.C), rec(c.G * c.D), u(c.R * c.C), m(c.R * c.R),
        step(c.R), err(c.R * c.C), top(c.R), zsd(c.R), iec(c.C), ier(c.R) {}
};

Work& work_for(const Config& c) {
  thread_local std::unique_ptr<Work> w;
  if (!w || w->G != c.G || w->D != c.D || w->R != c.R) w = std::make_unique<Work>(c);
  return *w;
}

// The VarN statistics of Y = X / ec[cols] / er[rows] (the reference forms Y in float32, x / c / r, and takes its stds
// with double accumulation). The kernel never forms Y: a std is taken of the exact quotient in double, whose float32
// rounding is what torch sums (a relative change below 2^-24 per element, which averages out in a std). Per row r of
// Z = X / ec the deviations d_j = x_j / ec_j - x_0 / ec_0 (one fused multiply-add by 1 / ec in double); per column j
// of X / er the deviations from the first row, and the column std of Y is that std / ec_j. Sums in double of the
// deviations from the first element of each row (column): a constant row gives exactly 0, and large offsets do not
// cancel the variance. Only the statistics are computed this way; every float32 value the tile is stored from (B,
// lo, delta, codes, scales) is formed with the reference's own operations in encode_rows.

double std_of(double s, double ss, int n) { return std::sqrt(std::max((ss - s * s / n) / (n - 1), 0.0)); }

#if !defined(__AVX512F__) && defined(__AVX2__)
// The sum of 8 doubles, lanes 0-3 in lo and 4-7 in hi, in _mm512_reduce_add_pd's order (gcc's avxintrin: the upper
// half plus the lower, then the upper pair plus the lower, then the two)
inline double reduce_add8(__m256d lo, __m256d hi) {
  const __m256d t3 = _mm256_add_pd(hi, lo);
  const __m128d t6 = _mm_add_pd(_mm256_extractf128_pd(t3, 1), _mm256_castpd256_pd128(t3));
  return t6[0] + t6[1];
}
#endif

// w.zsd[r] = std over j of x[r][j] * iec[j], in double
void row_stds(const Config& c, const float* X, Work& w) {
  const int R = c.R, C = c.C;
  const double* iec = w.iec.data();
  for (int r = 0; r < R; ++r) {
    const float* x = X + r * C;
    const double k = x[0] * iec[0];
    double s = 0.0, ss = 0.0;
    int j = 0;
#if defined(__AVX512F__)
    const __m512d vk = _mm512_set1_pd(k);
    __m512d s0 = _mm512_setzero_pd(), s1 = s0, q0 = s0, q1 = s0;
    for (; j + 16 <= C; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      const __m512d d0 = _mm512_fmsub_pd(x0, _mm512_loadu_pd(iec + j), vk);
      const __m512d d1 = _mm512_fmsub_pd(x1, _mm512_loadu_pd(iec + j + 8), vk);
      s0 = _mm512_add_pd(s0, d0);
      s1 = _mm512_add_pd(s1, d1);
      q0 = _mm512_fmadd_pd(d0, d0, q0);
      q1 = _mm512_fmadd_pd(d1, d1, q1);
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    ss = _mm512_reduce_add_pd(_mm512_add_pd(q0, q1));
#elif defined(__AVX2__) && defined(__FMA__)  // AVX-512's lanes in halves of 4, its sums in its order
    const __m256d vk = _mm256_set1_pd(k);
    __m256d s0[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()}, s1[2] = {s0[0], s0[0]}, q0[2] = {s0[0], s0[0]},
            q1[2] = {s0[0], s0[0]};
    for (; j + 16 <= C; j += 16)
      for (int h = 0; h < 2; ++h) {
        const int a = j + 4 * h, b = a + 8;  // AVX-512's lanes a.. of x0 and x1
        const __m256d d0 = _mm256_fmsub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + a)), _mm256_loadu_pd(iec + a), vk);
        const __m256d d1 = _mm256_fmsub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + b)), _mm256_loadu_pd(iec + b), vk);
        s0[h] = _mm256_add_pd(s0[h], d0);
        s1[h] = _mm256_add_pd(s1[h], d1);
        q0[h] = _mm256_fmadd_pd(d0, d0, q0[h]);
        q1[h] = _mm256_fmadd_pd(d1, d1, q1[h]);
      }
    s = reduce_add8(_mm256_add_pd(s0[0], s1[0]), _mm256_add_pd(s0[1], s1[1]));
    ss = reduce_add8(_mm256_add_pd(q0[0], q1[0]), _mm256_add_pd(q0[1], q1[1]));
#endif
    for (; j < C; ++j) {
      const double d = std::fma(static_cast<double>(x[j]), iec[j], -k);
      s += d;
      ss = std::fma(d, d, ss);
    }
    w.zsd[r] = std_of(s, ss, C);
  }
}

// w.sr = std of the rows of Y (w.zsd / er), w.sc = of its columns (blocks of 16 columns kept in registers over all
// rows, two independent accumulators per block: even and odd rows)
void stats(const Config& c, const float* X, Work& w) {
  const int R = c.R, C = c.C;
  double* ier = w.ier.data();
  for (int r = 0; r < R; ++r) {
    w.sr[r] = static_cast<float>(w.zsd[r] / w.er[r]);
    ier[r] = 1.0 / w.er[r];
  }
  int j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + 16 <= C; j0 += 16) {
    const __m512 v0 = _mm512_loadu_ps(X + j0);
    const __m512d i0 = _mm512_set1_pd(ier[0]);
    const __m512d h0 = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v0)), i0);
    const __m512d h1 =
        _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v0), 1))), i0);
    __m512d s[4], q[4];
    for (int a = 0; a < 4; ++a) s[a] = q[a] = _mm512_setzero_pd();
    auto add = [&](int r, int a) {
      const __m512 v = _mm512_loadu_ps(X + r * C + j0);
      const __m512d ir = _mm512_set1_pd(ier[r]);
      const __m512d d0 = _mm512_fmsub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), ir, h0);
      const __m512d d1 =
          _mm512_fmsub_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))), ir, h1);
      s[a] = _mm512_add_pd(s[a], d0);
      s[a + 1] = _mm512_add_pd(s[a + 1], d1);
      q[a] = _mm512_fmadd_pd(d0, d0, q[a]);
      q[a + 1] = _mm512_fmadd_pd(d1, d1, q[a + 1]);
    };
    int r = 0;
    for (; r + 2 <= R; r += 2) add(r, 0), add(r + 1, 2);
    if (r < R) add(r, 0);
    alignas(64) double st[16], sq[16];
    _mm512_store_pd(st, _mm512_add_pd(s[0], s[2]));
    _mm512_store_pd(st + 8, _mm512_add_pd(s[1], s[3]));
    _mm512_store_pd(sq, _mm512_add_pd(q[0], q[2]));
    _mm512_store_pd(sq + 8, _mm512_add_pd(q[1], q[3]));
    for (int j = 0; j < 16; ++j) w.sc[j0 + j] = static_cast<float>(std_of(st[j], sq[j], R) * w.iec[j0 + j]);
  }
#elif defined(__AVX2__) && defined(__FMA__)  // the same per column, 4 columns a vector, 8 at a time
  for (; j0 + 16 <= C; j0 += 16)
    for (int c0 = j0; c0 < j0 + 16; c0 += 8) {
      const __m256d i0 = _mm256_set1_pd(ier[0]);
      const __m256d h0 = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(X + c0)), i0);
      const __m256d h1 = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(X + c0 + 4)), i0);
      __m256d s[4], q[4];
      for (int a = 0; a < 4; ++a) s[a] = q[a] = _mm256_setzero_pd();
      auto add = [&](int r, int a) {
        const __m256d ir = _mm256_set1_pd(ier[r]);
        const __m256d d0 = _mm256_fmsub_pd(_mm256_cvtps_pd(_mm_loadu_ps(X + r * C + c0)), ir, h0);
        const __m256d d1 = _mm256_fmsub_pd(_mm256_cvtps_pd(_mm_loadu_ps(X + r * C + c0 + 4)), ir, h1);
        s[a] = _mm256_add_pd(s[a], d0);
        s[a + 1] = _mm256_add_pd(s[a + 1], d1);
        q[a] = _mm256_fmadd_pd(d0, d0, q[a]);
        q[a + 1] = _mm256_fmadd_pd(d1, d1, q[a + 1]);
      };
      int r = 0;
      for (; r + 2 <= R; r += 2) add(r, 0), add(r + 1, 2);
      if (r < R) add(r, 0);
      alignas(32) double st[8], sq[8];
      _mm256_store_pd(st, _mm256_add_pd(s[0], s[2]));
      _mm256_store_pd(st + 4, _mm256_add_pd(s[1], s[3]));
      _mm256_store_pd(sq, _mm256_add_pd(q[0], q[2]));
      _mm256_store_pd(sq + 4, _mm256_add_pd(q[1], q[3]));
      for (int j = 0; j < 8; ++j) w.sc[c0 + j] = static_cast<float>(std_of(st[j], sq[j], R) * w.iec[c0 + j]);
    }
#endif
  for (int j = j0; j < C; ++j) {  // the columns left over (C not a multiple of 16, or neither AVX-512 nor AVX2)
    const double h = X[j] * ier[0];
    double s = 0.0, ss = 0.0;
    for (int r = 0; r < R; ++r) {
      const double d = std::fma(static_cast<double>(X[r * C + j]), ier[r], -h);
      s += d;
      ss = std::fma(d, d, ss);
    }
    w.sc[j] = static_cast<float>(std_of(s, ss, R) * w.iec[j]);
  }
}

float spread(const std::vector<float>& s) {
  const auto [mn, mx] = std::minmax_element(s.begin(), s.end());
  return *mx / std::max(*mn, IMB_FLOOR);
}

// l <- clamp(l + ln(clamp(sigma, 1e-3, 1e3)), -0.3, 10), e = exp(l); vectorized with Sleef (torch's own exp/log on
// this build are MKL's: either is within 1 ulp of the exact value)
void step(std::vector<float>& l, std::vector<float>& e, const std::vector<float>& sigma) {
  const int n = static_cast<int>(l.size());
  int i = 0;
#if defined(KVARN_SLEEF)
  const __m512 lo = _mm512_set1_ps(STD_LO), hi = _mm512_set1_ps(STD_HI);
  const __m512 llo = _mm512_set1_ps(LOG_LO), lhi = _mm512_set1_ps(LOG_HI);
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 sg = _mm512_min_ps(_mm512_max_ps(_mm512_mask_loadu_ps(hi, m, sigma.data() + i), lo), hi);
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(m, l.data() + i),
                                                               Sleef_logf16_u10(sg)), llo), lhi);
    _mm512_mask_storeu_ps(l.data() + i, m, v);
    _mm512_mask_storeu_ps(e.data() + i, m, Sleef_expf16_u10(v));
  }
#endif
  for (; i < n; ++i) {
    l[i] = std::min(std::max(l[i] + std::log(std::min(std::max(sigma[i], STD_LO), STD_HI)), LOG_LO), LOG_HI);
    e[i] = std::exp(l[i]);
  }
}

void inverse(const std::vector<float>& e, std::vector<double>& inv) {
  for (size_t i = 0; i < e.size(); ++i) inv[i] = 1.0 / e[i];
}

// VarN on X [R][C] (kvarn.ops.varn): best scales into w.bc [C], w.br [R]. Imb(Y) after iteration i is computed on the
// Y that iteration i + 1 starts from, so its column stds are reused.
void varn(const Config& c, const float* X, Work& w) {
  std::fill(w.lc.begin(), w.lc.end(), 0.f);
  std::fill(w.lr.begin(), w.lr.end(), 0.f);
  std::fill(w.ec.begin(), w.ec.end(), 1.f);
  std::fill(w.er.begin(), w.er.end(), 1.f);
  std::fill(w.bc.begin(), w.bc.end(), 1.f);
  std::fill(w.br.begin(), w.br.end(), 1.f);
  std::fill(w.iec.begin(), w.iec.end(), 1.0);
  row_stds(c, X, w);
  stats(c, X, w);
  float best = spread(w.sc) + spread(w.sr);
  for (int it = 0; it < c.iters; ++it) {
    step(w.lc, w.ec, w.sc);
    inverse(w.ec, w.iec);
    row_stds(c, X, w);
    for (int r = 0; r < c.R; ++r) w.sr[r] = static_cast<float>(w.zsd[r] / w.er[r]);  // rows of Z / er (old)
    step(w.lr, w.er, w.sr);
    stats(c, X, w);
    const float imb = spread(w.sc) + spread(w.sr);
    if (imb <= best) {  // ties take the newer scales
      best = imb;
      w.bc = w.ec;
      w.br = w.er;
    }
  }
}

// min and max of a row (gcc does not vectorize float min/max reductions without -ffinite-math-only)
void row_range(const float* row, int n, float& lo, float& hi) {
  lo = hi = row[0];
  int j = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vlo = _mm512_loadu_ps(row), vhi = vlo;
    for (j = 16; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(row + j);
      vlo = _mm512_min_ps(vlo, v);
      vhi = _mm512_max_ps(vhi, v);
    }
    lo = _mm512_reduce_min_ps(vlo);
    hi = _mm512_reduce_max_ps(vhi);
  }
#endif
  for (; j < n; ++j) lo = std::min(lo, row[j]), hi = std::max(hi, row[j]);
}

// q[j] = clamp(round_half_even((row[j] - lo) / delta), 0, top), as torch.round and clamp_
void row_codes(const float* row, int n, float lo, float delta, float top, uint8_t* q) {
  int j = 0;
#if defined(__AVX512F__)
  const __m512 vlo = _mm512_set1_ps(lo), vd = _mm512_set1_ps(delta), vtop = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vlo), vd);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), vtop);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
  }
#endif
  for (; j < n; ++j)
    q[j] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((row[j] - lo) / delta), 0.f), top));
}

// Query-aware rounding (kvarn.ops.rtn.query_aware_round): the rows' unrounded codes w.u [R][C] rounded in order,
// row j to the nearest level of its target u_j + sum_{r<j} m_rj e_r, e_r = u_r - q_r, m_rj = C_rj a_r / a_j (coef
// [R][R] = C, w.step = a). The sum is taken left-looking, r ascending, a product then a sum each (torch's order: its
// push after row r adds to every later row), over a block of columns held in registers; a zero m_rj is skipped.
constexpr int QA_LANES = KVARN_VW;  // lanes.h (each column's sum is the same at any width)
typedef float QaVec __attribute__((vector_size(4 * QA_LANES)));

inline QaVec qa_load(const float* p) {
  QaVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Row j's targets over NV vectors of columns from g0 (t, QA_LANES * NV floats): u_j + sum_{r<j} m_rj e_r, r ascending,
// product then sum; the NV accumulators stay in registers.
template <int NV>
void qa_targets(const float* uj, const float* e, const float* m, int j, int R, int C, float* t) {
  QaVec acc[NV];
  for (int k = 0; k < NV; ++k) acc[k] = qa_load(uj + k * QA_LANES);
  for (int r = 0; r < j; ++r) {
    const float mr = m[r * R + j];
    if (mr == 0.f) continue;
    const float* er = e + static_cast<int64_t>(r) * C;
    for (int k = 0; k < NV; ++k) acc[k] = acc[k] + mr * qa_load(er + k * QA_LANES);
  }
  std::memcpy(t, acc, sizeof acc);
}

void query_aware_rows(const Config& c, const float* coef, Work& w, uint8_t* q) {
  const int R = c.R, C = c.C;
  const float top_all = static_cast<float>((1 << c.bits) - 1);
  const float* u = w.u.data();
  float* m = w.m.data();
  float* e = w.err.data();  // [R][C]
  for (int r = 0; r < R; ++r)
    for (int j = r + 1; j < R; ++j) m[r * R + j] = coef[r * R + j] * w.step[r] / w.step[j];
  for (int g0 = 0; g0 < C;) {
    const int n = C - g0 >= 8 * QA_LANES ? 8 * QA_LANES : C - g0 >= 4 * QA_LANES ? 4 * QA_LANES : C - g0;
    for (int j = 0; j < R; ++j) {
      alignas(64) float t[8 * QA_LANES];
      const float* uj = u + j * C + g0;
      if (n == 8 * QA_LANES) {
        qa_targets<8>(uj, e + g0, m, j, R, C, t);
      } else if (n == 4 * QA_LANES) {
        qa_targets<4>(uj, e + g0, m, j, R, C, t);
      } else {
        for (int g = 0; g < n; ++g) t[g] = uj[g];
        for (int r = 0; r < j; ++r) {
          const float mr = m[r * R + j];
          if (mr == 0.f) continue;
          const float* er = e + r * C + g0;
          for (int g = 0; g < n; ++g) t[g] = t[g] + mr * er[g];
        }
      }
      uint8_t* qj = q + j * C + g0;
      float* ej = e + j * C + g0;
      const float top = c.widths ? w.top[j] : top_all;  // row widths: each row's own largest code
#pragma omp simd
      for (int g = 0; g < n; ++g) {
        const float v = std::min(std::max(std::nearbyint(t[g]), 0.f), top);
        qj[g] = static_cast<uint8_t>(v);
        ej[g] = uj[g] - v;
      }
    }
    g0 += n;
  }
}

// kvarn.ops.rtn.row_range's clip: m = (lo + hi) * 0.5, h = (hi - lo) * (0.5 clip), [m - h, m + h], each step rounded
// to float32 as PyTorch rounds it (no fused multiply-add here: -ffp-contract=fast would fuse m - (hi - lo) * hc)
__attribute__((noinline, optimize("fp-contract=off"))) void clip_range(float& lo, float& hi, float half_clip) {
  const float mid = (lo + hi) * 0.5f, half = (hi - lo) * half_clip;
  lo = mid - half;
  hi = mid + half;
}

// kvarn.ops.packing's layouts. One row of C codes (q >> shift) & mask at `bits` in planes: byte j holds codes j + k m,
// k < 8 / bits, m = C bits / 8, at bits [k b, (k + 1) b).
void pack_planes(const uint8_t* q, int C, int bits, int shift, uint8_t* out) {
  const int m = C * bits / 8, per = 8 / bits, mask = (1 << bits) - 1;
  for (int j = 0; j < m; ++j) {
    uint8_t byte = 0;
    for (int k = 0; k < per; ++k) byte |= static_cast<uint8_t>(((q[k * m + j] >> shift) & mask) << (k * bits));
    out[j] = byte;
  }
}

// n 3-bit codes (n a multiple of 8) in groups of 8 codes in 3 bytes, code j at bits [3j, 3j + 3)
void pack3(const uint8_t* q, int n, uint8_t* out) {
  for (int i = 0; i < n / 8; ++i) {
    uint32_t word = 0;
    for (int j = 0; j < 8; ++j) word |= static_cast<uint32_t>(q[8 * i + j]) << (3 * j);
    for (int k = 0; k < 3; ++k) out[3 * i + k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

constexpr int WIDTHS = 5;  // 0..4 bits a row
constexpr int N_CLIPS = 13;  // kvarn.ops.widths.CLIPS: 0.40, 0.45, .., 1.00

// The N_CLIPS grids' ranges [clo_k, chi_k] of a row's [lo, hi], each as clip_range forms it (the last unclipped), in
// arrays of 16 (lanes past N_CLIPS unused)
void clip_ranges(float lo, float hi, float* clo, float* chi) {
  static const auto half = [] {
    std::array<float, 16> h{};
    for (int k = 0; k + 1 < N_CLIPS; ++k) h[k] = static_cast<float>(0.5 * ((8 + k) / 20.0));
    return h;
  }();
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps((lo + hi) * 0.5f);
  const __m512 h = _mm512_mul_ps(_mm512_set1_ps(hi - lo), _mm512_loadu_ps(half.data()));
  _mm512_store_ps(clo, _mm512_sub_ps(m, h));
  _mm512_store_ps(chi, _mm512_add_ps(m, h));
#else
  for (int k = 0; k + 1 < N_CLIPS; ++k) {
    clo[k] = lo;
    chi[k] = hi;
    clip_range(clo[k], chi[k], half[k]);
  }
#endif
  clo[N_CLIPS - 1] = lo;
  chi[N_CLIPS - 1] = hi;
}

// delta_k = max((chi_k - clo_k) / levels, RANGE_GUARD), arrays of 16 (max(guard, x): a NaN x stays NaN, as in
// std::max(x, guard))
void grid_steps(const float* clo, const float* chi, float levels, float* delta) {
#if defined(__AVX512F__)
  const __m512 d = _mm512_div_ps(_mm512_sub_ps(_mm512_load_ps(chi), _mm512_load_ps(clo)), _mm512_set1_ps(levels));
  _mm512_store_ps(delta, _mm512_max_ps(_mm512_set1_ps(RANGE_GUARD), d));
#else
  for (int k = 0; k < N_CLIPS; ++k) delta[k] = std::max((chi[k] - clo[k]) / levels, RANGE_GUARD);
#endif
}

// e[k] = sum_j wt_j (clamp(round((row_j - lo_k) / delta_k), 0, top) delta_k + lo_k - row_j)^2 for the N_CLIPS grids
// (lo_k, delta_k) at once (one pass over the row, N_CLIPS independent sums), the quotient as a product by 1 / delta
// and float sums: only compared (the stored codes are formed as torch forms them)
void grid_errors(const float* row, const float* wt, int n, const float* lo, const float* delta, float top, float* e) {
  alignas(64) float inv[16];
  int j = 0;
#if defined(__AVX512F__)  // lo, delta: arrays of 16 (grid_steps)
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(delta)));
#else
  for (int k = 0; k < N_CLIPS; ++k) inv[k] = 1.f / delta[k];
#endif
  for (int k = 0; k < N_CLIPS; ++k) e[k] = 0.f;
#if defined(__AVX512F__)
  __m512 acc[N_CLIPS];
  for (int k = 0; k < N_CLIPS; ++k) acc[k] = _mm512_setzero_ps();
  const __m512 vtop = _mm512_set1_ps(top), zero = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j), w = _mm512_loadu_ps(wt + j);
#pragma GCC unroll 13
    for (int k = 0; k < N_CLIPS; ++k) {
      const __m512 vlo = _mm512_set1_ps(lo[k]);
      __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(x, vlo), _mm512_set1_ps(inv[k])),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, zero), vtop);
      const __m512 d = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(q, _mm512_set1_ps(delta[k])), vlo), x);
      acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(_mm512_mul_ps(d, d), w));
    }
  }
  for (int k = 0; k < N_CLIPS; ++k) e[k] = _mm512_reduce_add_ps(acc[k]);
#endif
  for (; j < n; ++j)
    for (int k = 0; k < N_CLIPS; ++k) {
      const float q = std::min(std::max(std::nearbyint((row[j] - lo[k]) * inv[k]), 0.f), top);
      const float d = q * delta[k] + lo[k] - row[j];
      e[k] += d * d * wt[j];
    }
}

// sum_j x[j] in double (8 lanes, then their sum: another order than a running sum's, yet the same double wherever the
// sum is exact, as for 128 floats whose nonzero magnitudes span less than 2^22; the float32 mean rarely moves else)
double sum_double(const float* x, int n) {
  double s = 0.0;
  int j = 0;
#if defined(__AVX512F__)
  __m512d a0 = _mm512_setzero_pd(), a1 = a0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  for (; j < n; ++j) s += x[j];
  return s;
}

// sum_j float32(d_j d_j wt_j) in double, d_j = mean - row_j in float32 (a width-0 row's error)
double mean_error(const float* row, const float* wt, int n, float mean) {
  double s = 0.0;
  int j = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mean);
  __m512d a0 = _mm512_setzero_pd(), a1 = a0;
  for (; j + 16 <= n; j += 16) {
    const __m512 d = _mm512_sub_ps(m, _mm512_loadu_ps(row + j));
    const __m512 e = _mm512_mul_ps(_mm512_mul_ps(d, d), _mm512_loadu_ps(wt + j));
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  for (; j < n; ++j) {
    const float d = mean - row[j];
    s += static_cast<double>(d * d * wt[j]);
  }
  return s;
}

// Row widths (kvarn.ops.widths.width_targets) of balanced rows B [R][C] with VarN's s_c, s_r (w.bc, w.br) and row
// weights gain [R] (null: 1): per row the error of its mean (width 0, summed in double) and of the best of the
// N_CLIPS grids at each width 1..4, e_r(w) = sum_c s_r^2 s_c^2 g_r (q delta + lo - b)^2 (`grid_errors`; the first
// clip of least error); then the widths of least total error holding c.widths bits (exact dynamic program over the
// rows, float32 costs, the first width on ties) into w.width, each row's grid in w.wlo / w.wdelta [r * 5 + width].
// Sums run in another order than torch's, so a near-tie may fall the other way.
void width_targets(const Config& c, const float* B, const float* gain, Work& w) {
  const int R = c.R, C = c.C, T = c.widths;
  w.werr.resize(R * WIDTHS);
  w.wlo.resize(R * WIDTHS);
  w.wdelta.resize(R * WIDTHS);
  w.wt.resize(C);
  w.width.resize(R);
  float* wt = w.wt.data();
  for (int r = 0; r < R; ++r) {
    const float* row = B + r * C;
    const float sr2 = w.br[r] * w.br[r];
    if (gain) {
      const float g = gain[r];
#pragma omp simd
      for (int j = 0; j < C; ++j) wt[j] = sr2 * (w.bc[j] * w.bc[j]) * g;
    } else {
#pragma omp simd
      for (int j = 0; j < C; ++j) wt[j] = sr2 * (w.bc[j] * w.bc[j]);
    }
    float lo0, hi0;
    row_range(row, C, lo0, hi0);
    const float mean = static_cast<float>(sum_double(row, C) / C);
    const double e0 = mean_error(row, wt, C, mean);
    w.werr[r * WIDTHS] = static_cast<float>(e0);
    w.wlo[r * WIDTHS] = mean;
    w.wdelta[r * WIDTHS] = std::max(hi0 - lo0, RANGE_GUARD);
    alignas(64) float clo[16], chi[16], cdelta[16], ce[N_CLIPS];
    clip_ranges(lo0, hi0, clo, chi);
    for (int bits = 1; bits < WIDTHS; ++bits) {
      const float levels = static_cast<float>((1 << bits) - 1);
      grid_steps(clo, chi, levels, cdelta);
      grid_errors(row, wt, C, clo, cdelta, levels, ce);
      int best = 0;
      for (int k = 1; k < N_CLIPS; ++k)
        if (ce[k] < ce[best]) best = k;
      w.wlo[r * WIDTHS + bits] = clo[best];
      w.wdelta[r * WIDTHS + bits] = cdelta[best];
      w.werr[r * WIDTHS + bits] = ce[best];
    }
  }
  // cost[t]: the least error of the rows so far holding t bits; choice[i][t]: row i's width on that path
  const float inf = std::numeric_limits<float>::infinity();
  w.cost.assign(T + 1, inf);
  w.cost2.resize(T + 1);
  w.choice.resize(static_cast<size_t>(R) * (T + 1));
  w.cost[0] = 0.f;
  for (int i = 0; i < R; ++i) {
    const float* ei = w.werr.data() + i * WIDTHS;
    uint8_t* ch = w.choice.data() + static_cast<size_t>(i) * (T + 1);
    const float* cost = w.cost.data();
    float* cost2 = w.cost2.data();
    int t = 0;
    auto scalar = [&](int t) {
      float best = inf;
      int arg = 0;
      for (int v = 0; v < WIDTHS && v <= t; ++v) {
        const float cand = cost[t - v] + ei[v];
        if (cand < best) {
          best = cand;
          arg = v;
        }
      }
      cost2[t] = best;
      ch[t] = static_cast<uint8_t>(arg);
    };
    for (; t < WIDTHS - 1 && t <= T; ++t) scalar(t);
#if defined(__AVX512F__)
    for (; t + 16 <= T + 1; t += 16) {  // the same comparisons, 16 totals at once
      __m512 best = _mm512_set1_ps(inf);
      __m512i arg = _mm512_setzero_si512();
      for (int v = 0; v < WIDTHS; ++v) {
        const __m512 cand = _mm512_add_ps(_mm512_loadu_ps(cost + t - v), _mm512_set1_ps(ei[v]));
        const __mmask16 lt = _mm512_cmp_ps_mask(cand, best, _CMP_LT_OQ);
        best = _mm512_mask_blend_ps(lt, best, cand);
        arg = _mm512_mask_blend_epi32(lt, arg, _mm512_set1_epi32(v));
      }
      _mm512_storeu_ps(cost2 + t, best);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ch + t), _mm512_cvtepi32_epi8(arg));
    }
#endif
    for (; t <= T; ++t) scalar(t);
    std::swap(w.cost, w.cost2);
  }
  for (int i = R - 1, t = T; i >= 0; --i) {
    w.width[i] = w.choice[static_cast<size_t>(i) * (T + 1) + t];
    t -= w.width[i];
  }
}

// Codes q [R][C] of rows at their widths (w.width) packed as kvarn.ops.widths.pack_rows: a 4-bit block (the 4-bit
// rows), a 2-bit block (the 3-bit rows' low bits, then the 2-bit rows), a 1-bit block (the 3-bit rows' high bit, then
// the 1-bit rows), each row part in the plane layout of kvarn.ops.packing; the widths 3 bits each.
void pack_widths(const Config& c, const Work& w, const uint8_t* q, Encoded& e) {
  const int R = c.R, C = c.C;
  constexpr int BLOCKS[5][3] = {{4, 4, 0}, {2, 3, 0}, {2, 2, 0}, {1, 3, 2}, {1, 1, 0}};  // bits, row width, shift
  uint8_t* out = e.codes.data();
  for (const auto& blk : BLOCKS)
    for (int r = 0; r < R; ++r)
      if (w.width[r] == blk[1]) {
        pack_planes(q + r * C, C, blk[0], blk[2], out);
        out += C * blk[0] / 8;
      }
  std::fill(out, e.codes.data() + e.codes.size(), 0);
  pack3(w.width.data(), R, e.wid.data());
}

// X [R][C] -> one encoding: B = X / s_c / s_r (VarN), RTN per row, a = s_r delta, z = s_r lo, t = s_c, packed codes.
// coef [R][R] (keys only; null: nearest rounding): the codes rounded query-aware instead (query_aware_rows). Row
// widths (c.widths): each row on the grid of its width (width_targets, gain: the rows' weights or null).
void encode_rows(const Config& c, const float* X, Work& w, Encoded& e, const float* coef = nullptr,
                 const float* gain = nullptr) {
  const int R = c.R, C = c.C, levels = (1 << c.bits) - 1;
  const float* B = X;
  if (c.varn) {
    varn(c, X, w);
    if (c.relative) {  // kvarn.quant.affine.relative_col_scales: t = e4m3(max(s_c / m, tiny)), s_r' = s_r m
      const float m = *std::max_element(w.bc.begin(), w.bc.end());
      for (int j = 0; j < C; ++j)
        w.bc[j] = static_cast<float>(c10::Float8_e4m3fn(std::max(w.bc[j] / m, E4M3_TINY)));
      for (int r = 0; r < R; ++r) w.br[r] = w.br[r] * m;
    }
    float* b = w.b.data();
    const float* bc = w.bc.data();
    for (int r = 0; r < R; ++r) {
      const float br = w.br[r];
#pragma omp simd
      for (int j = 0; j < C; ++j) b[r * C + j] = X[r * C + j] / bc[j] / br;
    }
    B = b;
    for (int j = 0; j < C; ++j) put(c.col_dt, e.col.data(), j, w.bc[j]);
  }
  if (c.widths) width_targets(c, B, gain, w);
  for (int r = 0; r < R; ++r) {
    const float* row = B + r * C;
    float lo, hi, delta, top = static_cast<float>(levels);
    if (c.widths) {
      const int v = w.width[r];
      lo = w.wlo[r * WIDTHS + v];
      delta = w.wdelta[r * WIDTHS + v];
      top = w.top[r] = static_cast<float>(v ? (1 << v) - 1 : 0);
    } else {
      row_range(row, C, lo, hi);
      if (c.clipped) clip_range(lo, hi, c.half_clip);
      delta = std::max((hi - lo) / static_cast<float>(levels), RANGE_GUARD);
    }
    const float s = c.varn ? w.br[r] : 1.f;
    const float a = c.varn ? delta * s : delta;
    if (coef) {  // the unrounded codes, as row_codes forms them
      float* ur = w.u.data() + r * C;
#pragma omp simd
      for (int j = 0; j < C; ++j) ur[j] = (row[j] - lo) / delta;
      w.step[r] = a;
    } else {
      row_codes(row, C, lo, delta, top, e.q.data() + r * C);
    }
    put(c.scale_dt, e.a.data(), r, a);
    put(c.zero_dt, e.z.data(), r, c.varn ? lo * s : lo);
  }
  if (coef) query_aware_rows(c, coef, w, e.q.data());
  if (c.widths) return pack_widths(c, w, e.q.data(), e);
  if (c.bits == 3) return pack3(e.q.data(), R * C, e.codes.data());
  for (int r = 0; r < R; ++r) pack_planes(e.q.data() + r * C, C, c.bits, 0, e.codes.data() + r * c.mb());
}

// w.rec [D][G] (channel-major) <- the tile stored by fields a, z, t (t null without VarN) and codes q unpacked [R][C]:
// rows (q a_r + z_r) t_c in float32, the reference's order (kvarn.quant.affine.decode_rows), transposed back for
// values, rotated back by the butterfly where asked (decode_tiles with dense=False).
void decode_rec(const Config& c, const uint8_t* qs, const char* a, const char* z, const char* t, bool rotated,
                Work& w) {
  const int R = c.R, C = c.C, G = c.G, D = c.D;
  float* rec = w.rec.data();
  float* tf = w.tf.data();  // the stored fields as float32, once (get() per element does not vectorize)
  for (int j = 0; j < C; ++j) tf[j] = t ? get(c.col_dt, t, j) : 1.f;
  // decoded rows [R][C]: for keys (rows = channels) that is rec itself, for values the rows are transposed after
  float* dec = c.channel ? rec : w.dec.data();
  for (int r = 0; r < R; ++r) {
    const float ar = get(c.scale_dt, a, r), zr = get(c.zero_dt, z, r);
    const uint8_t* q = qs + r * C;
    float* out = dec + r * C;
    if (t) {
#pragma omp simd
      for (int j = 0; j < C; ++j) out[j] = (static_cast<float>(q[j]) * ar + zr) * tf[j];
    } else {
#pragma omp simd
      for (int j = 0; j < C; ++j) out[j] = static_cast<float>(q[j]) * ar + zr;
    }
  }
  if (!c.channel)  // [G][D] -> [D][G]
    for (int d = 0; d < D; ++d)
#pragma omp simd
      for (int g = 0; g < G; ++g) rec[d * G + g] = dec[g * D + d];
  if (rotated) fwht_rows(rec, D, G);
}

// sum_{g, d} weight_d (x^[g, d] - x[g, d])^2 of one encoding, x^ decoded from its stored fields and rotated back
// (kvarn.quant.policy.weighted_error; x0t the unrotated tile channel-major [D][G], weight [D] or null = 1).
double weighted_error(const Config& c, const Encoded& e, bool rotated, const float* x0t, const float* weight,
                      Work& w) {
  const int G = c.G, D = c.D;
  decode_rec(c, e.q.data(), e.a.data(), e.z.data(), c.varn ? e.col.data() : nullptr, rotated, w);
  const float* rec = w.rec.data();
  double total = 0.0;
  for (int d = 0; d < D; ++d) {
    double part = 0.0;
#pragma omp simd reduction(+ : part)
    for (int g = 0; g < G; ++g) {
      const double diff = static_cast<double>(rec[d * G + g]) - x0t[d * G + g];
      part += diff * diff;
    }
    total += (weight ? weight[d] : 1.0) * part;
  }
  return total;
}

struct Out {
  uint8_t *codes, *rot, *wid;
  bool *finite_in, *finite_out;
  char *a, *z, *col;
};

void emit(const Config& c, const Encoded& e, const Out& o, int64_t n) {
  const int sa = item_size(c.scale_dt), sz = item_size(c.zero_dt), sc = item_size(c.col_dt);
  std::memcpy(o.codes + n * c.code_bytes(), e.codes.data(), e.codes.size());
  if (o.wid) std::memcpy(o.wid + n * e.wid.size(), e.wid.data(), e.wid.size());
  std::memcpy(o.a + n * c.R * sa, e.a.data(), e.a.size());
  std::memcpy(o.z + n * c.R * sz, e.z.data(), e.z.size());
  if (o.col) std::memcpy(o.col + n * c.C * sc, e.col.data(), e.col.size());
}

// tile n of x [N][G][D] (float32/fp16/bf16, strided) as float32, channel-major [D][G]. Returns whether it is finite; a tile
// that is not is replaced by zeros (what the cache encodes in place of a tile it keeps exact).
bool load_tile(const at::Tensor& x, int64_t n, int G, int D, float* out) {
  const int64_t base = n * x.stride(0), sg = x.stride(1), sd = x.stride(2);  // any strides: no copy of a slice
  float probe = 0.f;  // v - v is 0 for a finite v and NaN for inf or NaN
  auto fill = [&](auto* p) {
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) {
        const float v = static_cast<float>(p[base + g * sg + d * sd]);
        out[d * G + g] = v;
        probe += v - v;
      }
  };
  switch (x.scalar_type()) {
    case at::kFloat: fill(x.data_ptr<float>()); break;
    case at::kHalf: fill(x.data_ptr<c10::Half>()); break;
    default: fill(x.data_ptr<c10::BFloat16>());
  }
  if (probe == 0.f) return true;
  std::fill(out, out + G * D, 0.f);
  return false;
}

// every stored scale of an encoding is finite (fp16 overflows to inf, e4m3 to NaN)
bool fields_finite(const Config& c, const Encoded& e) {
  float probe = 0.f;
  for (int r = 0; r < c.R; ++r) {
    const float a = get(c.scale_dt, e.a.data(), r), z = get(c.zero_dt, e.z.data(), r);
    probe += (a - a) + (z - z);
  }
  if (c.varn)
    for (int j = 0; j < c.C; ++j) {
      const float t = get(c.col_dt, e.col.data(), j);
      probe += t - t;
    }
  return probe == 0.f;
}

// one tile, channel-major x0t [D][G] float32 -> X in the quantization layout (rotated along D when asked; values
// rotate in `scratch` [D][G] first)
void to_rows(const Config& c, const float* x0t, bool rotate, float* X, float* scratch) {
  const int G = c.G, D = c.D;
  if (c.channel) {
    std::memcpy(X, x0t, G * D * 4);
    if (rotate) fwht_rows(X, D, G);
    return;
  }
  const float* src = x0t;
  if (rotate) {
    std::memcpy(scratch, x0t, G * D * 4);
    fwht_rows(scratch, D, G);
    src = scratch;
  }
  for (int d = 0; d < D; ++d)
    for (int g = 0; g < G; ++g) X[g * D + d] = src[d * G + g];
}


// Query-aware rounding's coefficients (kvarn.ops.rtn.query_aware_bases, the same steps in float64; LAPACK's
// factorisation sums in another order, so they agree to rounding, not bit for bit). A [D][D] holds Sigma in the
// basis; V upper with V V^T = A', filled from the last column: its pivot, the column over it, then the leading
// block's lower triangle less that column's outer product (row axpys). False where A' is not positive definite.
bool reverse_cholesky(double* A, double* V, double* v, int D) {
  std::fill(V, V + D * D, 0.0);
  double* w = v + D;  // the second column of a pair
  int j = D - 1;
  for (; j >= 1; j -= 2) {  // columns j and j - 1, then one pass over the leading block for both
    const double* aj = A + j * D;
    if (!(aj[j] > 0.0)) return false;
    const double p = std::sqrt(aj[j]);
    for (int i = 0; i < j; ++i) v[i] = aj[i] / p;
    v[j] = p;
    double* ak = A + (j - 1) * D;
    for (int i = 0; i < j; ++i) ak[i] = ak[i] - v[j - 1] * v[i];
    if (!(ak[j - 1] > 0.0)) return false;
    const double q = std::sqrt(ak[j - 1]);
    for (int i = 0; i < j - 1; ++i) w[i] = ak[i] / q;
    w[j - 1] = q;
    for (int i = 0; i <= j; ++i) V[i * D + j] = v[i];
    for (int i = 0; i < j; ++i) V[i * D + j - 1] = w[i];
    for (int i = 0; i < j - 1; ++i) {
      double* ai = A + i * D;
      const double vi = v[i], wi = w[i];
#pragma omp simd
      for (int k = 0; k <= i; ++k) ai[k] = ai[k] - vi * v[k] - wi * w[k];
    }
  }
  if (j == 0) {
    if (!(A[0] > 0.0)) return false;
    V[0] = std::sqrt(A[0]);
  }
  return true;
}

// One basis: S [D][D] (Sigma, float64, overwritten) -> C [D][D] float32, C_rj = V_rj / V_jj; the identity where Sigma
// is not finite or Sigma + 10 damp mean(diag) I is still not positive definite.
void coefficients_of(double* S, double damp, float* C, double* A, double* V, double* v, int D) {
  int finite = 1;
  for (int k = 0; k < D * D; ++k) finite &= static_cast<int>(std::isfinite(S[k]));
  bool ok = finite != 0;
  if (ok) {
    double mean = 0.0;
    for (int i = 0; i < D; ++i) {
      for (int j = 0; j < i; ++j) S[i * D + j] = S[j * D + i] = (S[i * D + j] + S[j * D + i]) * 0.5;
      mean += S[i * D + i];
    }
    mean = std::max(mean / D, 1e-30);
    ok = false;
    for (const double f : {damp, 10 * damp}) {
      std::copy(S, S + D * D, A);
      for (int i = 0; i < D; ++i) A[i * D + i] += f * mean;
      if ((ok = reverse_cholesky(A, V, v, D))) break;
    }
  }
  std::fill(C, C + D * D, 0.f);
  if (!ok) {
    for (int r = 0; r < D; ++r) C[r * D + r] = 1.f;
    return;
  }
  for (int j = 0; j < D; ++j) v[j] = V[j * D + j];
  for (int r = 0; r < D; ++r) {
    const double* vr = V + r * D;
    float* cr = C + r * D;
#pragma omp simd
    for (int j = r; j < D; ++j) cr[j] = static_cast<float>(vr[j] / v[j]);
  }
}


}  // namespace

// x [N][G][D] float32/fp16/bf16, any strides; weight [N][D] float32 (rotate = auto, weighted) or empty; coef
// [N][B][D][D] float32 (keys: query-aware rounding; B = 2 for rotate = auto, the rotated basis first, else 1) or empty.
// Returns codes [N][R][C*bits/8] uint8, row_scale and row_zero [N][R] (scale dtype; the zero fp16 for 8-bit scales), col_scale [N][C] (col dtype;
// undefined without VarN), rotated [N] uint8 (undefined unless rotate = auto), two [N] bool flags: the input tile
// was finite (else it was encoded as zeros), every stored scale is finite; and with row widths (widths > 0: keys,
// bits 4) codes [N][widths*C/8] and the widths [N][3R/8] uint8 last (undefined without), weight [N][D] then also the
// rows' weights of the plain basis.
std::vector<at::Tensor> store_tiles(const at::Tensor& x, const at::Tensor& weight, int64_t bits, bool channel,
                                    int64_t rotate, bool use_varn, int64_t iters, int64_t scale_dt, int64_t col_dt,
                                    bool relative, const at::Tensor& coef, double clip, int64_t widths) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu(), "kvarn store: x must be [N, G, D] on the CPU");
  TORCH_CHECK(clip > 0.0 && clip <= 1.0, "kvarn store: clip must be in (0, 1]");
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8, "kvarn store: bits must be 1, 2, 3, 4 or 8");
  Config c;
  const int64_t N = x.size(0);
  c.G = static_cast<int>(x.size(1));
  c.D = static_cast<int>(x.size(2));
  c.channel = channel;
  c.R = channel ? c.D : c.G;
  c.C = channel ? c.G : c.D;
  c.bits = static_cast<int>(bits);
  c.rotate = static_cast<int>(rotate);
  c.iters = static_cast<int>(iters);
  c.varn = use_varn;
  c.relative = relative && use_varn;
  c.scale_dt = static_cast<int>(scale_dt);
  c.zero_dt = c.scale_dt == E4M3 ? F16 : c.scale_dt;
  c.col_dt = static_cast<int>(col_dt);
  c.weighted = weight.numel() > 0;
  c.clipped = clip < 1.0;
  c.half_clip = static_cast<float>(0.5 * clip);
  c.widths = static_cast<int>(widths);
  TORCH_CHECK(widths == 0 || (channel && use_varn && bits == 4 && c.R % 8 == 0 && c.C % 8 == 0 && widths > 0 &&
                              widths <= 4 * c.R),
              "kvarn store: row widths are for keys with VarN at bits 4, rows and columns multiples of 8, 1..4 R bits");
  const int nb = c.rotate == 2 ? 2 : 1;
  TORCH_CHECK(coef.numel() == 0 || (channel && coef.scalar_type() == at::kFloat && coef.is_contiguous() &&
                                    coef.dim() == 4 && coef.size(0) == N && coef.size(1) == nb &&
                                    coef.size(2) == c.D && coef.size(3) == c.D),
              "kvarn store: coef must be float32 [N, ", nb, ", D, D] contiguous, for keys");
  const float* cp = coef.numel() ? coef.data_ptr<float>() : nullptr;
  const int64_t dd = static_cast<int64_t>(c.D) * c.D;
  TORCH_CHECK(c.C % (c.bits == 3 ? 8 : 8 / c.bits) == 0, "kvarn store: columns must fill whole bytes");
  TORCH_CHECK(!c.varn || (c.R >= 2 && c.C >= 2), "kvarn store: VarN needs rows and columns >= 2");
  TORCH_CHECK(!c.weighted || (weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                              weight.size(0) == N && weight.size(1) == c.D),
              "kvarn store: weight must be float32 [N, D] contiguous");
  auto u8 = x.options().dtype(at::kByte);
  at::Tensor codes = c.widths ? at::empty({N, c.code_bytes()}, u8) : at::empty({N, c.R, c.mb()}, u8);
  at::Tensor wid = c.widths ? at::empty({N, c.R * 3 / 8}, u8) : at::Tensor();
  at::Tensor a = at::empty({N, c.R}, x.options().dtype(scalar_type(c.scale_dt)));
  at::Tensor z = at::empty({N, c.R}, x.options().dtype(scalar_type(c.zero_dt)));
  at::Tensor col = c.varn ? at::empty({N, c.C}, x.options().dtype(scalar_type(c.col_dt))) : at::Tensor();
  at::Tensor rot = c.rotate == 2 ? at::empty({N}, u8) : at::Tensor();
  at::Tensor fin = at::empty({N}, x.options().dtype(at::kBool)), fout = at::empty({N}, x.options().dtype(at::kBool));
  Out o{codes.data_ptr<uint8_t>(), c.rotate == 2 ? rot.data_ptr<uint8_t>() : nullptr,
        c.widths ? wid.data_ptr<uint8_t>() : nullptr, fin.data_ptr<bool>(),
        fout.data_ptr<bool>(),
        static_cast<char*>(a.data_ptr()), static_cast<char*>(z.data_ptr()),
        c.varn ? static_cast<char*>(col.data_ptr()) : nullptr};
  const float* wp = c.weighted ? weight.data_ptr<float>() : nullptr;

  if (c.rotate != 2) {
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      Work& w = work_for(c);
      Encoded e(c);
      for (int64_t n = begin; n < end; ++n) {
        o.finite_in[n] = load_tile(x, n, c.G, c.D, w.x0.data());
        to_rows(c, w.x0.data(), c.rotate == 1, w.x.data(), w.rec.data());
        encode_rows(c, w.x.data(), w, e, cp ? cp + n * dd : nullptr,
                    wp && c.rotate == 0 ? wp + n * c.D : nullptr);  // widths: the weight of the plain basis
        emit(c, e, o, n);
        o.finite_out[n] = fields_finite(c, e);
      }
    });
    return {codes, a, z, col, rot, fin, fout, wid};
  }
  // rotate = auto: one work item per tile and basis (item 2 n: rotated, 2 n + 1: as it is), so that even a single
  // tile keeps two threads busy; then the choice per tile (kvarn.quant.policy: the rotation where strictly lower)
  std::vector<Encoded> enc(2 * N, Encoded(c));
  std::vector<double> err(2 * N);
  at::parallel_for(0, 2 * N, 1, [&](int64_t begin, int64_t end) {
    Work& w = work_for(c);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / 2;
      const bool rotated = i % 2 == 0;
      const bool finite = load_tile(x, n, c.G, c.D, w.x0.data());
      if (rotated) o.finite_in[n] = finite;
      to_rows(c, w.x0.data(), rotated, w.x.data(), w.rec.data());
      encode_rows(c, w.x.data(), w, enc[i], cp ? cp + i * dd : nullptr,  // item i = basis i % 2 of tile n
                  wp && !rotated ? wp + n * c.D : nullptr);
      err[i] = weighted_error(c, enc[i], rotated, w.x0.data(), wp ? wp + n * c.D : nullptr, w);
    }
  });
  for (int64_t n = 0; n < N; ++n) {
    const bool keep = err[2 * n] < err[2 * n + 1];
    const Encoded& e = enc[2 * n + (keep ? 0 : 1)];
    emit(c, e, o, n);
    o.finite_out[n] = fields_finite(c, e);
    o.rot[n] = keep ? 1 : 0;
  }
  return {codes, a, z, col, rot, fin, fout, wid};
}

// sigma [N][D][D] float32 contiguous (E[q q^T] per tile, plain basis) -> coef [N][B][D][D] float32, B = 2 for rotate =
// auto (H Sigma H first, then Sigma), else 1 (hadamard: H Sigma H; none: Sigma). A run of equal matrices is computed
// once (a cache hands one copy per tile of a KV head).
at::Tensor query_aware_coefficients(const at::Tensor& sigma, int64_t rotate, double damp) {
  TORCH_CHECK(sigma.dim() == 3 && sigma.size(1) == sigma.size(2) && sigma.scalar_type() == at::kFloat &&
                  sigma.is_contiguous(),
              "kvarn coefficients: sigma must be float32 [N, D, D] contiguous");
  TORCH_CHECK(rotate >= 0 && rotate <= 2, "kvarn coefficients: rotate must be 0, 1 or 2");
  const int64_t N = sigma.size(0);
  const int D = static_cast<int>(sigma.size(1));
  std::vector<bool> bases;
  if (rotate != 0) bases.push_back(true);
  if (rotate != 1) bases.push_back(false);
  const int B = static_cast<int>(bases.size());
  at::Tensor out = at::empty({N, B, D, D}, sigma.options());
  const float* sp = sigma.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t dd = static_cast<int64_t>(D) * D;
  std::vector<int64_t> first;  // the first tile of each run of equal matrices
  for (int64_t n = 0; n < N; ++n)
    if (n == 0 || std::memcmp(sp + n * dd, sp + (n - 1) * dd, dd * sizeof(float)) != 0) first.push_back(n);
  const int64_t jobs = static_cast<int64_t>(first.size()) * B;
  at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> S(dd), T(dd), A(dd), V(dd), v(2 * D);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t n = first[job / B];
      const int b = static_cast<int>(job % B);
      for (int64_t k = 0; k < dd; ++k) S[k] = sp[n * dd + k];
      if (bases[b]) {  // H Sigma H: rows mixed (H Sigma), transposed (Sigma H, Sigma symmetric), rows mixed again
        fwht_rows(S.data(), D, D);
        for (int i = 0; i < D; ++i)
          for (int j = 0; j < D; ++j) T[j * D + i] = S[i * D + j];
        fwht_rows(T.data(), D, D);
        std::swap(S, T);
      }
      coefficients_of(S.data(), damp, op + (n * B + b) * dd, A.data(), V.data(), v.data(), D);
    }
  });
  for (size_t k = 0; k < first.size(); ++k) {  // the rest of each run: copies of its first
    const int64_t stop = k + 1 < first.size() ? first[k + 1] : N;
    for (int64_t n = first[k] + 1; n < stop; ++n) std::memcpy(op + n * B * dd, op + first[k] * B * dd, B * dd * 4);
  }
  return out;
}

// AffineQuantizer fields of N tiles (codes [N][R][C b / 8], row scales and zeros [N][R], VarN column scales [N][C] or
// empty, rotation flags [N] or empty: contiguous) -> token-major tiles [N][G][D] in out_dt (kvarn.ops.codes'
// DTYPE_CODES), bit for bit what decode_tiles(dense=False) computes (kvarn.quant.affine; `decode_rec` above).
at::Tensor tile_decode(const at::Tensor& codes, const at::Tensor& a, const at::Tensor& z, const at::Tensor& col,
                       const at::Tensor& rot, int64_t bits, bool channel, int64_t rotate, int64_t tile, int64_t out_dt) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && a.is_contiguous() &&
                  z.is_contiguous() && (col.numel() == 0 || col.is_contiguous()) &&
                  (rot.numel() == 0 || (rot.is_contiguous() && rot.scalar_type() == at::kByte)),
              "kvarn decode: fields must be contiguous, codes uint8 [N, R, C b / 8]");
  TORCH_CHECK(out_dt == F32 || out_dt == F16 || out_dt == BF16, "kvarn decode: output dtype code ", out_dt,
              " (float32, fp16 or bf16)");
  const int64_t N = codes.size(0);
  Config c{};
  c.G = static_cast<int>(tile);
  c.R = static_cast<int>(codes.size(1));
  c.bits = static_cast<int>(bits);
  c.C = static_cast<int>(codes.size(2) * 8 / bits);
  c.D = channel ? c.R : c.C;
  c.channel = channel;
  TORCH_CHECK((channel ? c.C : c.R) == c.G, "kvarn decode: ", c.R, " rows of ", c.C, " codes are not tiles of ", tile,
              " tokens");
  c.scale_dt = dtype_code(a);
  c.zero_dt = dtype_code(z);
  c.varn = col.numel() > 0;
  c.col_dt = c.varn ? dtype_code(col) : F32;
  TORCH_CHECK(a.numel() == N * c.R && z.numel() == N * c.R && (!c.varn || col.numel() == N * c.C) &&
                  (rotate != 2 || rot.numel() == N),
              "kvarn decode: field sizes do not match ", N, " tiles");
  at::Tensor out = at::empty({N, c.G, c.D}, codes.options().dtype(scalar_type(static_cast<int>(out_dt))));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const char *ap = static_cast<const char*>(a.data_ptr()), *zp = static_cast<const char*>(z.data_ptr());
  const char* tp = c.varn ? static_cast<const char*>(col.data_ptr()) : nullptr;
  const uint8_t* rp = rotate == 2 ? rot.data_ptr<uint8_t>() : nullptr;
  auto run = [&](auto* op) {
    using O = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      Work& w = work_for(c);
      thread_local std::vector<uint8_t> qs;
      qs.resize(static_cast<size_t>(c.R) * c.C);
      for (int64_t n = begin; n < end; ++n) {
        unpack_codes(cp + n * c.R * c.mb(), c.R, c.C, c.bits, qs.data());
        decode_rec(c, qs.data(), ap + n * c.R * item_size(c.scale_dt), zp + n * c.R * item_size(c.zero_dt),
                   tp ? tp + n * c.C * item_size(c.col_dt) : nullptr, rotate == 1 || (rotate == 2 && rp[n]), w);
        auto* out = op + n * c.G * c.D;  // [G][D]: rec transposed, cast once
        for (int g = 0; g < c.G; ++g)
          for (int d = 0; d < c.D; ++d) out[g * c.D + d] = static_cast<O>(w.rec[static_cast<size_t>(d) * c.G + g]);
      }
    });
  };
  switch (out_dt) {  // the cast: float32 as it is, fp16 / bf16 rounded to nearest even (torch's .to())
    case F32: run(out.data_ptr<float>()); break;
    case F16: run(out.data_ptr<c10::Half>()); break;
    default: run(out.data_ptr<c10::BFloat16>());
  }
  return out;
}
