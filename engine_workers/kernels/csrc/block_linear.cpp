// Linear layers on ggml block-quantized weights (Q4_1, Q8_0; engine_workers/kernels/block_quant.py),
// float32 activations in and out: y[M, N] = x[M, K] . W^T (+ bias).
//
// Why: a decode step is one pass over the weights, so its time is their bytes over the memory
// bandwidth; Q4_1 is 5 bits a weight, Q8_0 8.5, float32 32 (docs/design.md, "Precision and
// devices"). Each packed block is read once per call and used for every row of x: the weight is
// dequantized in registers, exactly as block_quant.py defines it (nibble -> int32 -> float32, one
// FMA q * d + m, or q * d for Q8_0: exact in float32), then the float32 kernel's FMAs with x.
// So results differ from F.linear of the dequantized weight only by float32 summation order.
//
// Layout (made by cpu_blocks.py, pack_blocks): panels of NC = 64 output columns (4 AVX-512 vectors
// of float32 accumulators); per panel and k block of 32, one record of S bytes:
//   Q4_1: d[64] f16, m[64] f16, codes[16][64]: byte j of column c (elements j and j + 16);
//   Q8_0: d[64] f16, codes[32][64] int8.
// The codes and scales are the GGUF's, only regrouped so that one 16-byte load gives 16 columns.
// Columns past N are zero. Panels are split over torch's pool. Two loops:
// * M <= MR (4): one register tile of M rows x 64 columns (16 accumulators) runs down the whole
//   panel, each block's weights dequantized in registers and used at once: no store, no reload;
// * more rows: per group of KG = 4 blocks (128 k), the panel's weights are dequantized once into a
//   32 KiB float32 buffer (L1) and every row tile (MR2 = 6 rows x 64 columns, 24 accumulators)
//   runs the float32 kernel's FMAs over it, so the dequantization is paid once per call, not once
//   per row tile; partial sums go through y between groups.
// Both loops sum each row's products in the same k order, so a row's result does not depend on
// how many rows its call has (batch invariance, issue #38).
//
// block_dequant_t writes the float32 W^T [K, N] for large M (prefill), where a GEMM on the
// dequantized weight is faster than this kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "cpu_check.h"
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "avx2_tile.h"

namespace {

constexpr int64_t NC = 64;  // columns per panel
constexpr int64_t MR = 4;   // rows up to which the in-register loop runs (one tile)
constexpr int64_t MR2 = 6;  // rows per register tile of the buffered loop
constexpr int64_t KG = 4;   // blocks per dequantized buffer: 128 k x 64 columns x 4 bytes = 32 KiB
constexpr int64_t QK = 32;  // weights per block

inline int64_t record_bytes(bool q4) { return q4 ? 2 * NC * 2 + 16 * NC : NC * 2 + QK * NC; }

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#ifdef __AVX512F__
inline void masks(int64_t ncols, uint16_t (&m)[4]) {
  for (int v = 0; v < 4; ++v) {
    int64_t left = ncols - 16 * v;
    m[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<uint16_t>((1u << left) - 1);
  }
}

template <int R, bool Q4>
void tile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t KB, float* __restrict y,
          int64_t ldy, int64_t ncols, const float* __restrict bias) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t S = record_bytes(Q4);
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = panel + b * S;
    const auto* dh = reinterpret_cast<const __m256i*>(rec);
    const float* xb = x + b * QK;
    if (b + 1 < KB) _mm_prefetch(reinterpret_cast<const char*>(rec + S), _MM_HINT_T0);
    for (int v = 0; v < 4; ++v) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(dh + v));
      if constexpr (Q4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(dh + 4 + v));
        const uint8_t* codes = rec + 4 * NC + 16 * v;
        for (int j = 0; j < 16; ++j) {
          const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * NC)));
          const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(raw, low4)), d, m);
          const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4)), d, m);
          for (int r = 0; r < R; ++r) {
            acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j]), lo, acc[r][v]);
            acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j + 16]), hi, acc[r][v]);
          }
        }
      } else {
        const int8_t* codes = reinterpret_cast<const int8_t*>(rec + 2 * NC + 16 * v);
        for (int j = 0; j < QK; ++j) {
          const __m512 w = _mm512_mul_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * NC)))),
              d);
          for (int r = 0; r < R; ++r) acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j]), w, acc[r][v]);
        }
      }
    }
  }
  uint16_t mk[4];
  masks(ncols, mk);
  for (int v = 0; v < 4; ++v) {
    if (!mk[v]) break;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], _mm512_add_ps(acc[r][v], bv));
  }
}

