// Linear layers for decode-sized batches on CPU, float32: y[M, N] = x[M, K] . W^T (+ bias), M small.
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight matrix, so
// it should cost about one pass over the weights at memory bandwidth. oneDNN's packed kernel (used
// for prefill, where it runs near the FMA peak) is close to that at M = 1 but not at M = 8..32,
// where reading and computing do not overlap (docs/benchmarks.md has the per-M figures).
//
// Layout: the weight is packed once, at load, into panels of NR = 96 output columns,
// panels[P][K][96] (P = ceil(N / 96), the last panel zero-padded): each panel is one contiguous
// stream. Outer-product form, no horizontal sums: a tile of MR = 4 rows times the panel's 96
// columns (6 vectors of 16) broadcasts 4 x values per k and does 24 FMAs into 24 of AVX-512's 32
// registers. K is walked in blocks of KB = 64 (24 KiB of panel, L1-resident): every m tile of the
// block reuses it from L1, and while they compute, the next 24 KiB are prefetched, spread evenly
// over the tiles, so the DRAM stream never waits for the FMAs and vice versa.
//
// Panels are split over torch's intra-op pool (at::parallel_for: no second thread pool).
// The avx2 build (ISA levels: engine_workers/kernels/cpu_kernels.py) runs the same tile as four
// 24-column strips (csrc/avx2_tile.h: 16 registers); without either, a plain loop nest computes
// the same. Results differ from oneDNN's only in fp32 summation order.
// ATen's tensor and the few ops used, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) makes each file that includes it several times slower to compile (build
// times in docs/design.md, Paged attention). Only module.cpp binds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "tile.h"
#include "avx2_tile.h"
#include "cpu_check.h"

namespace {

constexpr int64_t NR = 96;  // columns per panel: 6 AVX-512 vectors
constexpr int64_t MR = 4;   // rows per register tile
constexpr int64_t KB = 64;  // k per block: 64 x 96 floats = 24 KiB, L1-resident while the m tiles use it

#ifdef __AVX512F__
template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                 bool first, const char* pf, int64_t pf_lines) {
  __m512 acc[R][6];
  __mmask16 mask[6];
  for (int v = 0; v < 6; ++v) {
    int64_t left = ncols - 16 * v;
    mask[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 6; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], y + r * ldy + 16 * v);
  int64_t line = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * NR;
    if (pf) {
      const int64_t upto = (k + 1) * pf_lines / K;
      for (; line < upto; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T0);
    }
    tile_step<R>(acc, w, [&](int r) { return x[r * ldx + k]; });
  }
  for (int v = 0; v < 6; ++v) {
    if (!mask[v]) break;
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], _mm512_add_ps(acc[r][v], b));
  }
}
#elif defined(LOCKGATE_AVX2)
template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                 bool first, const char* pf, int64_t pf_lines) {
  avx2::tile96<R>(K, y, ldy, ncols, first, nullptr, bias, pf, pf_lines,
                  [&](__m256 (&acc)[R][3], int64_t k, int64_t c0) {
                    const float* w = panel + k * NR + c0;
                    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16);
                    for (int r = 0; r < R; ++r) {
                      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
                      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                      acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
                    }
                  });
}
#else
template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                 bool first, const char* pf, int64_t pf_lines) {
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < NR; ++c) acc[r][c] = (first || c >= ncols) ? 0.f : y[r * ldy + c];
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * NR;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t c = 0; c < NR; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.f);
}
#endif

}  // namespace

// W [N, K] (nn.Linear layout) -> panels [P, K, 96], zero-padded past N.
at::Tensor pack_small_m(at::Tensor w) {
  check_cpu("w", w);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto padded = at::zeros({P * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();  // [P, K, NR]
}

// x [M, K] contiguous, panels from pack_small_m, n = the weight's real N; bias [N] or None.
at::Tensor small_m_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  check_cpu("x", x, "panels", panels, "bias", bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.is_contiguous(), "panels must come from pack_small_m");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "n=", n, " does not match ", P, " panels");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == n, "bias must be float32 [N]");
    b = bias_c.data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (M + MR - 1) / MR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    const float* end = wp + p1 * K * NR;  // this thread's panels end here: prefetch no further
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * K * NR;
      const int64_t c0 = p * NR, ncols = std::min<int64_t>(NR, n - c0);
      for (int64_t kb = 0; kb < K; kb += KB) {
        const int64_t kn = std::min<int64_t>(KB, K - kb);
        const float* block = panel + kb * NR;
        const bool last = kb + kn == K;
        // The next KB*NR floats (next block, or the next panel's first) are fetched while this
        // block's tiles compute, spread evenly over all of them.
        const float* next = block + kn * NR;
        const int64_t lines = next + KB * NR <= end ? KB * NR * 4 / 64 : 0;
        const float* pb = (b && last) ? b + c0 : nullptr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m0 = t * MR;
          const float* xr = xp + m0 * K + kb;
          float* yr = yp + m0 * n + c0;
          const int64_t l0 = t * lines / tiles, l1 = (t + 1) * lines / tiles;
          const char* pf = lines ? reinterpret_cast<const char*>(next) + 64 * l0 : nullptr;
          switch (std::min<int64_t>(MR, M - m0)) {
            case 4: tile<4>(xr, K, block, kn, yr, n, ncols, pb, kb == 0, pf, l1 - l0); break;
            case 3: tile<3>(xr, K, block, kn, yr, n, ncols, pb, kb == 0, pf, l1 - l0); break;
            case 2: tile<2>(xr, K, block, kn, yr, n, ncols, pb, kb == 0, pf, l1 - l0); break;
            default: tile<1>(xr, K, block, kn, yr, n, ncols, pb, kb == 0, pf, l1 - l0); break;
          }
        }
      }
    }
  });
  return y;
}
