// paged_decode.cpp's AVX-512 path (its header comment says when it runs): split-K work units,
// register-tiled products, and a bf16 cache widened without shuffles. Empty without AVX-512.
//
// Work: each sequence's context is cut into chunks of kChunk tokens (flash-decoding's split-K);
// a chunk is one unit, and the threads take contiguous runs of units holding equal numbers of
// tokens (to within one unit), so a batch of one long and nine short sequences, or a single
// sequence of at least as many units as threads, keeps every core busy (one task per sequence
// left a core idle whenever lengths differed). A unit writes its
// own softmax state (max m, sum l, unnormalised P . V per query head); a second pass over the
// sequences merges the chunks' states, exactly as the flash-attention combine does.
//
// Products: a chunk runs in tiles of up to 16 tokens contiguous in one cache block.
//   Q . K: per query head, 16 accumulators (one per token) collect D / 16 products each; one
//          transposing reduction (reduce16) turns the 16 into the tile's 16 scores, instead of a
//          horizontal sum per score.
//   P . V: the accumulators of up to GB query heads sharing a KV head stay in registers across the
//          tile; a value row is loaded once for them.
// A bf16 cache row is widened into a float32 tile buffer with a shift and a mask per 32 values,
// which leaves even and odd elements in separate registers (no shuffle on an FMA port). The
// element order inside each 32 is then [0, 2, .., 30, 1, 3, .., 31]; q is permuted the same way
// before Q . K and the output un-permuted after P . V, so every sum is the same set of products.
// All math float32; results differ from the generic loop by summation order only.
#pragma once

#ifdef __AVX512F__
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <math.h>
#include <stdint.h>
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "kv_elem.h"
#include "softmax_row.h"

namespace decode512 {

constexpr int64_t kChunk = 128;  // tokens per work unit: fine enough to balance two cores on one sequence
constexpr int kTile = 16;        // tokens per product tile (one register's lanes of scores)

// Whether this path takes head size D (D / 16 vectors per head, an even number: the bf16 widening
// works in runs of 32 values, and run_unit asserts it).
inline bool supports(int64_t D) { return D == 32 || D == 64 || D == 128; }

// The 16 lanes of each acc[t] summed into lane t of one register. After the four halving steps
// lane L holds the sum of acc[order[L]]; order is its own inverse, so permuting by it restores
// token order.
inline __m512 reduce16(__m512 (&a)[kTile]) {
  __m512 c[8], e[4], g[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 token i, 8-15 token i + 8
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within quarters
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[i], e[i + 2], 0x44), _mm512_shuffle_ps(e[i], e[i + 2], 0xEE));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, s);
}

// Scores of one tile for G query heads of one KV head: out[g * ld + t] = sc * q_g . k_t, t < nt.
// q: the G heads' rows (D = 16 * NC floats each); k: token 0's head row, rows `rs` floats apart.
template <int NC>
inline void score_tile(const float* __restrict q, int64_t G, const float* __restrict k, int64_t rs, int nt,
                       float sc, float* __restrict out, int64_t ld) {
  const __mmask16 keep = static_cast<__mmask16>((1u << nt) - 1u);
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[NC], acc[kTile];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + g * 16 * NC + 16 * c);
    for (int t = 0; t < kTile; ++t) {
      if (t >= nt) {
        acc[t] = _mm512_setzero_ps();
        continue;
      }
      const float* kr = k + t * rs;
      __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), s);
      acc[t] = s;
    }
    _mm512_mask_storeu_ps(out + g * ld, keep, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(sc)));
  }
}

// acc[g][:] += sum over t < nt of p[g * ld + t] * v_t for GB query heads (acc rows D = 16 * NC apart).
template <int NC, int GB>
inline void value_tile(float* __restrict acc, const float* __restrict p, int64_t ld, const float* __restrict v,
                       int64_t rs, int nt) {
  __m512 a[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * NC + 16 * c);
  for (int t = 0; t < nt; ++t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + t * rs + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * ld + t]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pb, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * 16 * NC + 16 * c, a[g][c]);
}

