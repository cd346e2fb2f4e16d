// Block-listed attention on the CPU, for native sparse attention's three branches.
//
// Every query token t of a (batch, key/value head) pair bg has a list of n key blocks (block m:
// key tokens m*block .. m*block + block - 1; -1: an empty slot) and is attended by its group's R
// query heads. It sees the keys of its blocks at positions lo_t .. pos_t, lo_t = pos_t - window + 1
// with a window, else 0. The compressed branch lists the blocks of compressed keys up to its last
// visible one (implicitly: Shape::prefix) and, in the same pass, chooses the query's selection
// blocks (choose_blocks); the selected branch lists those, causally; the sliding branch lists the
// blocks covering its window. An optional gate per (query, slot) multiplies the probabilities of
// the slot's keys after normalisation (NSA's straight-through selection gates).
//
// Layouts (contiguous float32): q, out, grad_q, grad_out [B G, T, R, D]; k, v, grad_k, grad_v
// [B G, S, D]; blocks, gates, grad_gates [B G, T, n]; lse [B G, T, R]; positions [T].
//
// The keys and values are first copied transposed per block, [B G, M, D, width] (width: block
// rounded up to whole vectors of LANES floats), so a query head's scores for a block are one
// vector multiply-add chain over d: no horizontal sums. Each query is computed on its own keys
// only (its blocks, in slot order), so its output does not depend on any other key, bit for bit:
// the selection, not the kernel, decides what a query reads.
//
// Threads: the forward runs queries in parallel. The backward runs (bg, part of the queries) in
// parallel, each adding its key/value gradients into buffers of its own, laid out like the
// transposed keys (LANES positions of a block per vector), summed in part order into grad_k and
// grad_v at the end.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#include "nsa_select.h"