// One record (32 k x 64 columns) dequantized to float32: element (k, column 16v + i) at
// out[k * ld + 16v + i], the vectors whose mask is zero skipped.
inline void dequant_record(const uint8_t* __restrict rec, bool q4, float* __restrict out, int64_t ld,
                           const uint16_t (&mk)[4]) {
  const auto* dh = reinterpret_cast<const __m256i*>(rec);
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int v = 0; v < 4 && mk[v]; ++v) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(dh + v));
    if (q4) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(dh + 4 + v));
      for (int j = 0; j < 16; ++j) {
        const __m512i raw = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 4 * NC + j * NC + 16 * v)));
        _mm512_mask_storeu_ps(out + j * ld + 16 * v, mk[v],
                              _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(raw, low4)), d, m));
        _mm512_mask_storeu_ps(out + (j + 16) * ld + 16 * v, mk[v],
                              _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4)), d, m));
      }
    } else {
      for (int j = 0; j < QK; ++j) {
        const __m512i raw = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * NC + j * NC + 16 * v)));
        _mm512_mask_storeu_ps(out + j * ld + 16 * v, mk[v], _mm512_mul_ps(_mm512_cvtepi32_ps(raw), d));
      }
    }
  }
}

// R rows x 64 columns over kn k of a dequantized buffer (row k at w + 64 k); accumulators start
// from y unless first; bias added when given (the last group).
// Batch invariance (issue #38): each row's sums run in the same k order as tile<R, Q4>'s, so a
// row's result is bit-identical whichever loop its call's row count picks (alone, or in a batch
// of 5+ rows). For Q4_1 that order is the nibble pairs' (k = j, j + 16, j + 1, j + 17, ... within
// a block); for Q8_0 it is plain k order. Partial sums stored to y between groups are exact.
template <int R, bool Q4>
void tile_buf(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kn, float* __restrict y,
              int64_t ldy, const uint16_t (&mk)[4], const float* __restrict bias, bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[v], y + r * ldy + 16 * v);
  for (int64_t i = 0; i < kn; ++i) {
    const int64_t jj = i % QK;
    const int64_t k = Q4 ? i - jj + (jj >> 1) + (jj & 1) * (QK / 2) : i;
    const float* wk = w + k * NC;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                 w3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    if (!mk[v]) break;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], _mm512_add_ps(acc[r][v], bv));
  }
}
#elif defined(LOCKGATE_AVX2)
// The avx2 build: every row count takes the buffered loop (one group of KG records dequantized
// into an L1 buffer, then R x 64 tiles in 24-column strips, csrc/avx2_tile.h), with the same
// dequantization (F16C for the scales, one FMA q * d + m) and the same k order per row as
// tile_buf above, so the sums equal the avx512 build's and a row's result does not depend on M.
inline void dequant_record8(const uint8_t* __restrict rec, bool q4, float* __restrict out) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int v = 0; v < NC / 8; ++v) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * v)));
    if (q4) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * NC + 16 * v)));
      for (int j = 0; j < 16; ++j) {
        const __m256i raw = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 4 * NC + j * NC + 8 * v)));
        _mm256_storeu_ps(out + j * NC + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(raw, low4)), d, m));
        _mm256_storeu_ps(out + (j + 16) * NC + 8 * v,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4)), d, m));
      }
    } else {
      for (int j = 0; j < QK; ++j) {
        const __m256i raw = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 2 * NC + j * NC + 8 * v)));
        _mm256_storeu_ps(out + j * NC + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(raw), d));
      }
    }
  }
}

