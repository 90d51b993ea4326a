// One row of SiLU gating, out[i] = silu(gate[i]) * up[i], shared by fused_elementwise.cpp's
// silu_mul (float32 in and out) and int8_act.cpp's silu_mul_quant_i32 (W8A8's fused hand-off), so
// both compute the same expression. Plain C++ that GCC vectorises (-O3 -ffast-math, glibc's
// vector expf).
#pragma once

#include <math.h>
#include <stdint.h>

inline void silu_mul_row(const float* __restrict gate, const float* __restrict up, float* __restrict out,
                         int64_t n) {
  // exp argument clamped: finite-math builds may not rely on expf overflowing to inf
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + expf(fminf(-gate[i], 88.f))) * up[i];
}
