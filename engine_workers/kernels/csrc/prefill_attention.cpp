// Causal prefill attention for CPU, float32 math (but see "Float16 pass" below): one chunk of n
// query rows against its sequence's ctx keys (ctx >= n; the chunk's own K/V are the last n of
// them). Query row i attends keys 0 .. ctx - n + i. Called per chunk by engine_workers/model/attention.py.
//
// q    [n, Hq, D]   float32, any row stride, unit stride in D (the engine passes a view of the fused QKV)
// k, v [ctx, Hkv, D] likewise, both float32 or both bfloat16 (a bf16 cache, kv_elem.h)
// returns [n, Hq, D] contiguous
//
// Why: SDPA's CPU kernel is built for long sequences with many heads; for the engine's chunks
// (a few sequences of 8..1024 tokens, 9 query heads over 3 KV heads) it runs far below what a GEMM
// reaches, and was a large share of every prefill step (docs/design.md, Paged attention).
//
// Layout of the work (flash-attention's loop order, on a CPU's caches):
//   1. Pack once per call: every KV head's keys transposed, in contiguous blocks of KB keys
//      ([D][KB] each, the last block's padding zero) and, for a bf16 cache, its values widened to
//      float32 (or float16 pairs, Float16 pass). Each key is packed once, not once per
//      query block.
//   2. A task = (KV head, block of BQ query positions); its rows are every (position, query head
//      of that KV head) pair, position-major, so rows sharing keys share each loaded key block.
//   3. For each block of KB keys (its packed keys and its values, D·KB floats each: 12 KiB at
//      D = 64, stay in L1 while every row tile of the task passes over them), for each tile of TR
//      rows: S = q . Kt over the block in outer-product form (per d: KB/16 vector loads, TR
//      broadcasts, TR·KB/16 FMAs into as many registers; no horizontal sums), scaled; then the
//      online softmax (running max m and sum l per row; O rescaled by 2^(m_old - m_new) when the
//      max grows); then O += P . V.
//      A key past a row's causal limit gets p = 0 (never -inf: the build uses -ffast-math, finite
//      math only); the running max starts at the finite kNoMax.
//   4. out = O / l.
// Tasks are claimed from an atomic counter, heaviest (latest query block) first, so a causal
// chunk's uneven tasks balance over the threads; the pool is torch's (at::parallel_for).
// Without AVX-512F the same loop order runs with plain loops that GCC vectorises.
//
// Float16 pass: on a CPU with AVX512-FP16 (float16 FMAs at twice float32's rate; its bf16 dot
// product runs at half float32's: docs/design.md, Paged attention), a bf16 cache's Q . K and P . V
// are multiplied and summed in float16 in short runs (a score's D / 2 products per half lane, a
// block's key pairs for P . V) whose sums are widened to float32 (prefill_f16.h). The running max
// and sum, the exp's argument and the sum over blocks stay float32; p is stored as float16, so
// its exp needs only a degree-4 polynomial. Error ~1e-3 relative for scores of order 1, more for
// sharper attention, about half of what the cache's own bf16 rounding costs; a float32 cache never
// takes it. Used when 16 | D and the inputs' ranges rule out float16 overflow (f16pass::prepare),
// else the float32 pass.
// ATen's tensor and the few ops used, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) makes each file that includes it several times slower to compile (build
// times in docs/design.md, Paged attention). Only module.cpp binds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <algorithm>
#include <atomic>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kv_elem.h"
#include "prefill_f16.h"
#include "cpu_check.h"