template <int R, bool Q4>
void tile_buf8(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kn, float* __restrict y,
               int64_t ldy, int64_t ncols, const float* __restrict bias, bool first) {
  avx2::tile96<R>(kn, y, ldy, ncols, first, nullptr, bias, nullptr, 0,
                  [&](__m256 (&acc)[R][3], int64_t i, int64_t c0) {
                    const int64_t jj = i % QK;
                    const int64_t k = Q4 ? i - jj + (jj >> 1) + (jj & 1) * (QK / 2) : i;
                    const float* wk = w + k * NC + c0;  // the last strip reads 8 columns past 64: padding
                    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
                    for (int r = 0; r < R; ++r) {
                      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
                      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                      acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
                    }
                  });
}
#endif

// Weight (column c, element k) of one panel, from its records: the plain-C definition the
// vector code implements (also the fallback without AVX-512F or AVX2).
inline float weight_at(const uint8_t* panel, bool q4, int64_t c, int64_t k) {
  const uint8_t* rec = panel + (k / QK) * record_bytes(q4);
  const int64_t j = k % QK;
  uint16_t dh;
  std::memcpy(&dh, rec + 2 * c, 2);
  const float d = half_to_float(dh);
  if (!q4) return d * static_cast<float>(reinterpret_cast<const int8_t*>(rec + 2 * NC)[j * NC + c]);
  uint16_t mh;
  std::memcpy(&mh, rec + 2 * NC + 2 * c, 2);
  const uint8_t byte = rec[4 * NC + (j % 16) * NC + c];
  const int q = j < 16 ? (byte & 0xF) : (byte >> 4);
  return std::fma(static_cast<float>(q), d, half_to_float(mh));
}

void check_packed(const at::Tensor& packed, bool q4, int64_t n, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == record_bytes(q4),
              "packed must come from pack_blocks (uint8 [P, K/32, ", record_bytes(q4), "])");
  const int64_t P = packed.size(0);
  TORCH_CHECK(packed.size(1) * QK == K, "x has ", K, " features, the weight ", packed.size(1) * QK);
  TORCH_CHECK(n > (P - 1) * NC && n <= P * NC, "n=", n, " does not match ", P, " panels");
}

}  // namespace

// x [M, K] float32 contiguous; packed from pack_blocks; kind 0 = Q4_1, 1 = Q8_0; n = the weight's
// real N; bias [N] float32 or None.
at::Tensor block_linear(at::Tensor x, at::Tensor packed, int64_t kind, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "packed", packed, "bias", bias);
  TORCH_CHECK(kind == 0 || kind == 1, "kind must be 0 (q4_1) or 1 (q8_0), got ", kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  const bool q4 = kind == 0;
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, q4, n, K);
  at::Tensor keep;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    keep = bias->contiguous();
    TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == n, "bias must be float32 [N]");
    b = keep.data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const int64_t P = packed.size(0), KB = packed.size(1), S = record_bytes(q4);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
#ifdef __AVX512F__
    alignas(64) float buf[KG * QK * NC];
#elif defined(LOCKGATE_AVX2)
    alignas(64) float buf[KG * QK * NC + 8];  // + 8: the last 24-column strip's loads run past column 64
#endif
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = wp + p * KB * S;
      const int64_t c0 = p * NC, ncols = std::min<int64_t>(NC, n - c0);
      const float* pb = b ? b + c0 : nullptr;
