// Linear layers with low-precision weights on CPU: y[M, N] = x[M, K] . W^T (+ bias), x and y float32,
// W stored as bfloat16 or as int8 with one float32 scale per output row (weight-only quantization).
//
// Why: a decode step is one pass over the weights, so its time is their size over the memory
// bandwidth: bf16 halves the bytes of the fp32 weights, int8 quarters them (docs/design.md,
// "Precision and devices"). Same structure as small_m_linear.cpp (panels of NR = 96 output columns,
// outer-product tiles of MR = 4 rows x 96 columns in 24 AVX-512 accumulators, k blocks of 24 KiB
// reused from L1 by every row tile while the next block is prefetched spread over the tiles,
// panels split over torch's pool), with these weight layouts:
//
// * bf16: panels[P][K2][96][2] (K2 = ceil(K / 2), odd K zero-padded): the two k of a pair side by
//   side per column. linear_bf16f (what the engine uses) loads 16 such pairs per vector and widens
//   them to float32 in registers, exactly: w[k] is the 32-bit lane shifted left by 16, w[k+1] the
//   lane with its low half cleared; then the fp32 kernel's FMAs with x in float32 (not rounded).
//   linear_bf16 uses the same panels as the operand layout of AVX512-BF16's _mm512_dpbf16_ps
//   (acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1], float32 accumulation; x rounded to bf16 once per
//   call, each row's k pair broadcast as one 32-bit value): half the instructions, but on the
//   benchmark Xeon no faster at 1-2 rows and 1.4-1.5x slower from 8 rows (cpu_linear.py,
//   BF16_DOT_PRODUCTS). Both read half the bytes of the fp32 kernel. Without AVX512-BF16
//   linear_bf16 is a plain loop; the avx2 build (csrc/avx2_tile.h) runs linear_bf16f's widening
//   and FMAs 8 columns per vector in 24-column strips, with neither AVX2 nor AVX-512 both are loops.
// * int8: panels[P][K][96] int8 and scales[P * 96]: each k loads 6 x 16 bytes, widens them to
//   float32 in registers (vpmovsxbd + vcvtdq2ps) and does the same FMAs as the fp32 kernel with x
//   kept in float32; the per-row scale multiplies the accumulators once, at the end (the avx2
//   build: 8 bytes per vector, the same sums).
//
// Results: bf16 x bf16 (and fp32 x bf16) products are exact in float32, so the only rounding beyond
// fp32 summation order is that of W (and, in linear_bf16, x) to bf16, relative ~2^-9 each; int8 is
// exact given its dequantized weight.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "avx2_tile.h"
#include "cpu_check.h"

#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 96;      // columns per panel: 6 AVX-512 vectors of float32 accumulators
constexpr int64_t MR = 4;       // rows per register tile
constexpr int64_t KB_BF16 = 128;  // k per block: 64 pairs x 96 x 2 x 2 bytes = 24 KiB
constexpr int64_t KB_I8 = 256;    // k per block: 256 x 96 bytes = 24 KiB

inline uint16_t to_bf16(float f) {  // round to nearest even; inputs are finite activations
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void masks(int64_t ncols, uint16_t (&m)[6]) {
  for (int v = 0; v < 6; ++v) {
    int64_t left = ncols - 16 * v;
    m[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<uint16_t>((1u << left) - 1);
  }
}

// x [M, K] float32 -> [M, K2] pairs of bf16 (low half = even k), odd K padded with zero.
void pack_x_bf16(const float* x, int64_t M, int64_t K, uint32_t* out) {
  const int64_t K2 = (K + 1) / 2;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      uint16_t* o = reinterpret_cast<uint16_t*>(out + m * K2);
      int64_t k = 0;
#ifdef __AVX512BF16__
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
#endif
      for (; k < K; ++k) o[k] = to_bf16(xr[k]);
      if (K & 1) o[K] = 0;
    }
  });
}

