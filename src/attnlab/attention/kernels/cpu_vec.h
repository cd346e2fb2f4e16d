// Vector helpers shared by the CPU kernels (attention's, and model/'s products): GCC/Clang vector
// extensions of 16 floats, loads and stores, a fused multiply-add, a fixed-order lane sum and a
// vectorised exp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace attnlab_cpu {

// keys (or head-width elements) processed together: one vector register of floats, 16 with
// AVX-512 (a zmm register), else 8 (a ymm register with AVX2: 16 floats would take two, and a
// tile of 8 such accumulators would no longer fit in AVX2's 16 registers)
#if defined(__AVX512F__)
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif

// GCC/Clang vector extensions: one vector of LANES floats
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// every lane `value`: one broadcast, from memory where the value is read there (`vf{} + value`
// would first add 0.0f, an add the compiler must keep since -0.0f + 0.0f is +0.0f, then broadcast
// the register: two instructions more on each activation of a product's inner loop)
inline vf broadcast(float value) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(value));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_set1_ps(value));
#else
  vf v;
  for (int lane = 0; lane < LANES; ++lane) v[lane] = value;
  return v;
#endif
}

// sum + a * b in one rounding where the CPU has fused multiply-add (the compiler does not contract
// a * b + c under ISO C++)
inline vf multiply_add(vf a, vf b, vf sum) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(sum)));
#elif defined(__FMA__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(sum)));
#else
  return a * b + sum;
#endif
}
// torch's grain size for its own elementwise loops (at::internal::GRAIN_SIZE, ATen/TensorIterator.h),
// counted in multiply-adds by the products' kernels: the tasks of at::parallel_for's grain when each
// task does `multiply_adds` of them, so that a product smaller than GRAIN_SIZE runs on the calling
// thread
constexpr int64_t GRAIN_SIZE = 32768;
inline int64_t grain_of_tasks(int64_t multiply_adds) {
  return multiply_adds >= GRAIN_SIZE ? 1 : GRAIN_SIZE / (multiply_adds > 0 ? multiply_adds : 1);
}

template <class V>
inline float sum_lanes(V v) {  // a fixed order; V: a vector of floats of any width (vf, or narrower)
  float total = 0.0f;
  for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(float)); ++l) total += v[l];
  return total;
}

// <a, b> over dim floats: 16 lanes of multiply-add chains, their fixed-order sum, then the tail
inline float dot(const float* a, const float* b, int64_t dim) {
  vf acc = {};
  int64_t d = 0;
  for (; d + LANES <= dim; d += LANES) acc += load(a + d) * load(b + d);
  float total = sum_lanes(acc);
  for (; d < dim; ++d) total = std::fma(a[d], b[d], total);
  return total;
}

// exp for x <= 0 (softmax arguments), a vector at a time (vf, or a narrower vector of floats):
// 2^n * p(r), |error| about 1 ulp; exactly 0 below -87 (where expf is 0 or subnormal).
template <class V>
inline V exp_nonpositive(V x) {
  using Integers = decltype(x < x);  // the int32 vector of V's width
  const V low = V{} - 87.0f;
  const V clamped = x < low ? low : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (clamped * 1.44269504088896341f + shifter) - shifter;
  V r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Integers bits = (__builtin_convertvector(n, Integers) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));  // the bits of 2^n
  return x < low ? V{} : p * scale;
}

}  // namespace attnlab_cpu