// value_tile over G query heads, GB at a time (accumulators + one value row within 32 registers).
template <int NC>
inline void value_heads(float* acc, const float* p, int64_t ld, const float* v, int64_t rs, int nt, int64_t G) {
  constexpr int kMaxGB = NC >= 8 ? 2 : 4;
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min<int64_t>(kMaxGB, G - g);
    float* a = acc + g * 16 * NC;
    const float* pg = p + g * ld;
    switch (gb) {
      case 4: value_tile<NC, (kMaxGB >= 4 ? 4 : 1)>(a, pg, ld, v, rs, nt); break;
      case 3: value_tile<NC, (kMaxGB >= 3 ? 3 : 1)>(a, pg, ld, v, rs, nt); break;
      case 2: value_tile<NC, 2>(a, pg, ld, v, rs, nt); break;
      default: value_tile<NC, 1>(a, pg, ld, v, rs, nt); break;
    }
    g += gb;
  }
}

// Rows of a tile as float32: a float32 cache is read in place; a bf16 one is widened into buf
// (nt rows of n values, even/odd order within each 32: the header's permutation).
inline const float* tile_rows(const float* r, float*, int, int64_t) { return r; }
inline const float* tile_rows(const uint16_t* r, float* buf, int nt, int64_t n) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < nt * n; i += 32) {
    const __m512i w = _mm512_loadu_si512(r + i);
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));          // elements 2j
    _mm512_storeu_ps(buf + i + 16, _mm512_castsi512_ps(_mm512_and_si512(w, high)));  // elements 2j + 1
  }
  return buf;
}

// dst = src in the bf16 tile order (within each 32: even elements, then odd), or the inverse.
inline void to_pair_order(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    for (int64_t j = 0; j < 16; ++j) dst[i + j] = src[i + 2 * j], dst[i + 16 + j] = src[i + 2 * j + 1];
}
inline void from_pair_order(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    for (int64_t j = 0; j < 16; ++j) dst[i + 2 * j] = src[i + j], dst[i + 2 * j + 1] = src[i + 16 + j];
}

// One unit: tokens [t0, t1) of sequence b. Writes m[Hq], l[Hq] and the unnormalised acc[Hq * D].
template <int NC, class KV>
void run_unit(const float* q, const KV* kp, const KV* vp, const int64_t* tab, int64_t block_size, int64_t t0,
              int64_t t1, int64_t Hq, int64_t Hkv, float sc, float* scores, float* buf, float* qbuf, float* m,
              float* l, float* acc) {
  constexpr bool kWiden = !std::is_same<KV, float>::value;
  static_assert(NC % 2 == 0, "the bf16 widening and q's pair order work in runs of 32 values");
  const int64_t D = 16 * NC, G = Hq / Hkv, row = Hkv * D, n = t1 - t0;
  if (kWiden) to_pair_order(qbuf, q, Hq * D), q = qbuf;
  // Tiles: up to 16 tokens, contiguous within one block. body(first token's index in the unit,
  // its cache slot, tokens, the next tile's slot or -1).
  auto tile_len = [&](int64_t t) {
    return static_cast<int>(std::min({int64_t{kTile}, t1 - t, block_size - t % block_size}));
  };
  auto slot_of = [&](int64_t t) { return tab[t / block_size] * block_size + t % block_size; };
  auto for_tiles = [&](auto&& body) {
    for (int64_t t = t0; t < t1;) {
      const int nt = tile_len(t);
      body(t - t0, slot_of(t), nt, t + nt < t1 ? slot_of(t + nt) : int64_t{-1});
      t += nt;
    }
  };
  // While a tile's keys are scored, the next tile's keys are asked for, and this tile's values
  // (into L2, for the value pass; a chunk's K and V fit there).
  for_tiles([&](int64_t i, int64_t slot, int nt, int64_t next) {
    if (next >= 0) prefetch_rows<3>(kp + next * row, tile_len(t0 + i + nt) * row);
    prefetch_rows<2>(vp + slot * row, nt * row);
    const float* kr = tile_rows(kp + slot * row, buf, nt, row);
    for (int64_t h = 0; h < Hkv; ++h) score_tile<NC>(q + h * G * D, G, kr + h * D, row, nt, sc, scores + h * G * kChunk + i, kChunk);
  });
  for (int64_t j = 0; j < Hq; ++j) l[j] = exp_shifted(scores + j * kChunk, n, m + j);  // the unit's softmax state
  std::fill(acc, acc + Hq * D, 0.f);
  for_tiles([&](int64_t i, int64_t slot, int nt, int64_t) {
    const float* vr = tile_rows(vp + slot * row, buf, nt, row);
    for (int64_t h = 0; h < Hkv; ++h)
      value_heads<NC>(acc + h * G * D, scores + h * G * kChunk + i, kChunk, vr + h * D, row, nt, G);
  });
}

