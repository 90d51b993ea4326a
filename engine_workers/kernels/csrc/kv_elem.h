// K/V cache elements: float32, or bf16 stored as raw uint16 bits (the top half of a float32).
// The attention kernels read either kind and widen each element to float32 before any math, so a
// bf16 cache halves the bytes read per token while every score, softmax and sum stays float32
// (--kv-cache-dtype bfloat16; docs/design.md, Precision and devices). Widening is exact: a bf16
// value is a float32 whose low 16 mantissa bits are zero.
#pragma once

#include <ATen/core/Tensor.h>

#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "avx2_tile.h"

inline float widen(float x) { return x; }

inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

#ifdef __AVX512F__
// 16 bf16 values widened to float32 (each to the top half of its lane).
inline __m512 widen16(const uint16_t* src) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

// dst[i] = float(src[i]) for i < n.
inline void widen_row(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen16(src + i));
#elif defined(LOCKGATE_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, avx2::widen8(src + i));
#endif
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

// Ask for the n cache elements from p on, every 64-byte line, at __builtin_prefetch locality L
// (3: into every cache level, as _MM_HINT_T0; 2: into L2 and beyond, as _MM_HINT_T1). Blocks sit
// anywhere in the cache, so the hardware prefetcher cannot see the next one coming.
template <int L, class KV>
inline void prefetch_rows(const KV* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(KV)); off += 64) __builtin_prefetch(c + off, 0, L);
}

// The cache's element pointer, typed for the kernels (the caller has checked the dtype).
template <class KV>
inline const KV* kv_data(const at::Tensor& t) {
  return static_cast<const KV*>(t.data_ptr());
}

// Both caches float32 or both bfloat16; anything else is refused with the dtypes named.
inline bool kv_is_bf16(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "K and V must have one dtype, got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16,
              "K/V must be float32 or bfloat16, got ", k.scalar_type());
  return k.scalar_type() == at::kBFloat16;
}
