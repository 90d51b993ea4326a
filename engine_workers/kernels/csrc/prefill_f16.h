// prefill_attention.cpp's float16 pass (its header comment, "Float16 pass"): on a CPU with
// AVX512-FP16, a bf16 cache's Q . K and P . V are multiplied and summed in float16, in short runs
// whose results are widened to float32. Everything here is empty without AVX512-FP16.
//
// Both products use one trick: a 32-bit lane holds a pair of float16 values and a 32-bit
// broadcast (a plain load; a 16-bit broadcast costs a shuffle on an FMA port) supplies the pair
// it multiplies, so each lane pair sums two interleaved halves of a dot product, added at the end.
//   Q . K: keys packed [D / 2][KB][2] (a key's d pair side by side, KB keys across), q rows as
//          float16 pairs: per d pair, 16 keys per register; D / 2 products summed per half lane.
//   P . V: values packed [j / 2][D][2] (a key pair side by side, d across), p stored as float16
//          pairs: per key pair, 16 values of d per register; at most KB / 2 products per half lane.
// Error: a score is off by ~1e-3 of its magnitude (D = 64; about what rounding q to bf16 costs,
// as bf16 attention kernels do); the output by ~1e-3 relative when scores are of order 1, more
// for sharper attention (up to ~2e-2 seen on adversarial data), in every case about half of what
// the cache's own bf16 rounding costs. The guards bound overflow, not precision.
#pragma once

#include <ATen/Parallel.h>

#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <memory>
#include <vector>

#include "kv_elem.h"

#ifdef __AVX512FP16__
#include <immintrin.h>

namespace f16pass {

// The pass runs only when every |v| <= kVMax: p <= 1 (the running max includes the block), so a
// block's partial sums stay below keys-per-block * kVMax, under float16's 65504 for blocks of up
// to 63 keys. And only when max|q'| * max|k| * D <= kScoreMax (q' = q * scale * log2(e)), which
// bounds every partial sum of a score likewise, and each of q' and k is a finite float16.
constexpr float kVMax = 1024.f;
constexpr float kScoreMax = 32768.f;
constexpr float kF16Max = 65504.f;  // the largest finite float16

// 16 softmax weights stored as float16.
inline void store_p(_Float16* p, __m512 e) { _mm256_storeu_ph(p, _mm512_cvtxps_ph(e)); }

// 16 bf16 values as float16 bits (exact for values of normal float16 magnitude).
inline __m256i bf16_to_f16_bits(const uint16_t* src) { return _mm256_castph_si256(_mm512_cvtxps_ph(widen16(src))); }

// A register of float16 pairs (two halves of 16 sums) -> the 16 sums as float32.
inline __m512 widen_pairs(__m512h acc) {
  const __m512h both = _mm512_add_ph(acc, _mm512_castsi512_ph(_mm512_srli_epi32(_mm512_castph_si512(acc), 16)));
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_castph_si512(both)));  // each lane's low half
}

// The largest of chunk(i0, i1) over chunks of [0, n) run in parallel (each chunk's maximum of
// non-negative values; 0 for n = 0).
template <class F>
inline float parallel_max(int64_t n, int64_t grain, const F& chunk) {
  std::vector<float> part(std::max(1, at::get_num_threads()), 0.f);  // one slot per thread of the team
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    float& slot = part[at::get_thread_num()];
    slot = std::max(slot, chunk(i0, i1));
  });
  return *std::max_element(part.begin(), part.end());
}

// The largest |x| of bf16 rows: ctx rows of len adjacent elements, row stride vs.
inline float max_abs(const uint16_t* vp, int64_t vs, int64_t ctx, int64_t len) {
  return parallel_max(ctx, 64, [&](int64_t j0, int64_t j1) {
    __m512 mx = _mm512_setzero_ps();
    float tail = 0.f;
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* row = vp + j * vs;
      int64_t i = 0;
      for (; i + 16 <= len; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(widen16(row + i)));
      for (; i < len; ++i) tail = std::max(tail, fabsf(widen(row[i])));
    }
    return std::max(tail, _mm512_reduce_max_ps(mx));
  });
}

// One head's values for keys [j0, j1) (j0 even) as float16 key pairs: dst[j / 2][d][j % 2]
// (dst is the head's first pair; v its first row, row stride vs). A missing last key of an odd
// ctx is zero, so a pair's unused half multiplies p = 0 by a finite value. 16 | D.
inline void pack_values(_Float16* dst, const uint16_t* v, int64_t vs, int64_t j0, int64_t j1, int64_t ctx, int64_t D) {
  for (int64_t j = j0; j < j1; j += 2) {
    const uint16_t* a = v + j * vs;
    const uint16_t* b = j + 1 < ctx ? a + vs : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(bf16_to_f16_bits(a + d));
      const __m512i hi = b ? _mm512_cvtepu16_epi32(bf16_to_f16_bits(b + d)) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + j * D + 2 * d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// q' = q * qscale as float16, [n][Hq][D] contiguous, when the pass can run on this call (16 | D,
// the bounds above), else nullptr. q: [n] rows of Hq * D adjacent floats, row stride qs.
inline std::unique_ptr<_Float16[]> prepare(const float* q, int64_t qs, const uint16_t* k, int64_t ks, const uint16_t* v,
                                           int64_t vs, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, int64_t ctx,
                                           float qscale) {
  if (D % 16 != 0 || D > 1024 || max_abs(v, vs, ctx, Hkv * D) > kVMax) return nullptr;  // 1024: pack_keys' row
  const float kmax = max_abs(k, ks, ctx, Hkv * D);
  const int64_t len = Hq * D;
  std::unique_ptr<_Float16[]> out(new _Float16[n * len]);
  const __m512 s = _mm512_set1_ps(qscale);
  const float qmax = parallel_max(n, 16, [&](int64_t i0, int64_t i1) {  // converts as it scans
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t d = 0; d < len; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + i * qs + d), s);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
        _mm256_storeu_ph(out.get() + i * len + d, _mm512_cvtxps_ph(x));
      }
    return _mm512_reduce_max_ps(mx);
  });
  // Each value must be a finite float16 on its own too: a large k beside a zero q passes the
  // product bound, and would become inf (0 * inf poisons a score). NaN inputs are not screened:
  // the float32 pass gives no meaningful output for them either.
  if (kmax > kF16Max || qmax > kF16Max || qmax * kmax * static_cast<float>(D) > kScoreMax) return nullptr;
  return out;
}

