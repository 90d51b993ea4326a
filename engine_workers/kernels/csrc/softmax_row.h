// The unnormalised softmax of one row of scores, in place, shared by both decode paths.
#pragma once

#include <math.h>
#include <stdint.h>

// s[i] = exp(s[i] - max s) for i < n (n >= 1); returns the sum, the max in *max_out. Every value
// is <= 1 and finite (the max is subtracted), which -ffast-math's vectorised expf assumes.
inline float exp_shifted(float* __restrict s, int64_t n, float* max_out) {
  float mx = s[0];
  for (int64_t i = 1; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = expf(s[i] - mx);
    sum += s[i];
  }
  *max_out = mx;
  return sum;
}