#ifdef __AVX512F__
      if (M <= MR) {
        float* yr = yp + c0;
        switch (M * 2 + (q4 ? 1 : 0)) {
          case 9: tile<4, true>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 8: tile<4, false>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 7: tile<3, true>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 6: tile<3, false>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 5: tile<2, true>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 4: tile<2, false>(xp, K, panel, KB, yr, n, ncols, pb); break;
          case 3: tile<1, true>(xp, K, panel, KB, yr, n, ncols, pb); break;
          default: tile<1, false>(xp, K, panel, KB, yr, n, ncols, pb); break;
        }
        continue;
      }
      uint16_t mk[4];
      masks(ncols, mk);
      const uint16_t all[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};  // padded columns dequantize to 0
      for (int64_t b0 = 0; b0 < KB; b0 += KG) {
        const int64_t nb = std::min<int64_t>(KG, KB - b0), kn = nb * QK;
        for (int64_t i = 0; i < nb; ++i) dequant_record(panel + (b0 + i) * S, q4, buf + i * QK * NC, NC, all);
        const bool first = b0 == 0, last = b0 + nb == KB;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
          const float* xr = xp + m0 * K + b0 * QK;
          float* yr = yp + m0 * n + c0;
          const float* bb = last ? pb : nullptr;
          const int64_t rows = std::min<int64_t>(MR2, M - m0);
          if (q4) {
            switch (rows) {
              case 6: tile_buf<6, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 5: tile_buf<5, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 4: tile_buf<4, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 3: tile_buf<3, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 2: tile_buf<2, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              default: tile_buf<1, true>(xr, K, buf, kn, yr, n, mk, bb, first); break;
            }
          } else {
            switch (rows) {
              case 6: tile_buf<6, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 5: tile_buf<5, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 4: tile_buf<4, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 3: tile_buf<3, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              case 2: tile_buf<2, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
              default: tile_buf<1, false>(xr, K, buf, kn, yr, n, mk, bb, first); break;
            }
          }
        }
      }
#elif defined(LOCKGATE_AVX2)
      for (int64_t b0 = 0; b0 < KB; b0 += KG) {
        const int64_t nb = std::min<int64_t>(KG, KB - b0), kn = nb * QK;
        for (int64_t i = 0; i < nb; ++i) dequant_record8(panel + (b0 + i) * S, q4, buf + i * QK * NC);
        const bool first = b0 == 0, last = b0 + nb == KB;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          const float* xr = xp + m0 * K + b0 * QK;
          float* yr = yp + m0 * n + c0;
          const float* bb = last ? pb : nullptr;
          switch (std::min<int64_t>(MR, M - m0) * 2 + (q4 ? 1 : 0)) {
            case 9: tile_buf8<4, true>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 8: tile_buf8<4, false>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 7: tile_buf8<3, true>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 6: tile_buf8<3, false>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 5: tile_buf8<2, true>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 4: tile_buf8<2, false>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            case 3: tile_buf8<1, true>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
            default: tile_buf8<1, false>(xr, K, buf, kn, yr, n, ncols, bb, first); break;
          }
        }
      }
#else
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < ncols; ++c) {
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += xp[r * K + k] * weight_at(panel, q4, c, k);
          yp[r * n + c0 + c] = acc + (pb ? pb[c] : 0.f);
        }
#endif
    }
  });
  return y;
}

// The float32 W^T [K, n] of packed blocks (for a GEMM on large M).
at::Tensor block_dequant_t(at::Tensor packed, int64_t kind, int64_t n, int64_t K) {
  check_cpu("packed", packed);
  TORCH_CHECK(kind == 0 || kind == 1, "kind must be 0 (q4_1) or 1 (q8_0), got ", kind);
  const bool q4 = kind == 0;
  check_packed(packed, q4, n, K);
  auto wt = at::empty({K, n}, at::TensorOptions().dtype(at::kFloat));
  const int64_t P = packed.size(0), KB = packed.size(1), S = record_bytes(q4);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* out = wt.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = wp + p * KB * S;
      const int64_t c0 = p * NC, ncols = std::min<int64_t>(NC, n - c0);
#ifdef __AVX512F__
      uint16_t mk[4];
      masks(ncols, mk);
      for (int64_t b = 0; b < KB; ++b) dequant_record(panel + b * S, q4, out + b * QK * n + c0, n, mk);
#else
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < ncols; ++c) out[k * n + c0 + c] = weight_at(panel, q4, c, k);
#endif
    }
  });
  return wt;
}
