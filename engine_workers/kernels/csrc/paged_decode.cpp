// Paged decode attention for CPU, float32 math: one query token per sequence, K/V read in place from
// the block-paged cache (no gather copy, no padding to the longest sequence, no mask).
//
// q        [B, Hq, D]      contiguous float32
// k_cache  [slots, Hkv, D] contiguous (slot = block * block_size + offset), v_cache likewise; both
//                          float32 or both bfloat16 (kv_elem.h: a bf16 row is widened to float32
//                          once, into a buffer the G query heads of each KV head then read)
// tables   [B, N] int64    block table of each sequence (entries past its context are ignored)
// ctx      [B] int64       context length of each sequence, >= 1 (its new token included)
// returns  [B, Hq, D]
//
// Two paths, both float32 math, the same result up to summation order:
// - AVX-512 builds, head size 32, 64 or 128 (paged_decode_avx512.h): contexts split into
//   128-token work units spread evenly over the threads, register-tiled products, a bf16 cache
//   widened without shuffles, and the units' softmax states merged per sequence.
// - otherwise (decode() below): one task per sequence; the G = Hq / Hkv query heads that share a
//   KV head read each K/V row once; two passes over the context (scores + softmax, then the V
//   sum) with the scores in a per-task buffer.
// Both run on torch's own intra-op pool (at::parallel_for), so the kernel adds no thread pool of
// its own. Compiled with -ffast-math so GCC vectorises the loops (expf
// through glibc's vector math library, libmvec); that assumes finite values, which holds: scores
// are computed only for real context positions (no -inf masking) and the max is subtracted.
// ATen's tensor and the few ops used, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) makes each file that includes it several times slower to compile (build
// times in docs/design.md, Paged attention). Only module.cpp binds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <vector>

#include "kv_elem.h"
#include "cpu_check.h"
#include "paged_decode_avx512.h"
#include "softmax_row.h"

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// A cache row (all KV heads of one token) as float32: the row itself for a float32 cache, else
// widened into buf.
inline const float* row_f32(const float* r, float*, int64_t) { return r; }
inline const float* row_f32(const uint16_t* r, float* buf, int64_t n) {
  widen_row(buf, r, n);
  return buf;
}

template <class KV>
void decode(const float* qp, const KV* kp, const KV* vp, float* op, const int64_t* tab, const int64_t* lens,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t N, int64_t block_size, float sc) {
  const int64_t G = Hq / Hkv;
  // One task per sequence: its K/V rows are read whole (all KV heads, Hkv * D contiguous elements
  // per token), so memory streams block by block; a task per (sequence, head) reads a third of each
  // row at a stride, which was much slower on cold caches (docs/benchmarks.md, Engine). The
  // AVX-512 path keeps whole rows too, and splits along the context instead.
  const int64_t row = Hkv * D;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(Hq * D), inv(Hq), wide(row);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const float* qb = qp + b * Hq * D;
      scores.resize(Hq * L);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = tab[b * N + t / block_size] * block_size + t % block_size;
        if (t % block_size == 0 && t + block_size < L)  // the next block, while this one is read
          prefetch_rows<3>(kp + tab[b * N + t / block_size + 1] * block_size * row, block_size * row);
        const float* kr = row_f32(kp + slot * row, wide.data(), row);
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) scores[(h * G + g) * L + t] = dot(qb + (h * G + g) * D, kr + h * D, D) * sc;
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float m;
        inv[j] = 1.f / exp_shifted(scores.data() + j * L, L, &m);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = tab[b * N + t / block_size] * block_size + t % block_size;
        if (t % block_size == 0 && t + block_size < L)  // the next block, while this one is read
          prefetch_rows<3>(vp + tab[b * N + t / block_size + 1] * block_size * row, block_size * row);
        const float* vr = row_f32(vp + slot * row, wide.data(), row);
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) axpy(acc.data() + (h * G + g) * D, scores[(h * G + g) * L + t], vr + h * D, D);
      }
      float* o = op + b * Hq * D;
      for (int64_t j = 0; j < Hq; ++j)
        for (int64_t i = 0; i < D; ++i) o[j * D + i] = acc[j * D + i] * inv[j];
    }
  });
}

}  // namespace

namespace {

at::Tensor run_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables, at::Tensor ctx,
                      int64_t block_size, double scale, bool split_path) {
  check_cpu("q", q, "k_cache", k_cache, "v_cache", v_cache, "tables", tables, "ctx", ctx);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32, got ", q.scalar_type());
  kv_is_bf16(k_cache, v_cache);  // float32 or bfloat16, one dtype for both
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "int64 tables and ctx");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), N = tables.size(1), slots = k_cache.size(0);
  TORCH_CHECK(Hkv > 0 && Hq > 0, "q and the caches need at least one head");
  TORCH_CHECK(k_cache.size(2) == D && Hq % Hkv == 0 && v_cache.sizes() == k_cache.sizes(), "head shapes disagree");
  TORCH_CHECK(tables.size(0) == B && ctx.size(0) == B, "one table and one length per sequence");
  auto tabc = tables.contiguous();
  auto ctxc = ctx.contiguous();
  const int64_t* tab = tabc.data_ptr<int64_t>();
  const int64_t* lens = ctxc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= N * block_size, "context length outside the block table");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tab[b * N + j] >= 0 && (tab[b * N + j] + 1) * block_size <= slots, "block id outside the cache");
  }
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool bf16 = kv_is_bf16(k_cache, v_cache);
#ifdef __AVX512F__
  if (split_path && decode512::supports(D)) {
    auto run = [&](auto nc) {
      constexpr int NC = decltype(nc)::value;
      if (bf16)
        decode512::decode<NC>(qp, kv_data<uint16_t>(k_cache), kv_data<uint16_t>(v_cache), op, tab, lens, B, Hq, Hkv, N,
                              block_size, sc);
      else
        decode512::decode<NC>(qp, kv_data<float>(k_cache), kv_data<float>(v_cache), op, tab, lens, B, Hq, Hkv, N,
                              block_size, sc);
    };
    if (D == 32) run(std::integral_constant<int, 2>{});
    else if (D == 64) run(std::integral_constant<int, 4>{});
    else run(std::integral_constant<int, 8>{});
    return out;
  }
#endif
  if (bf16)
    decode(qp, kv_data<uint16_t>(k_cache), kv_data<uint16_t>(v_cache), op, tab, lens, B, Hq, Hkv, D, N, block_size, sc);
  else
    decode(qp, kv_data<float>(k_cache), kv_data<float>(v_cache), op, tab, lens, B, Hq, Hkv, D, N, block_size, sc);
  return out;
}

}  // namespace

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables, at::Tensor ctx,
                        int64_t block_size, double scale) {
  return run_decode(q, k_cache, v_cache, tables, ctx, block_size, scale, true);
}

// The per-sequence loop whatever the build and head size: the split path's peer in the tests and
// in `lockgate bench decode`.
at::Tensor paged_decode_loop(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables, at::Tensor ctx,
                             int64_t block_size, double scale) {
  return run_decode(q, k_cache, v_cache, tables, ctx, block_size, scale, false);
}

// Whether paged_decode takes the split path for head size D on this build (tests assert it where
// the CPU has AVX-512, so a dispatch change cannot quietly leave only the loop tested).
bool paged_decode_splits(int64_t D) {
#ifdef __AVX512F__
  return decode512::supports(D);
#else
  (void)D;
  return false;
#endif
}