namespace {

using namespace attnlab_cpu;

constexpr int64_t MAX_HEADS = 64;  // query heads per key/value head (nsa_cpu.py refuses more)

struct Shape {
  int64_t bg, T, R, D, S, n, block, window;  // window 0: no lower bound
  int64_t prefix;  // 1: every query lists blocks 0 .. position / block (`blocks` is not read)
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// x [B G, S, D] -> [B G, M, D, width] zero-padded (keys past S and past the block: zero)
std::vector<float> transpose_blocks(const float* x, const Shape& s, int64_t width) {
  const int64_t M = (s.S + s.block - 1) / s.block;
  std::vector<float> out(s.bg * M * s.D * width, 0.0f);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bg = 0; bg < s.bg; ++bg)
    for (int64_t m = 0; m < M; ++m) {
      float* dst = out.data() + (bg * M + m) * s.D * width;
      for (int64_t j = 0; j < s.block && m * s.block + j < s.S; ++j) {
        const float* src = x + (bg * s.S + m * s.block + j) * s.D;
        for (int64_t d = 0; d < s.D; ++d) dst[d * width + j] = src[d];
      }
    }
  return out;
}

// The visible keys of one query: its slots that see at least one key, in slot order (count of
// them), each with its slot number, block and range lo .. hi (inclusive) of positions in the block.
// Scores and probabilities are laid out by these active slots: [R][count * width].
struct Visible {
  int64_t count;
  int64_t slot[64], block[64];
  int64_t lo[64], hi[64];
};

void visible_of(const int64_t* blocks, int64_t pos, const Shape& s, Visible& out) {
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
  const int64_t last = std::min(pos, s.S - 1);
  out.count = 0;
  for (int64_t i = 0; i < s.n; ++i) {
    const int64_t m = s.prefix ? (i * s.block <= pos ? i : -1) : blocks[i];
    if (m < 0) continue;
    const int64_t start = m * s.block;
    const int64_t lo = std::max<int64_t>(0, first - start), hi = std::min<int64_t>(s.block - 1, last - start);
    if (hi < lo) continue;
    const int64_t a = out.count++;
    out.slot[a] = i, out.block[a] = m, out.lo[a] = lo, out.hi[a] = hi;
  }
}

constexpr int CHAINS = 8;  // independent multiply-add chains interleaved (hides the FMA latency)

// acc[c] = sum_d q_of[c][d] * k_of[c][d * width .. + LANES]: C chains, in registers (C is a
// compile-time count), one multiply-add chain over d each
template <int C>
void score_chains(const float* const* q_of, const float* const* k_of, int64_t dim, int64_t width, vf* acc) {
  vf a[C] = {};
  for (int64_t d = 0; d < dim; ++d)
    for (int c = 0; c < C; ++c) a[c] += q_of[c][d] * load(k_of[c] + d * width);
  for (int c = 0; c < C; ++c) acc[c] = a[c];
}

// acc[c] = sum over the visible keys, slot by slot in order, of w_of[c][slot * width + j] *
// x[key][d_of[c] .. + LANES]: C chains in registers
template <int C>
void combine_chains(const float* const* w_of, const int64_t* d_of, const float* x, const Visible& vis,
                    int64_t block, int64_t dim, int64_t width, vf* acc) {
  vf a[C] = {};
  for (int64_t i = 0; i < vis.count; ++i)
    for (int64_t j = vis.lo[i]; j <= vis.hi[i]; ++j) {
      const float* row = x + (vis.block[i] * block + j) * dim;
      const int64_t at = i * width + j;
      for (int c = 0; c < C; ++c) a[c] += w_of[c][at] * load(row + d_of[c]);
    }
  for (int c = 0; c < C; ++c) acc[c] = a[c];
}

using ScoreChains = void (*)(const float* const*, const float* const*, int64_t, int64_t, vf*);
using CombineChains = void (*)(const float* const*, const int64_t*, const float*, const Visible&, int64_t, int64_t,
                               int64_t, vf*);
const ScoreChains score_chains_of[CHAINS + 1] = {nullptr, score_chains<1>, score_chains<2>, score_chains<3>,
                                                 score_chains<4>, score_chains<5>, score_chains<6>, score_chains<7>,
                                                 score_chains<8>};
const CombineChains combine_chains_of[CHAINS + 1] = {
    nullptr, combine_chains<1>, combine_chains<2>, combine_chains<3>, combine_chains<4>,
    combine_chains<5>, combine_chains<6>, combine_chains<7>, combine_chains<8>};

// scores[r][a * width + j] = scale * <rows[r], keys of active slot a, position j> (transposed keys
// kt of this bg), -inf outside the visible range; one multiply-add chain over d per score. The
// chains of up to CHAINS (head, slot) pairs run interleaved.
void slot_scores(const float* rows, int64_t R, const float* kt, const Visible& vis, const Shape& s, int64_t width,
                 float scale, float* scores) {
  const int64_t ld = s.n * width, pairs = R * vis.count;
  vi lane;
  for (int l = 0; l < LANES; ++l) lane[l] = l;
  const vf inf = vf{} - INFINITY;
  for (int64_t j0 = 0; j0 < width; j0 += LANES) {
    const vi j = lane + int32_t(j0);
    for (int64_t p0 = 0; p0 < pairs; p0 += CHAINS) {
      const int count = int(std::min<int64_t>(CHAINS, pairs - p0));
      const float* q_of[CHAINS];
      const float* k_of[CHAINS];
      float* out_of[CHAINS];
      int64_t slot_of[CHAINS];
      for (int c = 0; c < count; ++c) {
        const int64_t r = (p0 + c) / vis.count, i = (p0 + c) % vis.count;
        q_of[c] = rows + r * s.D;
        k_of[c] = kt + vis.block[i] * s.D * width + j0;
        out_of[c] = scores + r * ld + i * width + j0;
        slot_of[c] = i;
      }
      vf acc[CHAINS];
      score_chains_of[count](q_of, k_of, s.D, width, acc);
      for (int c = 0; c < count; ++c) {
        const int64_t i = slot_of[c];
        store(out_of[c], (j >= int32_t(vis.lo[i]) && j <= int32_t(vis.hi[i])) ? acc[c] * scale : inf);
      }
    }
  }
}

// probs[r][0 .. used) = exp(scores - shift_r) (0 where a score is -inf), in place
void exponentiate(float* scores, int64_t R, int64_t ld, int64_t used, const float* shifts) {
  for (int64_t r = 0; r < R; ++r) {
    float* p = scores + r * ld;
    const float shift = std::isfinite(shifts[r]) ? shifts[r] : 0.0f;
    for (int64_t j0 = 0; j0 < used; j0 += LANES) store(p + j0, exp_nonpositive(load(p + j0) - shift));
  }
}

// out[r][:] = sum over visible keys of weights[r][key] * x[key][:], slot by slot in order: one
// multiply-add chain per element, up to CHAINS (head, LANES elements) chains interleaved
void combine(const float* weights, int64_t R, const float* x, const Visible& vis, const Shape& s, int64_t width,
             float* out) {
  const int64_t ld = s.n * width, chunks = s.D / LANES, pairs = R * chunks;
  for (int64_t p0 = 0; p0 < pairs; p0 += CHAINS) {
    const int count = int(std::min<int64_t>(CHAINS, pairs - p0));
    const float* w_of[CHAINS];
    int64_t d_of[CHAINS];
    for (int c = 0; c < count; ++c) {
      w_of[c] = weights + (p0 + c) / chunks * ld;
      d_of[c] = (p0 + c) % chunks * LANES;
    }
    vf acc[CHAINS];
    combine_chains_of[count](w_of, d_of, x, vis, s.block, s.D, width, acc);
    for (int c = 0; c < count; ++c) store(out + (p0 + c) / chunks * s.D + d_of[c], acc[c]);
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d0 = chunks * LANES; d0 < s.D; ++d0) {  // explicit fused multiply-adds: the same rounding however compiled
      float acc = 0.0f;
      for (int64_t i = 0; i < vis.count; ++i)
        for (int64_t j = vis.lo[i]; j <= vis.hi[i]; ++j)
          acc = std::fma(weights[r * ld + i * width + j], x[(vis.block[i] * s.block + j) * s.D + d0], acc);
      out[r * s.D + d0] = acc;
    }
}

// The key (or value) gradients of one query, added into a transposed buffer [M, D, width] (like
// transpose_blocks' layout): for every active slot, position j and d,
//   buffer[block][d][j] += sum_r weights[r][slot, j] * sources[r][d],
// LANES positions at a time (one vector of weights per head, zero where the query sees no key).
// Element by element the terms are added in head order, query after query.
template <int RC>
void accumulate_heads(const float* weights, int64_t R, const float* sources, const Visible& vis, const Shape& s,
                      int64_t width, float* buffer) {
  const int64_t ld = s.n * width, heads = RC > 0 ? RC : R;
  vf w[RC > 0 ? RC : MAX_HEADS];  // the heads' weights of LANES positions (registers when RC is known)
  for (int64_t a = 0; a < vis.count; ++a)
    for (int64_t j0 = 0; j0 < width; j0 += LANES) {
      for (int64_t r = 0; r < heads; ++r) w[r] = load(weights + r * ld + a * width + j0);
      float* column = buffer + vis.block[a] * s.D * width + j0;
      for (int64_t d = 0; d < s.D; ++d) {
        vf acc = load(column + d * width);
        for (int64_t r = 0; r < heads; ++r) acc += w[r] * sources[r * s.D + d];
        store(column + d * width, acc);
      }
    }
}

void accumulate(const float* weights, int64_t R, const float* sources, const Visible& vis, const Shape& s,
                int64_t width, float* buffer) {
  switch (R) {
    case 1: return accumulate_heads<1>(weights, R, sources, vis, s, width, buffer);
    case 2: return accumulate_heads<2>(weights, R, sources, vis, s, width, buffer);
    case 4: return accumulate_heads<4>(weights, R, sources, vis, s, width, buffer);
    case 8: return accumulate_heads<8>(weights, R, sources, vis, s, width, buffer);
    default: return accumulate_heads<0>(weights, R, sources, vis, s, width, buffer);
  }
}

// weights *= the slot's gate (in place), active slot by active slot
void apply_gates(float* weights, int64_t R, const float* gates, const Visible& vis, const Shape& s, int64_t width) {
  const int64_t ld = s.n * width;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < vis.count; ++i)
      for (int64_t j0 = 0; j0 < width; j0 += LANES) {
        float* w = weights + r * ld + i * width + j0;
        store(w, load(w) * gates[vis.slot[i]]);
      }
}

