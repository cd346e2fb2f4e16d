// The token at which each row's cumulative distribution passes uniform x its total, on the CPU: the
// draw of generate/distribution.py's token_at (a cumulative sum, then a search of it) in one torch
// operator, attnlab::token_at_cpu, so that a compiled decode step draws its token without two
// library calls, each costing more than the sum itself at a vocabulary of a few hundred.
//
// The running sums are torch's CPU cumsum's, bit for bit: float32 probabilities added in double
// precision, each partial sum rounded to float32. They never decrease, so the first index whose
// sum exceeds the draw is what torch.searchsorted(..., right=True) returns for it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace {

// probs [..., V] float32, uniform [...] float32 in [0, 1) -> [...] int64
at::Tensor token_at_cpu(const at::Tensor& probs_in, const at::Tensor& uniform_in) {
  TORCH_CHECK(probs_in.dim() >= 1 && probs_in.scalar_type() == at::kFloat && uniform_in.scalar_type() == at::kFloat,
              "token_at_cpu: float32 probabilities [..., V] and uniforms [...] only");
  const int64_t n_tokens = probs_in.size(-1);
  const at::Tensor probs = probs_in.contiguous(), uniform = uniform_in.contiguous();
  at::Tensor out = at::empty(probs.sizes().slice(0, probs.dim() - 1), probs.options().dtype(at::kLong));
  const int64_t n_rows = out.numel();
  TORCH_CHECK(uniform.numel() == n_rows, "token_at_cpu: one uniform per row of probabilities");
  const float* p = probs.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  int64_t* token = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < n_rows; ++row) {
    const float* q = p + row * n_tokens;
    double sum = 0.0;
    for (int64_t i = 0; i < n_tokens; ++i) sum += q[i];
    const float total = static_cast<float>(sum);
    // below the total, so that rounding never selects past the last likely token (as token_at)
    const float draw = std::min(u[row] * total, std::nextafter(total, 0.0f));
    int64_t index = n_tokens;
    sum = 0.0;
    for (int64_t i = 0; i < n_tokens; ++i) {
      sum += q[i];
      if (static_cast<float>(sum) > draw) {
        index = i;
        break;
      }
    }
    token[row] = index;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) { m.def("token_at_cpu(Tensor probs, Tensor uniform) -> Tensor"); }

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("token_at_cpu", &token_at_cpu); }
