// The product of a few rows of float32 activations with an int8 weight, on the CPU: the `cpu`
// kernel of model/quantize.py's Int8Linear (y = (x @ weight^T) * scale), registered as the torch
// operator attnlab::int8_linear_cpu, so a compiled decode step that takes it calls it from
// inductor's C++ wrapper (a packed step takes torch's kernel by default: Int8Linear.product_for).
//
// Decoding multiplies 1 to 16 rows of activations by each weight: the weight's bytes set the pace,
// and the activations stay float32 (no conversion of them to bfloat16 and back, as torch's int8
// weight-only kernel needs). Each output is the dot product of an activation row with the output's
// int8 row of the weight: LANES int8 weights at a time are widened to floats and multiplied into
// LANES partial sums (LANES: cpu_vec.h's, 8 with AVX2, 16 with AVX-512), which are summed in a
// fixed order at the end and scaled once. A block of R activation rows by C outputs is computed
// together in registers (R * C sums, R activation vectors, one widened weight vector): each
// weight vector widened once serves the R rows, each activation vector loaded once serves the C
// outputs. Tasks (at::parallel_for) take tiles of TILE outputs, every row of activations for each,
// so a tile's weight bytes are read from memory once whatever the rows.
//
// Legend: N rows of activations, K input width, O outputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../attention/kernels/cpu_vec.h"  // LANES, vf, load, sum_lanes, multiply_add, grain_of_tasks (and immintrin.h)

namespace {

using attnlab_cpu::LANES;
using attnlab_cpu::load;
using attnlab_cpu::multiply_add;
using attnlab_cpu::sum_lanes;
using attnlab_cpu::vf;

typedef int8_t vb __attribute__((vector_size(LANES)));  // LANES int8 weights

constexpr int64_t MAX_ROWS = 4;  // activation rows in one register block
constexpr int64_t TILE = 24;     // outputs a task takes at a time: a multiple of every block's C

// outputs computed together beside R activation rows: R * C sums, R activation vectors and one
// weight vector within AVX2's 16 vector registers
constexpr int outputs_beside(int rows) { return rows == 1 ? 8 : rows == 2 ? 6 : rows == 3 ? 4 : 2; }

// LANES int8 weights at p as floats (vpmovsxbd and vcvtdq2ps; GCC's vector conversions make the
// widening one lane at a time)
inline vf widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  vb bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(__builtin_convertvector(bytes, attnlab_cpu::vi), vf);
#endif
}

struct Product {
  const float* x;  // [N, K], rows x_stride apart
  int64_t x_stride;
  const int8_t* weight;  // [O, K] contiguous
  const float* scale;    // [O]
  float* y;              // [N, O] contiguous
  int64_t n_rows, width, n_outputs;
};

// y[row .. row + R, output .. output + C] of the product
template <int R, int C>
void block(const Product& p, int64_t row, int64_t output) {
  vf sums[R][C] = {};
  const float* x = p.x + row * p.x_stride;
  const int8_t* w = p.weight + output * p.width;
  int64_t k = 0;
  for (; k + LANES <= p.width; k += LANES) {
    vf activations[R];
    for (int r = 0; r < R; ++r) activations[r] = load(x + r * p.x_stride + k);
    for (int c = 0; c < C; ++c) {
      const vf weights = widen(w + c * p.width + k);
      for (int r = 0; r < R; ++r) sums[r][c] = multiply_add(activations[r], weights, sums[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float total = sum_lanes(sums[r][c]);
      for (int64_t j = k; j < p.width; ++j) total += x[r * p.x_stride + j] * static_cast<float>(w[c * p.width + j]);
      p.y[(row + r) * p.n_outputs + output + c] = total * p.scale[output + c];
    }
  }
}

// outputs [begin, end) for rows [row, row + R): blocks of C outputs, then one at a time
template <int R>
void rows_over(const Product& p, int64_t row, int64_t begin, int64_t end) {
  constexpr int C = outputs_beside(R);
  int64_t output = begin;
  for (; output + C <= end; output += C) block<R, C>(p, row, output);
  for (; output < end; ++output) block<R, 1>(p, row, output);
}

void outputs_over(const Product& p, int64_t begin, int64_t end) {
  int64_t row = 0;
  for (; row + MAX_ROWS <= p.n_rows; row += MAX_ROWS) rows_over<MAX_ROWS>(p, row, begin, end);
  switch (p.n_rows - row) {
    case 3: rows_over<3>(p, row, begin, end); break;
    case 2: rows_over<2>(p, row, begin, end); break;
    case 1: rows_over<1>(p, row, begin, end); break;
    default: break;
  }
}

// x [N, K] float32 (rows any stride apart, each contiguous), weight [O, K] int8, scale [O] float32
// -> [N, O] float32
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& weight_in, const at::Tensor& scale_in) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear_cpu: float32 activations [N, K] only");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kChar && weight_in.size(1) == x.size(1),
              "int8_linear_cpu: an int8 weight [O, K] of the activations' width");
  TORCH_CHECK(scale_in.dim() == 1 && scale_in.scalar_type() == at::kFloat && scale_in.size(0) == weight_in.size(0),
              "int8_linear_cpu: one float32 scale per output");
  const at::Tensor activations = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor weight = weight_in.contiguous(), scale = scale_in.contiguous();
  const int64_t n_rows = activations.size(0), width = activations.size(1), n_outputs = weight.size(0);
  at::Tensor y = at::empty({n_rows, n_outputs}, activations.options());
  if (n_rows == 0 || n_outputs == 0) return y;
  const Product p{activations.data_ptr<float>(), activations.stride(0), weight.data_ptr<int8_t>(),
                  scale.data_ptr<float>(), y.data_ptr<float>(), n_rows, width, n_outputs};
  const int64_t n_tiles = (n_outputs + TILE - 1) / TILE;
  const int64_t grain = attnlab_cpu::grain_of_tasks(TILE * width * n_rows);  // small products: one thread
  at::parallel_for(0, n_tiles, grain, [&](int64_t first, int64_t last) {
    outputs_over(p, first * TILE, std::min(n_outputs, last * TILE));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) { m.def("int8_linear_cpu(Tensor x, Tensor weight, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("int8_linear_cpu", &int8_linear_cpu); }