// The straight-through gradient of one query's selection scores, as extra gradient of its
// compressed probabilities: coef[1 + i] = sum over its chosen slots of grad_scores[slot] times
// the number of the slot's stride units compressed block i covers (the derivative of
// choose_blocks' importance); coef[0] (the memory slot) = 0. coef [n_keys] is overwritten.
void score_gradient(const int64_t* chosen, const float* grad_scores, int64_t n_keys, const int64_t* config,
                    float* coef) {
  const int64_t per_compress = config[0] / config[1], per_select = config[2] / config[1], n_select = config[3];
  std::fill(coef, coef + n_keys, 0.0f);
  for (int64_t slot = 0; slot < n_select; ++slot) {
    const int64_t m = chosen[slot];
    if (m < 0) continue;
    for (int64_t u = m * per_select; u < (m + 1) * per_select; ++u)
      for (int64_t shift = 0; shift < per_compress; ++shift) {
        const int64_t i = u - shift;
        if (i >= 0 && i < n_keys - 1) coef[1 + i] += grad_scores[slot];
      }
  }
}

}  // namespace

extern "C" {

// out [B G, T, R, D] and lse [B G, T, R] (-inf for a query head that sees no key; its output is 0).
// With select (compress block, stride, selection block, n_select; else null): the keys are the
// compressed branch's (memory slot, then compressed blocks), and each query also chooses its
// selection blocks (choose_blocks) at token position select_positions[t] into selected
// [B G, T, n_select], and their scores into scores [B G, T, n_select] (may be null).
void nsa_block_attention_forward(const float* q, const float* k, const float* v, const int64_t* blocks,
                                 const float* gates, const int64_t* positions, float* out, float* lse,
                                 const int64_t* select, const int64_t* select_positions, int64_t* selected,
                                 float* scores, const int64_t* shape, float scale) {
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8]};
  const int64_t width = round_up(s.block, LANES), ld = s.n * width;
  const std::vector<float> kt = transpose_blocks(k, s, width);
  const int64_t M = (s.S + s.block - 1) / s.block;
