// The product of a few rows of float32 activations with a float32 weight packed once, on the CPU:
// the `cpu` linear kernels of a compiled decode step (Transformer.compile_decoding), registered as
// the torch operators attnlab::linear_pack_cpu (the packing, done once when the step compiles) and
// attnlab::linear_cpu (the product, called from inductor's C++ wrapper at every step).
//
// A decode step multiplies a handful of rows (1 a token, gamma + 1 a speculative verification, times
// the batch) by every weight. The weight is packed in panels of PANEL outputs: panel p holds outputs
// [p * PANEL, (p + 1) * PANEL) as K rows of PANEL floats, so the kernel reads a panel front to back
// (zeros pad the last panel). A block of up to ROWS activation rows by one panel is computed in
// registers: ROWS * COLUMNS accumulators of LANES floats, COLUMNS weight vectors and one broadcast
// activation (AVX-512: 6 x 4 = 24 of its 32 registers; AVX2: 6 x 2 = 12 of its 16, the register block
// of BLIS's Haswell kernel). Each weight vector loaded serves ROWS rows, each activation broadcast
// serves COLUMNS vectors, and each sum runs over k in order with fused multiply-adds. Tasks
// (at::parallel_for) take whole panels, every row for each, so every weight is read once a product
// whatever the rows.
//
// Legend: N rows of activations, K input width, O outputs, P panels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "../attention/kernels/cpu_vec.h"  // LANES, vf, load, store, multiply_add

namespace {

using namespace attnlab_cpu;  // LANES, vf and its loads, stores and multiply-adds, grain_of_tasks

#if defined(__AVX512F__)
constexpr int COLUMNS = 4;  // weight vectors of a panel row
#else
constexpr int COLUMNS = 2;
#endif
constexpr int PANEL = COLUMNS * LANES;  // outputs of a panel: 64 with AVX-512, 16 otherwise
constexpr int ROWS = 6;                 // activation rows of a register block
// weight rows of the panel fetched ahead of the one being read: 2 KiB ahead whatever the vector width
// (8 rows of 64 floats with AVX-512, 32 rows of 16 with AVX2), a kernel constant like ROWS
constexpr int64_t PREFETCH_ROWS = 2048 / (PANEL * sizeof(float));

struct Product {
  const float* x;  // [N, K], rows x_stride apart, each contiguous
  int64_t x_stride;
  const float* packed;  // [P, K, PANEL]
  const float* bias;    // [O] or nullptr
  float* y;             // [N, O] contiguous
  int64_t n_rows, width, n_outputs;
};

// y[row .. row + R, the panel's outputs] = x[row .. row + R] @ the panel (+ bias)
template <int R>
void block(const Product& p, int64_t row, int64_t panel) {
  const int64_t first_output = panel * PANEL;
  const int64_t n_valid = std::min<int64_t>(PANEL, p.n_outputs - first_output);
  vf start[COLUMNS] = {};
  if (p.bias != nullptr) {
    float bias[PANEL] = {};
    std::memcpy(bias, p.bias + first_output, n_valid * sizeof(float));
    for (int c = 0; c < COLUMNS; ++c) start[c] = load(bias + c * LANES);
  }
  vf sums[R][COLUMNS];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLUMNS; ++c) sums[r][c] = start[c];
  const float* weights = p.packed + panel * p.width * PANEL;  // [K, PANEL]
  const float* x = p.x + row * p.x_stride;
  for (int64_t k = 0; k < p.width; ++k) {
    // near the panel's end this points past it (into the next panel, or past the last one): a
    // prefetch is a hint that never faults, and a wasted one costs a cache line
    const float* ahead = weights + (k + PREFETCH_ROWS) * PANEL;
    for (int c = 0; c < COLUMNS * LANES; c += 64 / sizeof(float)) __builtin_prefetch(ahead + c, 0, 3);
    vf panel_row[COLUMNS];
    for (int c = 0; c < COLUMNS; ++c) panel_row[c] = load(weights + k * PANEL + c * LANES);
    for (int r = 0; r < R; ++r) {
      const vf activation = broadcast(x[r * p.x_stride + k]);
      for (int c = 0; c < COLUMNS; ++c) sums[r][c] = multiply_add(activation, panel_row[c], sums[r][c]);
    }
  }
  float* y = p.y + row * p.n_outputs + first_output;
  for (int r = 0; r < R; ++r) {
    if (n_valid == PANEL) {
      for (int c = 0; c < COLUMNS; ++c) store(y + r * p.n_outputs + c * LANES, sums[r][c]);
    } else {  // the last panel's padding stays out of y
      float outputs[PANEL];
      for (int c = 0; c < COLUMNS; ++c) store(outputs + c * LANES, sums[r][c]);
      std::memcpy(y + r * p.n_outputs, outputs, n_valid * sizeof(float));
    }
  }
}