// One block of nk (<= KB) keys of one head as float16 pairs, dst[d / 2][j][d % 2] (dst: the
// block, D * KB halves; k: its first key's row, row stride ks); keys nk..KB-1 are zero.
template <int KB>
inline void pack_keys(_Float16* dst, const uint16_t* k, int64_t ks, int64_t nk, int64_t D) {
  uint32_t row[512];  // one key as D / 2 words, one d pair each (D <= 1024)
  for (int64_t j = 0; j < KB; ++j) {
    if (j < nk) {
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<char*>(row) + 2 * d),
                            bf16_to_f16_bits(k + j * ks + d));
    }
    for (int64_t w = 0; w < D / 2; ++w) {
      const uint32_t word = j < nk ? row[w] : 0u;
      memcpy(dst + 2 * (w * KB + j), &word, sizeof word);  // two halves (memcpy: no type punning)
    }
  }
}

// Scores of R float16 rows (q pre-multiplied by scale * log2(e)) against one block of packed
// keys, widened into acc [R][KB / 16] (16 keys per register, key order).
template <int KB, int R>
inline void scores(const _Float16* const* q, const _Float16* __restrict kt, int64_t D, __m512 (&acc)[R][KB / 16]) {
  constexpr int NV = KB / 16;
  __m512h a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm512_setzero_ph();
  for (int64_t w = 0; w < D / 2; ++w) {
    __m512h kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = _mm512_loadu_ph(kt + 2 * (w * KB + 16 * c));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      memcpy(&pair, q[r] + 2 * w, sizeof pair);
      const __m512h qv = _mm512_castsi512_ph(_mm512_set1_epi32(pair));
      for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ph(qv, kv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = widen_pairs(a[r][c]);
}

// o_r = corr_r * o_r + S_r for R rows, S_r = sum_{j < nk} p[r][j] v_j multiplied and summed in
// float16 over this one block (p: R rows of KB float16 weights; vp: the block's first key pair),
// then added to the float32 o. One 32-bit broadcast of (p[r][j], p[r][j + 1]) (a plain load; a
// 16-bit broadcast costs a shuffle on an FMA port) feeds lanes holding keys j and j + 1 for 16
// values of d; the two halves of each lane pair are added at the end. U registers (16 d each) per
// row starting at d0.
template <int KB, int R, int U>
inline void block_values(const _Float16* __restrict p, const float* corr, const _Float16* __restrict vp, int64_t D,
                         int64_t d0, int64_t nk, float* const* orows) {
  static_assert(KB % 2 == 0 && KB * kVMax < 65504.f, "whole key pairs per block; no float16 overflow");
  __m512h acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ph();
  for (int64_t j = 0; j < nk; j += 2) {  // past nk (odd nk): p = 0
    __m512h vv[U];
    for (int u = 0; u < U; ++u) vv[u] = _mm512_loadu_ph(vp + j * D + 2 * (d0 + 16 * u));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      memcpy(&pair, p + r * KB + j, sizeof pair);
      const __m512h pv = _mm512_castsi512_ph(_mm512_set1_epi32(pair));
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_fmadd_ph(pv, vv[u], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int u = 0; u < U; ++u) {
      const __m512 s = widen_pairs(acc[r][u]);  // even key + odd key
      float* o = orows[r] + d0 + 16 * u;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(c, _mm512_loadu_ps(o), s));
    }
  }
}

template <int KB, int R>
inline void values(const _Float16* p, const float* corr, const _Float16* vp, int64_t D, int64_t nk,
                   float* const* orows) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) block_values<KB, R, 4>(p, corr, vp, D, d0, nk, orows);  // 16 accumulators
  for (; d0 < D; d0 += 16) block_values<KB, R, 1>(p, corr, vp, D, d0, nk, orows);
}

// o rows += p . v for R (<= 4) rows: values with R fixed at compile time.
template <int KB>
inline void values_rows(int R, const _Float16* p, const float* corr, const _Float16* vp, int64_t D, int64_t nk,
                        float* const* orows) {
  switch (R) {
    case 4: values<KB, 4>(p, corr, vp, D, nk, orows); break;
    case 3: values<KB, 3>(p, corr, vp, D, nk, orows); break;
    case 2: values<KB, 2>(p, corr, vp, D, nk, orows); break;
    default: values<KB, 1>(p, corr, vp, D, nk, orows); break;
  }
}

}  // namespace f16pass

#endif  // __AVX512FP16__
