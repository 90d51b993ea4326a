// The two elementwise halves of a W8A8 linear layer (engine_workers/kernels/w8a8_linear.py), around
// torch's int8 GEMM (torch._int_mm: int8 x int8 -> int32, AVX512-VNNI through oneDNN):
//
// * quantize_rows_i8: x[M, K] float32 -> (q[M, K] int8, scale[M] float32), symmetric per row
//   ("per token"): scale = max|x_row| / 127 (at least FLT_MIN), q = round_half_even(x / scale) (an all-zero row gets
//   scale 1 and zeros). Same rounding as torch.round, so the Python reference is exact.
// * dequant_i32: acc[M, N] int32 -> y[M, N] float32, y = acc * xscale[m] * wscale[n] (+ bias[n]).
// * silu_mul_quant_i32: an MLP's gate|up sums acc[M, 2I] -> the down projection's int8 input:
//   dequant_i32, silu(gate) * up and quantize_rows_i8 in one pass, one row in cache at a time
//   (unfused, a 1,024-token chunk writes and rereads ~36 MB per layer between the three passes).
//
// Why here and not in torch ops: each is one pass over its tensor instead of four or five (abs,
// amax, div, round, cast; cast, two muls, add), which matters because the int8 GEMM between them is
// ~4x faster than float32 and the elementwise passes would otherwise be a third of the layer.
// Rows are split over torch's pool. The quantize loop is AVX-512 where the CPU has it (GCC leaves
// nearbyintf a scalar call, which made that pass cost a third of the GEMM), plain C++ otherwise;
// both round half to even in the default rounding mode. The dequant loop is plain C++ that GCC
// vectorises (-O3 -march=native -ffast-math).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "avx2_tile.h"

#include "silu_mul.h"
#include "cpu_check.h"

namespace {

// q[0, k) = round_half_even(row / scale) clamped to +-127, scale = max(max|row| / 127, FLT_MIN)
// (1 for a zero row); returns the scale.
float quantize_row(const float* __restrict row, int64_t k, int8_t* __restrict out) {
  int64_t j = 0;
  float amax = 0.f;
#ifdef __AVX512F__
  __m512 vmax = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + j)));
  amax = _mm512_reduce_max_ps(vmax);
#elif defined(LOCKGATE_AVX2)
  const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (; j + 8 <= k; j += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(row + j), nosign));
  amax = avx2::hmax(vmax);  // max is exact in any order: the same scale as the AVX-512 loop
#endif
  for (; j < k; ++j) amax = std::fmax(amax, std::fabs(row[j]));
  // at least FLT_MIN: a row whose largest magnitude is below 127 * FLT_MIN would otherwise get a
  // subnormal scale and an infinite 1 / scale (w8a8_linear.quantize_rows applies the same floor)
  const float s = amax > 0.f ? std::fmax(amax / 127.f, FLT_MIN) : 1.f;
  const float inv = 1.f / s;
  j = 0;
#ifdef __AVX512F__
  // clamped as floats, then cvtps_epi32 rounds in the current mode (nearest, ties to even), as
  // nearbyintf below
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; j + 16 <= k; j += 16) {
    const __m512 x = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(_mm512_loadu_ps(row + j), vinv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
  }
#elif defined(LOCKGATE_AVX2)
  // the same rounding; the int32 lanes are within +-127, so the saturating packs change nothing
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; j + 8 <= k; j += 8) {
    const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(row + j), vinv)));
    const __m256i i32 = _mm256_cvtps_epi32(x);
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packs_epi16(i16, i16));
  }
#endif
  // |row[j] * inv| <= 127 up to rounding of inv; the clamp keeps a 127.00001 from wrapping
  for (; j < k; ++j) out[j] = (int8_t)std::fmin(127.f, std::fmax(-127.f, nearbyintf(row[j] * inv)));
  return s;
}

// out[j] = a[j] * s * ws[j] (+ bias[j]) for j < n: one row of dequant_i32.
inline void dequant_row(const int32_t* __restrict a, float s, const float* __restrict ws, const float* bias, int64_t n,
                        float* __restrict out) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) out[j] = (float)a[j] * s * ws[j] + bias[j];
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = (float)a[j] * s * ws[j];
  }
}

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* what) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, what,
              ": bias must be float32 with N elements");
  return bias->data_ptr<float>();
}

void check_scales(const at::Tensor& acc, const at::Tensor& xscale, const at::Tensor& wscale, const char* what) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(), what,
              ": acc must be a contiguous int32 [M, N] tensor");
  TORCH_CHECK(xscale.scalar_type() == at::kFloat && xscale.is_contiguous() && xscale.numel() == acc.size(0), what,
              ": xscale must be float32 with M elements");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == acc.size(1), what,
              ": wscale must be float32 with N elements");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_i8(at::Tensor x) {
  check_cpu("x", x);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quantize_rows_i8: x must be a contiguous float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sp[i] = quantize_row(xp + i * k, k, qp + i * k);
  });
  return {q, scale};
}

at::Tensor dequant_i32(at::Tensor acc, at::Tensor xscale, at::Tensor wscale, c10::optional<at::Tensor> bias) {
  check_cpu("acc", acc, "xscale", xscale, "wscale", wscale, "bias", bias);
  check_scales(acc, xscale, wscale, "dequant_i32");
  const int64_t m = acc.size(0), n = acc.size(1);
  const float* bp = checked_bias(bias, n, "dequant_i32");
  at::Tensor y = at::empty({m, n}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = xscale.data_ptr<float>();
  const float* ws = wscale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(ap + i * n, xs[i], ws, bp, n, yp + i * n);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_quant_i32(at::Tensor acc, at::Tensor xscale, at::Tensor wscale,
                                                      c10::optional<at::Tensor> bias) {
  check_cpu("acc", acc, "xscale", xscale, "wscale", wscale, "bias", bias);
  check_scales(acc, xscale, wscale, "silu_mul_quant_i32");
  TORCH_CHECK(acc.size(1) % 2 == 0, "silu_mul_quant_i32: acc must be [M, 2I]");
  const int64_t m = acc.size(0), n = acc.size(1), I = n / 2;
  const float* bp = checked_bias(bias, n, "silu_mul_quant_i32");
  at::Tensor q = at::empty({m, I}, acc.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = xscale.data_ptr<float>();
  const float* ws = wscale.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), h(I);  // one row's dequantized gate|up, then its gated product
    for (int64_t i = begin; i < end; ++i) {
      // the same row functions as dequant_i32, then fused_elementwise's silu_mul
      dequant_row(ap + i * n, xs[i], ws, bp, n, g.data());
      silu_mul_row(g.data(), g.data() + I, h.data(), I);
      sp[i] = quantize_row(h.data(), I, qp + i * I);
    }
  });
  return {q, scale};
}
