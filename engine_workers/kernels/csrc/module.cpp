// The Python module of the engine's CPU kernels (engine_workers/kernels/cpu_kernels.py builds it).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor ctx, int64_t block_size, double scale);
torch::Tensor paged_decode_loop(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor tables, torch::Tensor ctx, int64_t block_size, double scale);
bool paged_decode_splits(int64_t head_size);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale);
bool prefill_f16_values();
torch::Tensor pack_small_m(torch::Tensor w);
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias);
bool bf16_native();
torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor linear_bf16f(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor pack_i8(torch::Tensor w);
torch::Tensor linear_i8(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, int64_t n,
                        c10::optional<torch::Tensor> bias);
torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t n,
                           c10::optional<torch::Tensor> bias);
torch::Tensor block_dequant_t(torch::Tensor packed, int64_t kind, int64_t n, int64_t k);

torch::Tensor pack_i8_pairs(torch::Tensor w);
torch::Tensor int8_mm(torch::Tensor xq, torch::Tensor panels, int64_t n);
bool int8_mm_vector();
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_i8(torch::Tensor x);
std::tuple<torch::Tensor, torch::Tensor> silu_mul_quant_i32(torch::Tensor acc, torch::Tensor xscale,
                                                            torch::Tensor wscale, c10::optional<torch::Tensor> bias);
torch::Tensor dequant_i32(torch::Tensor acc, torch::Tensor xscale, torch::Tensor wscale,
                          c10::optional<torch::Tensor> bias);
bool amx_bf16_built();
torch::Tensor pack_amx_bf16(torch::Tensor w);
torch::Tensor linear_amx_bf16(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as torch's own ops do: the worker's event loop thread
  // keeps serving while the engine thread computes.
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32 q, float32 or bf16 K/V cache, float32 math)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_loop", &paged_decode_loop,
        "paged_decode through its one-task-per-sequence loop on every build and head size (tests, benchmarks)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_splits", &paged_decode_splits,
        "whether paged_decode takes its split-K AVX-512 path for this head size on this build");
  m.def("prefill_attention", &prefill_attention,
        "causal prefill attention of one chunk (CPU; float32 q, float32 or bf16 K/V; float32 math, except Q.K and "
        "P.V of a bf16 cache in float16 where prefill_f16_values())",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_f16_values", &prefill_f16_values,
        "whether prefill_attention was built with AVX512-FP16, so a bf16 cache's Q.K and P.V run in float16");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (in place); RMSNorm(residual) * weight (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate/up projection (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_small_m", &pack_small_m, "pack an nn.Linear weight [N, K] into small_m_linear's panels");
  m.def("small_m_linear", &small_m_linear, "x @ W^T (+ bias) for few rows (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_native", &bf16_native, "whether linear_bf16 was built with AVX512-BF16 (else a slow plain loop)");
  m.def("pack_bf16", &pack_bf16, "pack a weight [N, K] into linear_bf16's bf16 panels");
  m.def("linear_bf16", &linear_bf16, "x @ W^T (+ bias), float32 x and y, bf16 weight panels (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16f", &linear_bf16f, "as linear_bf16, x unrounded and float32 FMAs instead of bf16 dot products",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_i8", &pack_i8, "pack an int8 weight [N, K] into linear_i8's panels");
  m.def("linear_i8", &linear_i8, "x @ (scales * W)^T (+ bias), float32 x and y, int8 weight panels (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_rows_i8", &quantize_rows_i8, "x [M, K] float32 -> (int8 [M, K], scale [M]), symmetric per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequant_i32", &dequant_i32, "int32 [M, N] * xscale[m] * wscale[n] (+ bias) -> float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_quant_i32", &silu_mul_quant_i32,
        "int32 gate|up [M, 2I] -> quantize_rows_i8(silu(gate) * up) with dequant_i32's scaling, one pass",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_i8_pairs", &pack_i8_pairs, "pack an int8 weight [N, K] into int8_mm's k-pair panels");
  m.def("int8_mm", &int8_mm, "xq [M, K] int8 . W^T -> int32 [M, N], exact (the avx2 build's W8A8 GEMM)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_mm_vector", &int8_mm_vector, "whether int8_mm was built with its AVX2 form (else a plain loop)");
  m.def("amx_bf16_built", &amx_bf16_built,
        "whether linear_amx_bf16 was built for AMX tiles (the amx level) and the OS granted tile data");
  m.def("pack_amx_bf16", &pack_amx_bf16, "pack a weight [N, K] into linear_amx_bf16's bf16 tile blocks");
  m.def("linear_amx_bf16", &linear_amx_bf16,
        "bf16(x) @ W^T (+ bias) on AMX tiles, float32 x and y; each output one fixed-order chain over K "
        "(batch-invariant by construction)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_linear", &block_linear, "x @ W^T (+ bias), float32 x and y, W in packed Q4_1 / Q8_0 blocks (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("block_dequant_t", &block_dequant_t, "the float32 W^T [K, N] of packed Q4_1 / Q8_0 blocks (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