namespace {

constexpr int64_t TR = 8;         // rows per tile (8 rows x 3 vectors: 24 score accumulators)
constexpr int64_t KB = 48;        // keys per block
constexpr float kNoMax = -1e30f;  // running max before a row has seen a key (finite: -ffast-math)
constexpr float kLog2e = 1.4426950408889634f;

// The rows of one task: their query and output pointers, visible key counts, and online-softmax
// state (running max m in log2 units, running sum l kept as 16 lane-wise partial sums per row,
// so a block adds to it without a horizontal sum; unnormalised output o).
struct Rows {
  std::vector<const void*> q;  // float, or _Float16 for the float16 pass
  std::vector<float*> out;
  std::vector<int64_t> len;
  std::vector<float> m, l, o;
  void reset(int64_t M, int64_t D) {
    q.resize(M);
    out.resize(M);
    len.resize(M);
    m.assign(M, kNoMax);
    l.assign(M * 16, 0.f);
    o.assign(M * D, 0.f);
  }
};

#ifdef __AVX512F__
// 2^x for x <= 0: 2^n * P(f ln 2), P the Taylor series of e^y to degree Deg, f = x - n in
// [-1/2, 1/2]; relative error ~2e-7 at degree 7, ~4e-5 at degree 4 (enough for a p that is
// rounded to float16, relative step 2^-11). Results below 2^-127 flush towards 0. Inline, so the
// softmax keeps its registers (a call to glibc's vector expf clobbers every zmm register).
template <int Deg = 7>
inline __m512 exp2_nonpos(__m512 x) {
  static_assert(Deg >= 2 && Deg <= 7, "degree 2..7");
  constexpr float inv_fact[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));  // f ln 2
  __m512 p = _mm512_set1_ps(inv_fact[Deg]);
  for (int i = Deg - 1; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(inv_fact[i]));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? 0xFFFF : k <= 0 ? 0 : (__mmask16)((1u << k) - 1); }

inline void store_p(float* p, __m512 e) { _mm512_storeu_ps(p, e); }
#endif

#ifdef __AVX512FP16__
inline void store_p(_Float16* p, __m512 e) { f16pass::store_p(p, e); }
#endif

// Scores of R rows against one packed key block kt, then the online softmax, in registers:
// p[r][j] = 2^(t - m_new) with t = log2(e) * scale * q_r . k_j for the row's first nv[r] keys of
// the block, p = 0 past them; m and l (16 partial sums per row) updated; corr[r] = the factor the
// row's earlier o must be scaled by. Rows with nv <= 0 are left as they were (corr 1, p 0).
// E = float: kt is [D][KB] float32; E = _Float16 (the float16 pass): kt is key pairs and the q
// rows are float16, already multiplied by scale * log2(e) (prefill_f16.h).
template <int R, class E>
inline void scores_softmax(const E* const* qrows, const E* __restrict kt, int64_t D, const int64_t* nv,
                           float* m, float* l, float* corr, E* __restrict p, float scale) {
#ifdef __AVX512F__
  constexpr int NV = KB / 16;
  constexpr int kDeg = std::is_same<E, float>::value ? 7 : 4;  // p's own precision
  __m512 acc[R][NV];
  float factor = 1.f;  // turns acc into log2 units
  if constexpr (std::is_same<E, float>::value) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m512 kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = _mm512_loadu_ps(kt + d * KB + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(qrows[r][d]);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(xv, kv[c], acc[r][c]);
      }
    }
    factor = scale * kLog2e;
  } else {
#ifdef __AVX512FP16__
    f16pass::scores<KB, R>(qrows, kt, D, acc);
#endif
  }
  const __m512 sc = _mm512_set1_ps(factor), none = _mm512_set1_ps(kNoMax);
  for (int r = 0; r < R; ++r) {
    if (nv[r] <= 0) {
      corr[r] = 1.f;
      for (int c = 0; c < NV; ++c) store_p(p + r * KB + 16 * c, _mm512_setzero_ps());
      continue;
    }
    __mmask16 mask[NV];
    __m512 t[NV], mx = none;
    for (int c = 0; c < NV; ++c) {
      mask[c] = first_lanes(nv[r] - 16 * c);
      t[c] = _mm512_mask_mul_ps(none, mask[c], acc[r][c], sc);
      mx = _mm512_max_ps(mx, t[c]);
    }
    const float mn = std::max(m[r], _mm512_reduce_max_ps(mx));
    corr[r] = m[r] == kNoMax ? 0.f
              : mn == m[r]   ? 1.f
                             : _mm512_cvtss_f32(exp2_nonpos(_mm512_set1_ps(m[r] - mn)));
    const __m512 mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < NV; ++c) {
      const __m512 e = _mm512_maskz_mov_ps(mask[c], exp2_nonpos<kDeg>(_mm512_sub_ps(t[c], mv)));
      store_p(p + r * KB + 16 * c, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * r), _mm512_set1_ps(corr[r]), sum));
    m[r] = mn;
  }
