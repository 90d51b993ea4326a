// Causal prefill attention for CPU, float32 math: one chunk of n query rows against its sequence's
// ctx keys (ctx >= n; the chunk's own K/V are the last n of them). Query row i attends keys
// 0 .. ctx - n + i. Called per chunk by engine_workers/model/attention.py.
//
// q    [n, Hq, D]   float32, any row stride, unit stride in D (the engine passes a view of the fused QKV)
// k, v [ctx, Hkv, D] likewise, both float32 or both bfloat16 (a bf16 cache, kv_elem.h): bf16 keys
//                   are widened as they are transposed, bf16 values once per task into a float32
//                   buffer, so the tiles below see float32 either way
// returns [n, Hq, D] contiguous
//
// Why: SDPA's CPU kernel is built for long sequences with many heads; for the engine's chunks
// (a few sequences of 8..512 tokens, 9 query heads over 3 KV heads) it runs far below what a GEMM
// reaches, and was a large share of every prefill step (docs/design.md, Paged attention).
//
// Per task = (KV head, block of BQ query rows): the task's keys are transposed once into
// Kt[D][keys] (a thread-local buffer), then for each of the G query heads sharing the KV head and
// each tile of 4 query rows:
//   1. S = q . Kt over 96-key column blocks, outer-product form (tile.h: broadcast 4 q values
//      per d, 6 vector loads, 24 FMAs into 24 registers; no horizontal sums),
//   2. softmax over each row's own keys only (no masking, so no -inf: the build uses -ffast-math),
//   3. O = P . V, again outer-product (broadcast 4 probabilities per key, 4 vector loads of V).
// Tasks run on torch's intra-op pool (at::parallel_for). Without AVX-512F a plain loop nest does
// the same work; GCC vectorises it for whatever the CPU has.
// ATen's tensor and the few ops used, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) makes each file that includes it several times slower to compile (build
// times in docs/design.md, Paged attention). Only module.cpp binds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <type_traits>
#include <vector>

#include "kv_elem.h"
#include "tile.h"