#ifdef __AVX512BF16__
template <int R>
inline void tile_bf16(const uint32_t* __restrict x, int64_t ldx, const uint16_t* __restrict panel, int64_t K2,
                      float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, bool first,
                      const char* pf, int64_t pf_lines) {
  __m512 acc[R][6];
  uint16_t mk[6];
  masks(ncols, mk);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 6; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[v], y + r * ldy + 16 * v);
  int64_t line = 0;
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* w = panel + k * NR * 2;
    if (pf) {
      const int64_t upto = (k + 1) * pf_lines / K2;
      for (; line < upto; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
    }
    __m512bh wv[6];
    for (int v = 0; v < 6; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      for (int v = 0; v < 6; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  for (int v = 0; v < 6; ++v) {
    if (!mk[v]) break;
    __m512 b = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], _mm512_add_ps(acc[r][v], b));
  }
}
#else
template <int R>
inline void tile_bf16(const uint32_t* __restrict x, int64_t ldx, const uint16_t* __restrict panel, int64_t K2,
                      float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, bool first,
                      const char*, int64_t) {
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = (first || c >= ncols) ? 0.f : y[r * ldy + c];
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* w = panel + k * NR * 2;
    for (int r = 0; r < R; ++r) {
      const uint32_t xp = x[r * ldx + k];
      const float x0 = from_bf16(static_cast<uint16_t>(xp)), x1 = from_bf16(static_cast<uint16_t>(xp >> 16));
      for (int64_t c = 0; c < NR; ++c) acc[r][c] += x0 * from_bf16(w[2 * c]) + x1 * from_bf16(w[2 * c + 1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.f);
}
#endif

#ifdef __AVX512F__
// The same bf16 panels with float32 x and FMAs: each 32-bit lane of a loaded vector holds column
// c's pair (w[k], w[k+1]); w[k] as float32 is the lane shifted left by 16, w[k+1] the lane with its
// low half cleared, both exact. Twice the FMAs of a dot-product instruction per k pair but each at
// the FMA units' full rate; x is not rounded.
template <int R>
inline void tile_bf16f(const float* __restrict x, int64_t ldx, const uint16_t* __restrict panel, int64_t K2,
                       float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, bool first,
                       const char* pf, int64_t pf_lines) {
  __m512 acc[R][6];
  uint16_t mk[6];
  masks(ncols, mk);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 6; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[v], y + r * ldy + 16 * v);
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t line = 0;
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* w = panel + k * NR * 2;
    if (pf) {
      const int64_t upto = (k + 1) * pf_lines / K2;
      for (; line < upto; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
    }
    for (int v = 0; v < 6; ++v) {
      const __m512i raw = _mm512_loadu_si512(w + 32 * v);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * k]), we, acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * k + 1]), wo, acc[r][v]);
      }
    }
  }
  for (int v = 0; v < 6; ++v) {
    if (!mk[v]) break;
    __m512 b = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], _mm512_add_ps(acc[r][v], b));
  }
}
#elif defined(LOCKGATE_AVX2)
// The avx2 build's form: the same widening (8 columns' pairs per 256-bit load), in 24-column strips.
template <int R>
inline void tile_bf16f(const float* __restrict x, int64_t ldx, const uint16_t* __restrict panel, int64_t K2,
                       float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, bool first,
                       const char* pf, int64_t pf_lines) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  avx2::tile96<R>(K2, y, ldy, ncols, first, nullptr, bias, pf, pf_lines,
                  [&](__m256 (&acc)[R][3], int64_t k, int64_t c0) {
                    const uint16_t* w = panel + k * NR * 2 + 2 * c0;
                    for (int v = 0; v < 3; ++v) {
                      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
                      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
                      for (int r = 0; r < R; ++r) {
                        acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + 2 * k]), we, acc[r][v]);
                        acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + 2 * k + 1]), wo, acc[r][v]);
                      }
                    }
                  });
}
#else
template <int R>
inline void tile_bf16f(const float* __restrict x, int64_t ldx, const uint16_t* __restrict panel, int64_t K2,
                       float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias, bool first,
                       const char*, int64_t) {
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = (first || c >= ncols) ? 0.f : y[r * ldy + c];
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* w = panel + k * NR * 2;
    for (int r = 0; r < R; ++r) {
      const float x0 = x[r * ldx + 2 * k], x1 = x[r * ldx + 2 * k + 1];
      for (int64_t c = 0; c < NR; ++c) acc[r][c] += x0 * from_bf16(w[2 * c]) + x1 * from_bf16(w[2 * c + 1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.f);
}

#endif

#ifdef __AVX512F__
template <int R>
inline void tile_i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict panel, int64_t K,
                    float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict scale,
                    const float* __restrict bias, bool first, const char* pf, int64_t pf_lines) {
  __m512 acc[R][6];
  uint16_t mk[6];
  masks(ncols, mk);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 6; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[v], y + r * ldy + 16 * v);
  int64_t line = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* w = panel + k * NR;
    if (pf) {
      const int64_t upto = (k + 1) * pf_lines / K;
      for (; line < upto; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
    }
    __m512 wv[6];
    for (int v = 0; v < 6; ++v)
      wv[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * v))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < 6; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  if (scale) {  // last k block: scale, add the bias
    for (int v = 0; v < 6; ++v) {
      if (!mk[v]) break;
      const __m512 s = _mm512_maskz_loadu_ps(mk[v], scale + 16 * v);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], _mm512_fmadd_ps(acc[r][v], s, b));
    }
  } else {
    for (int v = 0; v < 6; ++v) {
      if (!mk[v]) break;
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], acc[r][v]);
    }
  }
}
#elif defined(LOCKGATE_AVX2)
// The avx2 build's form: 8 int8 weights per vector widened (vpmovsxbd + vcvtdq2ps), 24-column strips.
template <int R>
inline void tile_i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict panel, int64_t K,
                    float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict scale,
                    const float* __restrict bias, bool first, const char* pf, int64_t pf_lines) {
  avx2::tile96<R>(K, y, ldy, ncols, first, scale, scale ? bias : nullptr, pf, pf_lines,
                  [&](__m256 (&acc)[R][3], int64_t k, int64_t c0) {
                    const int8_t* w = panel + k * NR + c0;
                    __m256 wv[3];
                    for (int v = 0; v < 3; ++v)
                      wv[v] = _mm256_cvtepi32_ps(
                          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * v))));
                    for (int r = 0; r < R; ++r) {
                      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
                      for (int v = 0; v < 3; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
                    }
                  });
}
#else
template <int R>
inline void tile_i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict panel, int64_t K,
                    float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict scale,
                    const float* __restrict bias, bool first, const char*, int64_t) {
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = (first || c >= ncols) ? 0.f : y[r * ldy + c];
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* w = panel + k * NR;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t c = 0; c < NR; ++c) acc[r][c] += xv * static_cast<float>(w[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c)
      y[r * ldy + c] = scale ? acc[r][c] * scale[c] + (bias ? bias[c] : 0.f) : acc[r][c];
}
#endif