#else
  float acc[R][KB] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kr = kt + d * KB;
    for (int r = 0; r < R; ++r) {
      const float qv = qrows[r][d];
      for (int64_t c = 0; c < KB; ++c) acc[r][c] += qv * kr[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* pr = p + r * KB;
    const int64_t n = std::min(KB, nv[r]);
    for (int64_t j = 0; j < KB; ++j) pr[j] = 0.f;
    if (n <= 0) {
      corr[r] = 1.f;
      continue;
    }
    float mx = kNoMax;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, acc[r][j] * scale * kLog2e);
    const float mn = std::max(m[r], mx);
    corr[r] = m[r] == kNoMax ? 0.f : exp2f(m[r] - mn);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      pr[j] = exp2f(acc[r][j] * scale * kLog2e - mn);
      sum += pr[j];
    }
    l[16 * r] = l[16 * r] * corr[r] + sum;  // one partial sum of the 16 suffices here
    m[r] = mn;
  }
#endif
}

// o_r = corr_r * o_r + sum_{j < nk} p[r][j] v_j for r < R.
template <int R>
inline void block_values(const float* __restrict p, const float* corr, const float* __restrict v, int64_t ldv,
                         int64_t D, int64_t nk, float* const* orows) {
  int64_t d0 = 0;
#ifdef __AVX512F__
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r]);
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_mul_ps(c, _mm512_loadu_ps(orows[r] + d0 + 16 * u));
    }
    for (int64_t j = 0; j < nk; ++j) {
      const float* vr = v + j * ldv + d0;
      const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
      const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 pv = _mm512_set1_ps(p[r * KB + j]);
        acc[r][0] = _mm512_fmadd_ps(pv, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pv, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(pv, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(pv, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(orows[r] + d0 + 16 * u, acc[r][u]);
  }
#endif
  if (d0 == D) return;
  for (int r = 0; r < R; ++r) {
    float* o = orows[r];
    for (int64_t d = d0; d < D; ++d) o[d] *= corr[r];
    for (int64_t j = 0; j < nk; ++j) {
      const float pj = p[r * KB + j];
      const float* vr = v + j * ldv;
      for (int64_t d = d0; d < D; ++d) o[d] += pj * vr[d];
    }
  }
}

// o rows += p . v for R (<= 4) rows: block_values with R fixed at compile time.
inline void values_rows(int R, const float* p, const float* corr, const float* v, int64_t ldv, int64_t D,
                        int64_t nk, float* const* orows) {
  switch (R) {
    case 4: block_values<4>(p, corr, v, ldv, D, nk, orows); break;
    case 3: block_values<3>(p, corr, v, ldv, D, nk, orows); break;
    case 2: block_values<2>(p, corr, v, ldv, D, nk, orows); break;
    default: block_values<1>(p, corr, v, ldv, D, nk, orows); break;
  }
}

#ifdef __AVX512FP16__
inline void values_rows(int R, const _Float16* p, const float* corr, const _Float16* vp, int64_t ldv, int64_t D,
                        int64_t nk, float* const* orows) {
  (void)ldv;  // packed float16 values are always pairs of [D] rows
  f16pass::values_rows<KB>(R, p, corr, vp, D, nk, orows);
}
#endif

// Rows [r0, r0 + R) of a task (R <= TR) over the key block starting at key kb0 (kt: that block,
// packed; vb: its first value row). A partial tile scores its last row again in the unused slots
// (cheaper than a variant per row count) and gives those slots no keys.
// E: the element of q, the packed keys and values, and p (float, or _Float16 for the float16
// pass). Not inlined: inlined into the task loop, GCC spilled the score accumulators to the stack
// inside the Q . K loop (measured ~1.5x slower).
template <class E>
__attribute__((noinline)) void tile(Rows& rows, int64_t r0, int R, int64_t kb0, const E* kt, const E* vb, int64_t ldv,
                                    int64_t D, E* p, float scale) {
  const E* q[TR];
  float* o[TR];
  int64_t nv[TR];
  int64_t nk = 0;
  for (int r = 0; r < TR; ++r) {
    const int64_t i = r0 + std::min(r, R - 1);
    q[r] = static_cast<const E*>(rows.q[i]);
    o[r] = rows.o.data() + i * D;
    nv[r] = r < R ? std::min(KB, rows.len[i] - kb0) : 0;
    nk = std::max(nk, nv[r]);
  }
  float corr[TR];
  scores_softmax<TR>(q, kt, D, nv, rows.m.data() + r0, rows.l.data() + 16 * r0, corr, p, scale);
  values_rows(std::min(R, 4), p, corr, vb, ldv, D, nk, o);  // 4 rows x 4 registers: 16 accumulators
  if (R > 4) values_rows(R - 4, p + 4 * KB, corr + 4, vb, ldv, D, nk, o + 4);
}

template <class KV>
void prefill(const float* qp, const KV* kp, const KV* vp, float* op, int64_t qs, int64_t ks, int64_t vs, int64_t n,
             int64_t Hq, int64_t Hkv, int64_t D, int64_t ctx, float scale) {
  constexpr bool f32 = std::is_same<KV, float>::value;
  const int64_t G = Hq / Hkv, off = ctx - n;
  const int64_t nblk = (ctx + KB - 1) / KB;
#ifdef __AVX512FP16__
  using Half = _Float16;
  std::unique_ptr<Half[]> q16;  // the float16 pass's q, scaled (prefill_f16.h); set when it runs
  if constexpr (!f32) q16 = f16pass::prepare(qp, qs, kp, ks, vp, vs, n, Hq, Hkv, D, ctx, scale * kLog2e);
  const bool half = q16 != nullptr;
#else
  using Half = float;  // never used: no float16 pass without AVX512-FP16
  constexpr bool half = false;
#endif

  // 1. Pack: Kt[h][block][d][j - block start], each block contiguous (padding keys zero: their
  //    scores are computed, then given p = 0) and, for bf16, V widened to float32 [h][j][d]; for
  //    the float16 pass instead float16 key blocks and values, in pairs (prefill_f16.h).
  //    Uninitialised allocations: every element is written below (a zero fill of the whole
  //    buffer was a serial pass per layer and chunk).
  const int64_t ctxp = (ctx + 1) / 2 * 2;  // the float16 pass's values, padded to whole key pairs
  std::unique_ptr<float[]> kt(half ? nullptr : new float[Hkv * nblk * D * KB]);
  std::unique_ptr<float[]> vw(f32 || half ? nullptr : new float[Hkv * ctx * D]);
  std::unique_ptr<Half[]> kt16(half ? new Half[Hkv * nblk * D * KB] : nullptr);
  std::unique_ptr<Half[]> vh16(half ? new Half[Hkv * ctxp * D] : nullptr);
  at::parallel_for(0, Hkv * nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h = b / nblk, j0 = (b % nblk) * KB, j1 = std::min(ctx, j0 + KB);
      if (half) {
#ifdef __AVX512FP16__
        if constexpr (!f32) {
          f16pass::pack_keys<KB>(kt16.get() + b * D * KB, kp + j0 * ks + h * D, ks, j1 - j0, D);
          f16pass::pack_values(vh16.get() + h * ctxp * D, vp + h * D, vs, j0, j1, ctx, D);
        }
#endif
        continue;
      }
      float* blk = kt.get() + b * D * KB;
      for (int64_t j = j0; j < j1; ++j) {
        const KV* kr = kp + j * ks + h * D;
        for (int64_t d = 0; d < D; ++d) blk[d * KB + (j - j0)] = widen(kr[d]);
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = j1 - j0; j < KB; ++j) blk[d * KB + j] = 0.f;
      if constexpr (!f32)
        for (int64_t j = j0; j < j1; ++j) widen_row(vw.get() + (h * ctx + j) * D, vp + j * vs + h * D, D);
    }
  });

  // 2. Tasks: (KV head, block of BQ query positions), enough of them to keep every thread busy
  //    on a short chunk; claimed heaviest (latest positions) first. BQ * G rows fill whole tiles
  //    (BQ a multiple of TR / gcd(G, TR)) wherever the chunk allows.
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  const int64_t step = TR / std::gcd(G, TR);
  const int64_t want = (n * Hkv + 4 * nth - 1) / (4 * nth);  // positions per task for ~4 tasks per thread
  const int64_t BQ = std::clamp<int64_t>((want + step - 1) / step * step, 1, std::max<int64_t>(32, step));
  const int64_t qblocks = (n + BQ - 1) / BQ, tasks = Hkv * qblocks;
  std::atomic<int64_t> next{0};
  // One pass over the tasks. E: the element of this pass's q rows, packed keys and values, and p.
  // q: the first row and its stride; keys: head 0's packed keys (heads nblk * D * KB apart);
  // values: head 0's first value row, heads vhead apart, rows ldv apart.
  auto run = [&](const auto* q, int64_t qstride, const auto* keys, const auto* values, int64_t vhead, int64_t ldv) {
    using E = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
      Rows rows;
      std::vector<E> p(TR * KB);
      for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
        const int64_t h = t % Hkv, i0 = (qblocks - 1 - t / Hkv) * BQ, i1 = std::min(n, i0 + BQ);
        const int64_t M = (i1 - i0) * G;  // rows: (position, query head of h), position-major
        rows.reset(M, D);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t pos = i0 + r / G, head = h * G + r % G;
          rows.q[r] = q + pos * qstride + head * D;
          rows.out[r] = op + (pos * Hq + head) * D;
          rows.len[r] = off + pos + 1;
        }
        const E* kth = keys + h * nblk * D * KB;
        const E* vh = values + h * vhead;
        // 3. Key blocks outer, row tiles inner: a block's keys and values stay cached while every
        //    tile passes over them. Rows are in position order, so a tile whose last row's keys
        //    end before the block sees none of it.
        for (int64_t kb0 = 0; kb0 < off + i1; kb0 += KB)
          for (int64_t r0 = 0; r0 < M; r0 += TR) {
            const int R = (int)std::min<int64_t>(TR, M - r0);
            if (rows.len[r0 + R - 1] > kb0)
              tile<E>(rows, r0, R, kb0, kth + kb0 * D, vh + kb0 * ldv, ldv, D, p.data(), scale);
          }
        // 4. Normalise into the output (every row saw at least its own key, so l > 0).
        for (int64_t r = 0; r < M; ++r) {
          float l = 0.f;
          for (int u = 0; u < 16; ++u) l += rows.l[16 * r + u];
          const float inv = 1.f / l;
          const float* o = rows.o.data() + r * D;
          for (int64_t d = 0; d < D; ++d) rows.out[r][d] = o[d] * inv;
        }
      }
    });
  };
  if constexpr (f32) {
    run(qp, qs, kt.get(), vp, D, vs);  // values read in place from the cache's rows
  } else if (!half) {
    run(qp, qs, kt.get(), vw.get(), ctx * D, D);
  } else {
#ifdef __AVX512FP16__
    run(q16.get(), Hq * D, kt16.get(), vh16.get(), ctxp * D, D);
#endif
  }
}

}  // namespace

bool prefill_f16_values() {
#ifdef __AVX512FP16__
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  check_cpu("q", q, "k", k, "v", v);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32, got ", q.scalar_type());
  const bool bf16 = kv_is_bf16(k, v);  // float32 or bfloat16, one dtype for both
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "unit stride in the head dimension");
  TORCH_CHECK(q.stride(1) == q.size(2) && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "heads must be adjacent in each row");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), ctx = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.size(0) == ctx && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D, "k and v shapes differ");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(n >= 1 && ctx >= n, "need 1 <= n <= ctx, got n=", n, " ctx=", ctx);
  auto out = at::empty({n, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  if (bf16)
    prefill(qp, kv_data<uint16_t>(k), kv_data<uint16_t>(v), op, qs, ks, vs, n, Hq, Hkv, D, ctx, (float)scale);
  else
    prefill(qp, kv_data<float>(k), kv_data<float>(v), op, qs, ks, vs, n, Hq, Hkv, D, ctx, (float)scale);
  return out;
}