namespace {

constexpr int64_t BQ = 32;   // query rows per task
constexpr int64_t TR = 4;    // query rows per register tile
constexpr int64_t KC = 96;   // keys per score column block (6 vectors)

// s[r][j] = scale * q_r . Kt[:, j] for r < R, j in [0, nk), nk rounded up to KC (Kt is padded).
template <int R>
inline void scores(const float* const* qrows, const float* __restrict kt, int64_t ldk, int64_t D, int64_t nk,
                   float* __restrict s, int64_t lds, float scale) {
  for (int64_t j0 = 0; j0 < nk; j0 += KC) {
#ifdef __AVX512F__
    __m512 acc[R][6];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 6; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      tile_step<R>(acc, kt + d * ldk + j0, [&](int r) { return qrows[r][d]; });
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 6; ++c) _mm512_storeu_ps(s + r * lds + j0 + 16 * c, _mm512_mul_ps(acc[r][c], sc));
#else
    float acc[R][KC] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* kr = kt + d * ldk + j0;
      for (int r = 0; r < R; ++r) {
        const float qv = qrows[r][d];
        for (int64_t c = 0; c < KC; ++c) acc[r][c] += qv * kr[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < KC; ++c) s[r * lds + j0 + c] = acc[r][c] * scale;
#endif
  }
}

// o_r = sum_j p[r][j] v_j for j < len[r] (p already normalised), D a multiple of 16 on AVX-512.
template <int R>
inline void weighted_values(const float* __restrict p, int64_t ldp, const int64_t* len, const float* __restrict v,
                            int64_t ldv, int64_t D, float* const* orows) {
  int64_t nk = 0;
  for (int r = 0; r < R; ++r) nk = std::max(nk, len[r]);
#ifdef __AVX512F__
  if (D % 64 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < nk; ++j) {
        const float* vr = v + j * ldv + d0;
        __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
        __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
        for (int r = 0; r < R; ++r) {
          // rows shorter than nk have p = 0 past their length (zeroed by the caller)
          __m512 pv = _mm512_set1_ps(p[r * ldp + j]);
          acc[r][0] = _mm512_fmadd_ps(pv, v0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(pv, v1, acc[r][1]);
          acc[r][2] = _mm512_fmadd_ps(pv, v2, acc[r][2]);
          acc[r][3] = _mm512_fmadd_ps(pv, v3, acc[r][3]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(orows[r] + d0 + 16 * c, acc[r][c]);
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    float* o = orows[r];
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t j = 0; j < len[r]; ++j) {
      const float pj = p[r * ldp + j];
      const float* vr = v + j * ldv;
      for (int64_t d = 0; d < D; ++d) o[d] += pj * vr[d];
    }
  }
}

template <int R>
void tile(const float* const* qrows, float* const* orows, const int64_t* len, const float* kt, int64_t ldk,
          const float* v, int64_t ldv, int64_t D, float* s, int64_t lds, float scale) {
  int64_t nk = 0;
  for (int r = 0; r < R; ++r) nk = std::max(nk, len[r]);
  scores<R>(qrows, kt, ldk, D, nk, s, lds, scale);
  for (int r = 0; r < R; ++r) {
    float* row = s + r * lds;
    const int64_t L = len[r];
    float m = row[0];
    for (int64_t j = 1; j < L; ++j) m = std::max(m, row[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      row[j] = expf(row[j] - m);
      sum += row[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < L; ++j) row[j] *= inv;
    for (int64_t j = L; j < nk; ++j) row[j] = 0.f;
  }
  weighted_values<R>(s, lds, len, v, ldv, D, orows);
}

template <class KV>
void prefill(const float* qp, const KV* kp, const KV* vp, float* op, int64_t qs, int64_t ks, int64_t vs, int64_t n,
             int64_t Hq, int64_t Hkv, int64_t D, int64_t ctx, float scale) {
  const int64_t G = Hq / Hkv, off = ctx - n, blocks = (n + BQ - 1) / BQ;
  constexpr bool f32 = std::is_same<KV, float>::value;
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt, s, vbuf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / blocks, i0 = (t % blocks) * BQ, i1 = std::min(n, i0 + BQ);
      const int64_t keys = off + i1;                 // the block's last row sees keys [0, off + i1)
      const int64_t ldk = (keys + KC - 1) / KC * KC;  // padded to whole column blocks
      kt.assign(D * ldk, 0.f);
      s.resize(TR * ldk);
      for (int64_t j = 0; j < keys; ++j) {
        const KV* kr = kp + j * ks + h * D;
        for (int64_t d = 0; d < D; ++d) kt[d * ldk + j] = widen(kr[d]);
      }
      const float* vh;
      int64_t ldv;
      if constexpr (f32) {
        vh = vp + h * D;
        ldv = vs;
      } else {
        vbuf.resize(keys * D);
        for (int64_t j = 0; j < keys; ++j) widen_row(vbuf.data() + j * D, vp + j * vs + h * D, D);
        vh = vbuf.data();
        ldv = D;
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        for (int64_t r0 = i0; r0 < i1; r0 += TR) {
          const int R = (int)std::min<int64_t>(TR, i1 - r0);
          const float* qrows[TR];
          float* orows[TR];
          int64_t len[TR];
          for (int r = 0; r < R; ++r) {
            qrows[r] = qp + (r0 + r) * qs + head * D;
            orows[r] = op + ((r0 + r) * Hq + head) * D;
            len[r] = off + r0 + r + 1;
          }
          switch (R) {
            case 4: tile<4>(qrows, orows, len, kt.data(), ldk, vh, ldv, D, s.data(), ldk, scale); break;
            case 3: tile<3>(qrows, orows, len, kt.data(), ldk, vh, ldv, D, s.data(), ldk, scale); break;
            case 2: tile<2>(qrows, orows, len, kt.data(), ldk, vh, ldv, D, s.data(), ldk, scale); break;
            default: tile<1>(qrows, orows, len, kt.data(), ldk, vh, ldv, D, s.data(), ldk, scale); break;
          }
        }
      }
    }
  });
}

}  // namespace

at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
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