// The panel/k-block/row-tile walk both kernels share. ``step(panel, kb, kn, tile rows, m0, pf,
// lines, first, last)`` runs one row tile over one k block; ``elem`` = bytes per k of a panel.
template <class Step>
void walk(int64_t M, int64_t K, int64_t P, int64_t KB, int64_t panel_bytes_per_k, const char* wp, Step step) {
  const int64_t tiles = (M + MR - 1) / MR;
  const int64_t block_bytes = KB * panel_bytes_per_k;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    const char* end = wp + p1 * K * panel_bytes_per_k;  // this thread's panels end here
    for (int64_t p = p0; p < p1; ++p) {
      const char* panel = wp + p * K * panel_bytes_per_k;
      for (int64_t kb = 0; kb < K; kb += KB) {
        const int64_t kn = std::min<int64_t>(KB, K - kb);
        const char* next = panel + (kb + kn) * panel_bytes_per_k;
        const int64_t lines = next + block_bytes <= end ? block_bytes / 64 : 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t l0 = t * lines / tiles, l1 = (t + 1) * lines / tiles;
          step(p, kb, kn, std::min<int64_t>(MR, M - t * MR), t * MR, lines ? next + 64 * l0 : nullptr, l1 - l0,
               kb == 0, kb + kn == K);
        }
      }
    }
  });
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == n, "bias must be float32 [N]");
  return keep.data_ptr<float>();
}

}  // namespace