template <int NC, class KV>
void decode(const float* qp, const KV* kp, const KV* vp, float* op, const int64_t* tab, const int64_t* lens,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t N, int64_t block_size, float sc) {
  constexpr bool kWiden = !std::is_same<KV, float>::value;
  const int64_t D = 16 * NC, row = Hkv * D;
  // Units in sequence order; first[b] = sequence b's first unit; start[u] = tokens before unit u.
  std::vector<int64_t> first(B + 1), start;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(start.size());
    for (int64_t t = 0; t < lens[b]; t += kChunk) start.push_back(total + t);
    total += lens[b];
  }
  const int64_t U = static_cast<int64_t>(start.size());
  first[B] = U;
  // Every unit writes all of its state, so none is initialised here (a large batch's is megabytes).
  std::unique_ptr<float[]> m(new float[U * Hq]), l(new float[U * Hq]), acc(new float[U * Hq * D]);
  const int64_t T = std::max(1, at::get_num_threads());
  at::parallel_for(0, T, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> scores(Hq * kChunk), buf(kTile * row), qbuf(Hq * D);
    for (int64_t s = s0; s < s1; ++s) {  // slot s: the units starting in tokens [total * s / T, total * (s + 1) / T)
      const auto lo = std::lower_bound(start.begin(), start.end(), total * s / T) - start.begin();
      const auto hi = std::lower_bound(start.begin(), start.end(), total * (s + 1) / T) - start.begin();
      int64_t b = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
      for (int64_t u = lo; u < hi; ++u) {
        while (first[b + 1] <= u) ++b;
        const int64_t t0 = (u - first[b]) * kChunk, t1 = std::min(lens[b], t0 + kChunk);
        run_unit<NC>(qp + b * Hq * D, kp, vp, tab + b * N, block_size, t0, t1, Hq, Hkv, sc, scores.data(), buf.data(),
                     qbuf.data(), m.get() + u * Hq, l.get() + u * Hq, acc.get() + u * Hq * D);
      }
    }
  });
  // Merge each sequence's chunks: out = sum_u e^(m_u - M) acc_u / sum_u e^(m_u - M) l_u.
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> o(Hq * D);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < Hq; ++j) {
        float mx = m[first[b] * Hq + j];
        for (int64_t u = first[b] + 1; u < first[b + 1]; ++u) mx = std::max(mx, m[u * Hq + j]);
        float den = 0.f;
        float* oj = o.data() + j * D;
        std::fill(oj, oj + D, 0.f);
        for (int64_t u = first[b]; u < first[b + 1]; ++u) {
          const float w = expf(m[u * Hq + j] - mx);
          den += w * l[u * Hq + j];
          const float* a = acc.get() + (u * Hq + j) * D;
          for (int64_t i = 0; i < D; ++i) oj[i] += w * a[i];
        }
        const float inv = 1.f / den;
        for (int64_t i = 0; i < D; ++i) oj[i] *= inv;
      }
      float* out = op + b * Hq * D;
      if (kWiden)
        from_pair_order(out, o.data(), Hq * D);
      else
        std::copy(o.begin(), o.end(), out);
    }
  });
}

}  // namespace decode512
#endif