#pragma omp parallel
  {
    std::vector<float> probs(s.R * ld);
    std::vector<float> maxima(s.R), mass(select ? s.S : 0), importance;
    std::vector<int64_t> order;
    Visible vis;
#pragma omp for collapse(2) schedule(static)
    for (int64_t bg = 0; bg < s.bg; ++bg)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t query = bg * s.T + t;
        visible_of(s.prefix ? nullptr : blocks + query * s.n, positions[t], s, vis);
        slot_scores(q + query * s.R * s.D, s.R, kt.data() + bg * M * s.D * width, vis, s, width, scale, probs.data());
        const int64_t used = vis.count * width;
        for (int64_t r = 0; r < s.R; ++r) {
          vf m = vf{} - INFINITY;
          for (int64_t j0 = 0; j0 < used; j0 += LANES) {
            const vf x = load(probs.data() + r * ld + j0);
            m = x > m ? x : m;
          }
          float best = -INFINITY;
          for (int l = 0; l < LANES; ++l) best = std::max(best, m[l]);
          maxima[r] = best;
        }
        exponentiate(probs.data(), s.R, ld, used, maxima.data());
        float* o = out + query * s.R * s.D;
        for (int64_t r = 0; r < s.R; ++r) {
          float* p = probs.data() + r * ld;
          vf partial = {};
          for (int64_t j0 = 0; j0 < used; j0 += LANES) partial += load(p + j0);
          const float total = sum_lanes(partial);
          const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
          for (int64_t j0 = 0; j0 < used; j0 += LANES) store(p + j0, load(p + j0) * inverse);
          lse[query * s.R + r] = total > 0.0f ? maxima[r] + std::log(total) : -INFINITY;
        }
        if (select) {  // the keys' probabilities summed over the heads
          std::fill(mass.begin(), mass.end(), 0.0f);
          for (int64_t i = 0; i < vis.count; ++i)
            for (int64_t j = vis.lo[i]; j <= vis.hi[i]; ++j) {
              float total = 0.0f;
              for (int64_t r = 0; r < s.R; ++r) total += probs[r * ld + i * width + j];
              mass[vis.block[i] * s.block + j] = total;
            }
          choose_blocks(mass.data(), s.S, select_positions[t], select, importance, order, selected + query * select[3],
                        scores ? scores + query * select[3] : nullptr);
        }
        if (gates) apply_gates(probs.data(), s.R, gates + query * s.n, vis, s, width);
        combine(probs.data(), s.R, v + bg * s.S * s.D, vis, s, width, o);
      }
  }
}

// grad_q [B G, T, R, D] (written); grad_k, grad_v [B G, S, D] (written); grad_gates [B G, T, n]
// (written when gates are given). With select (as in the forward; else null), the gradient of the
// selection scores the forward returned, grad_selection [B G, T, n_select], for the chosen blocks
// selected [B G, T, n_select], is added (score_gradient).
void nsa_block_attention_backward(const float* q, const float* k, const float* v, const int64_t* blocks,
                                  const float* gates, const int64_t* positions, const float* out, const float* lse,
                                  const float* grad_out, float* grad_q, float* grad_k, float* grad_v,
                                  float* grad_gates, const int64_t* select, const int64_t* selected,
                                  const float* grad_selection, const int64_t* shape, float scale) {
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8]};
  const int64_t width = round_up(s.block, LANES), ld = s.n * width;
  const std::vector<float> kt = transpose_blocks(k, s, width), vt = transpose_blocks(v, s, width);
  const int64_t M = (s.S + s.block - 1) / s.block;
  const int64_t threads = omp_get_max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((threads + s.bg - 1) / s.bg, s.T));
  // per (bg, part): transposed key and value gradient buffers [M, D, width], summed at the end
  const int64_t size = M * s.D * width;
  std::vector<float> buffers(2 * s.bg * parts * size, 0.0f);
