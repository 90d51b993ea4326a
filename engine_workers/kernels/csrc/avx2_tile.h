// The AVX2 + FMA form of the 96-column panel tiles (small_m_linear.cpp, small_m_lowp.cpp), used by
// the avx2 build (engine_workers/kernels/cpu_kernels.py, ISA levels); the avx512 build keeps its
// own tiles. AVX2 has 16 vector registers of 8 floats, so R rows x 96 columns (12R accumulators)
// do not fit: the tile runs as 4 strips of 24 columns, each R x 3 accumulators (12 at R = 4) plus
// the weight vectors and one broadcast. A strip re-reads the block's k rows from L1 (the block is
// sized for L1); each column's accumulator still sums over k in the same order, one FMA per k, as
// the AVX-512 tile does, so both builds give the same sums and a row's result never depends on
// the other rows of the tile.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LOCKGATE_AVX2 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace avx2 {

constexpr int64_t STRIP = 24;  // columns per strip: 3 vectors
constexpr int64_t NR = 96;     // columns per panel

// Lanes i < left set (left clamped to 0..8): the maskload/maskstore mask of a column tail.
inline __m256i lane_mask(int64_t left) {
  const int n = static_cast<int>(std::min<int64_t>(8, std::max<int64_t>(0, left)));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Horizontal sum / max of 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bf16 values (raw uint16) widened to float32 exactly (each to the top half of its lane).
inline __m256 widen8(const uint16_t* src) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// One R x 96 tile over K k steps: acc for columns [0, ncols) of y (ldy apart) starts at zero
// (first) or at y; kstep(acc, k, c0) adds k's products for strip columns c0 .. c0 + 24; then
// y = acc * scale + bias (scale, bias: per column, either may be null). pf_lines 64-byte lines
// from pf on are prefetched spread over the tile's k steps (the next block, as the AVX-512 tiles).
template <int R, class KStep>
inline void tile96(int64_t K, float* __restrict y, int64_t ldy, int64_t ncols, bool first,
                   const float* __restrict scale, const float* __restrict bias, const char* pf, int64_t pf_lines,
                   KStep kstep) {
  int64_t line = 0;
  const int64_t steps = 4 * K;
  for (int64_t s = 0; s < 4; ++s) {
    const int64_t c0 = STRIP * s;
    if (c0 >= ncols) {  // the rest of the prefetch still goes out
      for (; line < pf_lines; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
      break;
    }
    __m256i mk[3];
    for (int v = 0; v < 3; ++v) mk[v] = lane_mask(ncols - c0 - 8 * v);
    __m256 acc[R][3];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 3; ++v)
        acc[r][v] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(y + r * ldy + c0 + 8 * v, mk[v]);
    for (int64_t k = 0; k < K; ++k) {
      if (pf) {
        const int64_t upto = (s * K + k + 1) * pf_lines / steps;
        for (; line < upto; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
      }
      kstep(acc, k, c0);
    }
    for (int v = 0; v < 3; ++v) {
      if (c0 + 8 * v >= ncols) break;
      const __m256 b = bias ? _mm256_maskload_ps(bias + c0 + 8 * v, mk[v]) : _mm256_setzero_ps();
      const __m256 sc = scale ? _mm256_maskload_ps(scale + c0 + 8 * v, mk[v]) : _mm256_set1_ps(1.f);
      for (int r = 0; r < R; ++r) {
        const __m256 out = scale ? _mm256_fmadd_ps(acc[r][v], sc, b) : _mm256_add_ps(acc[r][v], b);
        _mm256_maskstore_ps(y + r * ldy + c0 + 8 * v, mk[v], out);
      }
    }
  }
}

}  // namespace avx2
#endif