// every row of the panel: blocks of ROWS rows, then the rest in one block
void panel_over(const Product& p, int64_t panel) {
  int64_t row = 0;
  for (; row + ROWS <= p.n_rows; row += ROWS) block<ROWS>(p, row, panel);
  switch (p.n_rows - row) {
    case 5: block<5>(p, row, panel); break;
    case 4: block<4>(p, row, panel); break;
    case 3: block<3>(p, row, panel); break;
    case 2: block<2>(p, row, panel); break;
    case 1: block<1>(p, row, panel); break;
    default: break;
  }
}

// weight [O, K] float32 (any strides) -> packed [P, K, PANEL], P = ceil(O / PANEL), zeros past O
at::Tensor linear_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "linear_pack_cpu: a float32 weight [O, K] on the CPU");
  const int64_t n_outputs = weight.size(0), width = weight.size(1);
  const int64_t n_panels = (n_outputs + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({n_panels, width, PANEL}, weight.options());
  const at::Tensor rows = weight.contiguous();
  const float* source = rows.data_ptr<float>();
  float* target = packed.data_ptr<float>();
  for (int64_t output = 0; output < n_outputs; ++output) {
    float* column = target + (output / PANEL) * width * PANEL + output % PANEL;
    for (int64_t k = 0; k < width; ++k) column[k * PANEL] = source[output * width + k];
  }
  return packed;
}

// x [N, K] float32 (rows any stride apart, each contiguous), packed [P, K, PANEL] (linear_pack_cpu's),
// bias [O] or none, outputs O -> [N, O] float32
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed_in, const std::optional<at::Tensor>& bias_in,
                      int64_t n_outputs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_cpu: float32 activations [N, K] only");
  TORCH_CHECK(packed_in.dim() == 3 && packed_in.scalar_type() == at::kFloat && packed_in.size(1) == x.size(1) &&
                  packed_in.size(2) == PANEL && packed_in.size(0) == (n_outputs + PANEL - 1) / PANEL,
              "linear_cpu: a weight packed by linear_pack_cpu (on this build), of the activations' width and ",
              n_outputs, " outputs");
  TORCH_CHECK(!bias_in.has_value() || (bias_in->dim() == 1 && bias_in->size(0) == n_outputs &&
                                       bias_in->scalar_type() == at::kFloat),
              "linear_cpu: a float32 bias of one value per output");
  const at::Tensor activations = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t n_rows = activations.size(0), width = activations.size(1);
  at::Tensor y = at::empty({n_rows, n_outputs}, activations.options());
  if (n_rows == 0 || n_outputs == 0) return y;
  const Product p{activations.data_ptr<float>(), activations.stride(0), packed.data_ptr<float>(),
                  bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), n_rows, width, n_outputs};
  const int64_t n_panels = packed.size(0);
  const int64_t grain = grain_of_tasks(PANEL * width * n_rows);  // small products: one thread
  at::parallel_for(0, n_panels, grain, [&](int64_t first, int64_t last) {
    for (int64_t panel = first; panel < last; ++panel) panel_over(p, panel);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("linear_pack_cpu(Tensor weight) -> Tensor");
  m.def("linear_cpu(Tensor x, Tensor packed, Tensor? bias, int outputs) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("linear_pack_cpu", &linear_pack_cpu);
  m.impl("linear_cpu", &linear_cpu);
}
