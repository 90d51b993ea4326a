// One k step of small_m_linear.cpp's outer-product register tile (x . W^T over weight panels;
// prefill_attention.cpp has its own narrower tile of the same form): for R rows and 96
// columns (6 AVX-512 vectors), acc[r][c] += x(r) * w[16c : 16c + 16]. Six vector loads, R
// broadcasts, 6R FMAs; no horizontal sums. ``x`` is a callable giving row r's scalar for this k
// (inlined, so each caller keeps its own addressing).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

template <int R, class X>
inline void tile_step(__m512 (&acc)[R][6], const float* __restrict w, X x) {
  const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
  const __m512 w3 = _mm512_loadu_ps(w + 48), w4 = _mm512_loadu_ps(w + 64), w5 = _mm512_loadu_ps(w + 80);
  for (int r = 0; r < R; ++r) {
    const __m512 xv = _mm512_set1_ps(x(r));
    acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
    acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    acc[r][4] = _mm512_fmadd_ps(xv, w4, acc[r][4]);
    acc[r][5] = _mm512_fmadd_ps(xv, w5, acc[r][5]);
  }
}
#endif
