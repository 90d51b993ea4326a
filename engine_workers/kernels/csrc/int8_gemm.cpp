// The avx2 build's int8 GEMM for --quantization w8a8: acc[M, N] int32 = xq[M, K] . W[N, K]^T, both
// int8, the sums exact (engine_workers/kernels/w8a8_linear.py uses it at the avx2 ISA level instead
// of torch._int_mm).
//
// Why its own: without VNNI, oneDNN's int8 GEMM multiplies with vpmaddubsw, whose int16 pair sums
// saturate (u8 x s8 pairs reach 2 x 255 x 127 > 32767), so its int32 results are not the exact
// sums (with ONEDNN_MAX_CPU_ISA=AVX2 the load-time check of w8a8_linear.py caught it). Here both
// operands are widened to int16 and multiplied with vpmaddwd: int16 x int16 pair sums of values
// within +-127 are at most 32258, exact in its int32 lanes, and K x 127^2 fits int32 for any K below
// 133,000. Exact integer sums: the result equals the reference in any order, so it is batch
// invariant and equal to the avx512 build's.
//
// Layout: W packed once (pack_i8_pairs) into panels [P][K2][96][2] int8 (K2 = ceil(K / 2), odd K
// and N past the last panel zero-padded): a k pair side by side per column, as the bf16 panels.
// x is packed per call into int16 pairs, one int32 per (row, k pair). A tile of R <= 4 rows runs
// the panel's 96 columns in 4 strips of 24 (R x 3 int32 accumulators, 16 ymm registers), per k
// pair: 3 loads of 16 bytes widened (vpmovsxbw) to 8 columns' int16 pairs, one broadcast x pair
// per row, one vpmaddwd + vpaddd per (row, vector). k blocks of KB2 pairs (24 KiB of panel) are
// reused from L1 by every row tile; partial sums go through the output between blocks.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "avx2_tile.h"
#include "cpu_check.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t NR = 96;    // columns per panel
constexpr int64_t MR = 4;     // rows per tile
constexpr int64_t KB2 = 128;  // k pairs per block: 128 x 96 x 2 bytes = 24 KiB

#ifdef LOCKGATE_AVX2
template <int R>
void tile(const int32_t* __restrict xp, int64_t ldx, const int8_t* __restrict panel, int64_t kn, int32_t* __restrict y,
          int64_t ldy, int64_t ncols, bool first) {
  for (int64_t c0 = 0; c0 < ncols; c0 += avx2::STRIP) {
    __m256i mk[3], acc[R][3];
    for (int v = 0; v < 3; ++v) mk[v] = avx2::lane_mask(ncols - c0 - 8 * v);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 3; ++v)
        acc[r][v] = first ? _mm256_setzero_si256() : _mm256_maskload_epi32(y + r * ldy + c0 + 8 * v, mk[v]);
    for (int64_t k = 0; k < kn; ++k) {
      const int8_t* w = panel + k * NR * 2 + 2 * c0;
      __m256i wv[3];
      for (int v = 0; v < 3; ++v)
        wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * v)));
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(xp[r * ldx + k]);
        for (int v = 0; v < 3; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(xb, wv[v]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 3; ++v) _mm256_maskstore_epi32(y + r * ldy + c0 + 8 * v, mk[v], acc[r][v]);
  }
}
#else
template <int R>
void tile(const int32_t* __restrict xp, int64_t ldx, const int8_t* __restrict panel, int64_t kn, int32_t* __restrict y,
          int64_t ldy, int64_t ncols, bool first) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) {
      int32_t s = first ? 0 : y[r * ldy + c];
      for (int64_t k = 0; k < kn; ++k) {
        const int32_t xw = xp[r * ldx + k];
        const int16_t x0 = static_cast<int16_t>(xw & 0xFFFF), x1 = static_cast<int16_t>(xw >> 16);
        s += x0 * panel[k * NR * 2 + 2 * c] + x1 * panel[k * NR * 2 + 2 * c + 1];
      }
      y[r * ldy + c] = s;
    }
}
#endif

}  // namespace

// W [N, K] int8 -> panels [P, K2, 96, 2] int8, zero-padded past N and K.
at::Tensor pack_i8_pairs(at::Tensor w) {
  check_cpu("w", w);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "weight must be a 2-D int8 tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR, K2 = (K + 1) / 2;
  auto padded = at::zeros({P * NR, K2 * 2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({P, NR, K2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// xq [M, K] int8 contiguous, panels from pack_i8_pairs, n = the weight's real N -> int32 [M, n].
at::Tensor int8_mm(at::Tensor xq, at::Tensor panels, int64_t n) {
  check_cpu("xq", xq, "panels", panels);
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "xq must be contiguous [M, K] int8");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == 2 && panels.scalar_type() == at::kChar &&
                  panels.is_contiguous(),
              "panels must come from pack_i8_pairs");
  const int64_t M = xq.size(0), K = xq.size(1), P = panels.size(0), K2 = panels.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "xq has ", K, " features, the weight ", 2 * K2, " (padded)");
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "n=", n, " does not match ", P, " panels");
  auto y = at::empty({M, n}, xq.options().dtype(at::kInt));
  if (M == 0) return y;
  // x as int16 pairs (low half: even k), odd K padded with a zero
  std::vector<int32_t> xb(static_cast<size_t>(M * K2));
  const int8_t* x = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K2; ++k) {
      const int16_t x0 = x[m * K + 2 * k], x1 = 2 * k + 1 < K ? x[m * K + 2 * k + 1] : 0;
      xb[m * K2 + k] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(x0)) |
                                            (static_cast<uint32_t>(static_cast<uint16_t>(x1)) << 16));
    }
  const int8_t* wp = panels.data_ptr<int8_t>();
  int32_t* yp = y.data_ptr<int32_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * NR, ncols = std::min<int64_t>(NR, n - c0);
      for (int64_t kb = 0; kb < K2; kb += KB2) {
        const int64_t kn = std::min<int64_t>(KB2, K2 - kb);
        const int8_t* block = wp + (p * K2 + kb) * NR * 2;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          const int32_t* xr = xb.data() + m0 * K2 + kb;
          int32_t* yr = yp + m0 * n + c0;
          switch (std::min<int64_t>(MR, M - m0)) {
            case 4: tile<4>(xr, K2, block, kn, yr, n, ncols, kb == 0); break;
            case 3: tile<3>(xr, K2, block, kn, yr, n, ncols, kb == 0); break;
            case 2: tile<2>(xr, K2, block, kn, yr, n, ncols, kb == 0); break;
            default: tile<1>(xr, K2, block, kn, yr, n, ncols, kb == 0); break;
          }
        }
      }
    }
  });
  return y;
}

// Whether int8_mm has its AVX2 form in this build (else a plain loop: exact, slow).
bool int8_mm_vector() {
#ifdef LOCKGATE_AVX2
  return true;
#else
  return false;
#endif
}
