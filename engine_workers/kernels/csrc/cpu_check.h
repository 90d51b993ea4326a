// Every kernel here reads its tensors through raw host pointers, so each entry point refuses a
// tensor on any other device (CUDA, meta) by name, instead of reading device memory as if it were
// the host's. The engine never passes one (its CUDA path does not use these kernels); a library
// caller could. check_cpu("q", q, "k", k, "bias", bias, ...): a missing optional passes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <utility>

inline void check_cpu() {}
template <class... Rest>
inline void check_cpu(const char* name, const at::Tensor& t, Rest&&... rest);
template <class... Rest>
inline void check_cpu(const char* name, const c10::optional<at::Tensor>& t, Rest&&... rest);

template <class... Rest>
inline void check_cpu(const char* name, const at::Tensor& t, Rest&&... rest) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor (a CPU kernel reads host memory), got one on ",
              t.device());
  check_cpu(std::forward<Rest>(rest)...);
}

template <class... Rest>
inline void check_cpu(const char* name, const c10::optional<at::Tensor>& t, Rest&&... rest) {
  if (t.has_value()) check_cpu(name, *t);
  check_cpu(std::forward<Rest>(rest)...);
}
