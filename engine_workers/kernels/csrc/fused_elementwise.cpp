// Fused elementwise ops of a Llama layer for CPU, float32, one pass over the rows each.
//
// Why: the residual add + RMSNorm is seven torch ops (add, pow, mean, add, rsqrt, mul, mul) and
// SiLU-gating three (split view, silu, mul), each a full pass over the activations with its own
// dispatch and allocation: at decode sizes the per-op overhead dominates, at prefill sizes the
// passes over memory (profile in docs/design.md, "Fused residual add + RMSNorm and SiLU gating").
// Each fused op reads and writes every element once.
//
// add_rms_norm(residual [T, H], delta [T, H] or None, weight [H], eps) -> [T, H]:
//   residual += delta (in place: it is the layer stack's running residual stream), then
//   out = weight * (residual * rsqrt(mean(residual^2) + eps)), HF's LlamaRMSNorm in float32.
// silu_mul(gate_up [T, 2I]) -> [T, I]: silu(gate_up[:, :I]) * gate_up[:, I:].
// Rows are split over torch's intra-op pool; the loops are vectorised by GCC (-O3 -ffast-math).
// ATen's tensor and the few ops used, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) makes each file that includes it several times slower to compile (build
// times in docs/design.md, Paged attention). Only module.cpp binds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <math.h>

#include "silu_mul.h"
#include "cpu_check.h"

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                           double eps) {
  check_cpu("residual", residual, "delta", delta, "weight", weight);
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "residual must be contiguous [T, H] float32");
  const int64_t T = residual.size(0), H = residual.size(1);
  TORCH_CHECK(weight.numel() == H && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "weight must be float32 [H]");
  const float* d = nullptr;
  at::Tensor delta_c;
  if (delta.has_value() && delta->defined()) {
    delta_c = delta->contiguous();
    TORCH_CHECK(delta_c.sizes() == residual.sizes() && delta_c.scalar_type() == at::kFloat,
                "delta must match the residual");
    d = delta_c.data_ptr<float>();
  }
  auto out = at::empty_like(residual);
  float* x = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = (float)eps;
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = x + t * H;
      float* orow = o + t * H;
      if (d) {
        const float* dr = d + t * H;
        for (int64_t i = 0; i < H; ++i) xr[i] += dr[i];
      }
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / sqrtf(ss / (float)H + e);
      for (int64_t i = 0; i < H; ++i) orow[i] = w[i] * (xr[i] * r);
    }
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_cpu("gate_up", gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == at::kFloat &&
              gate_up.size(1) % 2 == 0, "gate_up must be contiguous [T, 2I] float32");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gr = g + t * 2 * I;
      silu_mul_row(gr, gr + I, o + t * I, I);
    }
  });
  return out;
}