bool bf16_native() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// W [N, K] (any float dtype) -> bf16 panels [P, K2, 96, 2], zero-padded past N and K.
at::Tensor pack_bf16(at::Tensor w) {
  check_cpu("w", w);
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "weight must be a 2-D floating-point tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR, K2 = (K + 1) / 2;
  auto padded = at::zeros({P * NR, K2 * 2}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({P, NR, K2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] float32 contiguous, panels from pack_bf16, n = the weight's real N; bias [N] or None.
at::Tensor linear_bf16(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "panels", panels, "bias", bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == 2 && panels.scalar_type() == at::kBFloat16 &&
              panels.is_contiguous(), "panels must come from pack_bf16");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2 = panels.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "x has ", K, " features, the weight ", 2 * K2, " (padded)");
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "n=", n, " does not match ", P, " panels");
  at::Tensor keep;
  const float* b = bias_ptr(bias, n, keep);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  std::vector<uint32_t> xb(static_cast<size_t>(M * K2));
  pack_x_bf16(x.data_ptr<float>(), M, K, xb.data());
  const uint32_t* xp = xb.data();
  const auto* wp = reinterpret_cast<const char*>(panels.data_ptr());
  float* yp = y.data_ptr<float>();
  // walk() in k pairs: one "k" of the walk is one pair (NR * 2 bf16 = 384 bytes of panel)
  walk(M, K2, P, KB_BF16 / 2, NR * 2 * 2, wp,
       [&](int64_t p, int64_t kb, int64_t kn, int64_t rows, int64_t m0, const char* pf, int64_t lines, bool first,
           bool last) {
         const auto* block = reinterpret_cast<const uint16_t*>(wp + (p * K2 + kb) * NR * 4);
         const int64_t c0 = p * NR, ncols = std::min<int64_t>(NR, n - c0);
         const uint32_t* xr = xp + m0 * K2 + kb;
         float* yr = yp + m0 * n + c0;
         const float* pb = (b && last) ? b + c0 : nullptr;
         switch (rows) {
           case 4: tile_bf16<4>(xr, K2, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           case 3: tile_bf16<3>(xr, K2, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           case 2: tile_bf16<2>(xr, K2, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           default: tile_bf16<1>(xr, K2, block, kn, yr, n, ncols, pb, first, pf, lines); break;
         }
       });
  return y;
}

// As linear_bf16, x kept in float32 (no rounding) and FMAs instead of dot products (tile_bf16f).
at::Tensor linear_bf16f(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "panels", panels, "bias", bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == 2 && panels.scalar_type() == at::kBFloat16 &&
              panels.is_contiguous(), "panels must come from pack_bf16");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2 = panels.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "x has ", K, " features, the weight ", 2 * K2, " (padded)");
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "n=", n, " does not match ", P, " panels");
  at::Tensor keep;
  const float* b = bias_ptr(bias, n, keep);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  at::Tensor xpad = x;  // odd K: one zero column, so every k pair of x exists
  if (K & 1) {
    xpad = at::zeros({M, K + 1}, x.options());
    xpad.narrow(1, 0, K).copy_(x);
  }
  const int64_t ldx = 2 * K2;
  const float* xp = xpad.data_ptr<float>();
  const auto* wp = reinterpret_cast<const char*>(panels.data_ptr());
  float* yp = y.data_ptr<float>();
  walk(M, K2, P, KB_BF16 / 2, NR * 2 * 2, wp,
       [&](int64_t p, int64_t kb, int64_t kn, int64_t rows, int64_t m0, const char* pf, int64_t lines, bool first,
           bool last) {
         const auto* block = reinterpret_cast<const uint16_t*>(wp + (p * K2 + kb) * NR * 4);
         const int64_t c0 = p * NR, ncols = std::min<int64_t>(NR, n - c0);
         const float* xr = xp + m0 * ldx + 2 * kb;
         float* yr = yp + m0 * n + c0;
         const float* pb = (b && last) ? b + c0 : nullptr;
         switch (rows) {
           case 4: tile_bf16f<4>(xr, ldx, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           case 3: tile_bf16f<3>(xr, ldx, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           case 2: tile_bf16f<2>(xr, ldx, block, kn, yr, n, ncols, pb, first, pf, lines); break;
           default: tile_bf16f<1>(xr, ldx, block, kn, yr, n, ncols, pb, first, pf, lines); break;
         }
       });
  return y;
}

// W [N, K] int8 (already quantized) -> panels [P, K, 96] int8, zero-padded past N.
at::Tensor pack_i8(at::Tensor w) {
  check_cpu("w", w);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "weight must be a 2-D int8 tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto padded = at::zeros({P * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 contiguous, panels from pack_i8, scales [>= n] float32 (one per output row),
// n = the weight's real N; bias [N] or None.
at::Tensor linear_i8(at::Tensor x, at::Tensor panels, at::Tensor scales, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "panels", panels, "scales", scales, "bias", bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.scalar_type() == at::kChar && panels.is_contiguous(),
              "panels must come from pack_i8");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "n=", n, " does not match ", P, " panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == P * NR,
              "scales must be float32 [", P * NR, "] (padded to whole panels)");
  at::Tensor keep;
  const float* b = bias_ptr(bias, n, keep);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const auto* wp = reinterpret_cast<const char*>(panels.data_ptr());
  float* yp = y.data_ptr<float>();
  walk(M, K, P, KB_I8, NR, wp,
       [&](int64_t p, int64_t kb, int64_t kn, int64_t rows, int64_t m0, const char* pf, int64_t lines, bool first,
           bool last) {
         const auto* block = reinterpret_cast<const int8_t*>(wp + (p * K + kb) * NR);
         const int64_t c0 = p * NR, ncols = std::min<int64_t>(NR, n - c0);
         const float* xr = xp + m0 * K + kb;
         float* yr = yp + m0 * n + c0;
         const float* ps = last ? sp + c0 : nullptr;
         const float* pb = (b && last) ? b + c0 : nullptr;
         switch (rows) {
           case 4: tile_i8<4>(xr, K, block, kn, yr, n, ncols, ps, pb, first, pf, lines); break;
           case 3: tile_i8<3>(xr, K, block, kn, yr, n, ncols, ps, pb, first, pf, lines); break;
           case 2: tile_i8<2>(xr, K, block, kn, yr, n, ncols, ps, pb, first, pf, lines); break;
           default: tile_i8<1>(xr, K, block, kn, yr, n, ncols, ps, pb, first, pf, lines); break;
         }
       });
  return y;
}