#pragma omp parallel
  {
    std::vector<float> probs(s.R * ld), weighted(s.R * ld), grad_scores(s.R * ld);
    std::vector<float> deltas(s.R), coef(select ? s.S : 0);
    Visible vis;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t bg = 0; bg < s.bg; ++bg)
      for (int64_t part = 0; part < parts; ++part) {
        float* gk = buffers.data() + 2 * (bg * parts + part) * size;
        float* gv = gk + size;
        const int64_t t0 = s.T * part / parts, t1 = s.T * (part + 1) / parts;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t query = bg * s.T + t;
          const float* rows_q = q + query * s.R * s.D;
          const float* rows_grad = grad_out + query * s.R * s.D;
          visible_of(s.prefix ? nullptr : blocks + query * s.n, positions[t], s, vis);
          slot_scores(rows_q, s.R, kt.data() + bg * M * s.D * width, vis, s, width, scale, probs.data());
          const int64_t used = vis.count * width;
          exponentiate(probs.data(), s.R, ld, used, lse + query * s.R);
          // dP = dO . v (as scores, unit scale), delta = dO . O
          slot_scores(rows_grad, s.R, vt.data() + bg * M * s.D * width, vis, s, width, 1.0f, grad_scores.data());
          for (int64_t r = 0; r < s.R; ++r)
            deltas[r] = dot(rows_grad + r * s.D, out + (query * s.R + r) * s.D, s.D);
          if (select) {  // dP += the scores' gradient per key; delta += its probability-weighted sum
            score_gradient(selected + query * select[3], grad_selection + query * select[3], s.S, select, coef.data());
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t i = 0; i < vis.count; ++i)
                for (int64_t j = vis.lo[i]; j <= vis.hi[i]; ++j) {
                  const float c = coef[vis.block[i] * s.block + j];
                  grad_scores[r * ld + i * width + j] += c;
                  deltas[r] += probs[r * ld + i * width + j] * c;
                }
          }
          std::copy(probs.begin(), probs.end(), weighted.begin());
          const float* g = gates ? gates + query * s.n : nullptr;
          if (g) {
            apply_gates(weighted.data(), s.R, g, vis, s, width);
            float* gg = grad_gates + query * s.n;
            std::fill(gg, gg + s.n, 0.0f);  // slots that see no key
            for (int64_t i = 0; i < vis.count; ++i) {
              float total = 0.0f;  // sum over heads and keys of dP * P
              for (int64_t r = 0; r < s.R; ++r)
                for (int64_t j = vis.lo[i]; j <= vis.hi[i]; ++j)
                  total += grad_scores[r * ld + i * width + j] * probs[r * ld + i * width + j];
              gg[vis.slot[i]] = total;
            }
            apply_gates(grad_scores.data(), s.R, g, vis, s, width);
          }
          // dS = scale * P * (gate * dP - delta), 0 outside the visible keys (P is 0 there)
          for (int64_t r = 0; r < s.R; ++r) {
            float* ds = grad_scores.data() + r * ld;
            const float* p = probs.data() + r * ld;
            for (int64_t j0 = 0; j0 < used; j0 += LANES) {
              const vf pj = load(p + j0);
              const vf dp = load(ds + j0);
              store(ds + j0, pj > 0.0f ? pj * (dp - deltas[r]) * scale : vf{});
            }
          }
          combine(grad_scores.data(), s.R, k + bg * s.S * s.D, vis, s, width, grad_q + query * s.R * s.D);
          accumulate(grad_scores.data(), s.R, rows_q, vis, s, width, gk);
          accumulate(weighted.data(), s.R, rows_grad, vis, s, width, gv);
        }
      }
  }
  // grad_k[bg][key][d] = sum over parts (in order) of buffer[block][d][position]
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bg = 0; bg < s.bg; ++bg)
    for (int64_t key = 0; key < s.S; ++key) {
      const int64_t m = key / s.block, j = key % s.block;
      for (int64_t d = 0; d < s.D; ++d) {
        float total_k = 0.0f, total_v = 0.0f;
        for (int64_t part = 0; part < parts; ++part) {
          const float* gk = buffers.data() + 2 * (bg * parts + part) * size;
          total_k += gk[(m * s.D + d) * width + j];
          total_v += gk[size + (m * s.D + d) * width + j];
        }
        grad_k[(bg * s.S + key) * s.D + d] = total_k;
        grad_v[(bg * s.S + key) * s.D + d] = total_v;
      }
    }
}

}  // extern "C"
