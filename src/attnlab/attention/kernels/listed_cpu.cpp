// Listed-key attention on the CPU: forward and backward in one pass over each unit's keys.
//
// A unit is one (batch, head)'s list of key tokens L (in the order they are scored) and the query
// tokens that attend to it; query i sees the contiguous range L[lo_i .. hi_i] (inclusive), each
// key's score raised by an optional per-key bias. Routing attention makes one unit per cluster
// (L: the cluster's tokens in time order; a token sees the last `window` of them and itself);
// sinkhorn attention makes one per bucket (L: its chosen buckets, then itself).
//
// Tensors are read and written as rows of D floats: the row of token t in (batch, head) bh is
// data + (start[bh] + t * step) * D (kernels/listed_cpu.py's `rows_of`). Nothing is gathered
// into a block layout; keys are copied once per unit into a transposed buffer.
//
// Exactness: every score is one fused multiply-add chain over d, every output element one chain
// over the query's own keys in list order, and the softmax sums are grouped by key position
// relative to the query's tile, which depends only on the query's place in its unit. So a query's
// output depends on its own keys only, bit for bit, whatever else the unit holds (what makes
// routing attention causal to the bit). Keys outside a query's range get probability exactly 0.
//
// Threads: the forward runs units in parallel (each query row is written once). The backward runs
// groups of units in parallel and a group's units in order: key rows are shared only within a
// group, so the key gradients are summed without races and in a fixed order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace attnlab_cpu;

constexpr int TILE = 8;    // queries scored together (consecutive in their unit)

struct Rows {
  float* data;
  const int64_t* start;  // per (batch, head)
  int64_t step;          // rows between consecutive tokens
};

struct Units {
  int64_t n_units;
  const int64_t* bh;           // [U] (batch, head) of each unit
  const int64_t* key_start;    // [U + 1] offsets into key_tokens
  const int64_t* key_tokens;   // [sum L]
  const float* key_bias;       // [sum L] or null
  const int64_t* query_start;  // [U + 1] offsets into query_tokens
  const int64_t* query_tokens; // [sum Q]
  const int64_t* query_lo;     // [sum Q] first visible key, an index into the unit's list
  const int64_t* query_hi;     // [sum Q] last visible key (inclusive)
};

inline float* row_of(const Rows& x, int64_t bh, int64_t token, int64_t dim) {
  return x.data + (x.start[bh] + token * x.step) * dim;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Per-thread scratch.
struct Scratch {
  std::vector<float> kt, vt;          // [D, ld] keys / values transposed
  std::vector<float> bias, no_bias;   // [ld]
  std::vector<float> s, p, ds;        // [TILE, width]
  std::vector<float> grad_k, grad_v;  // [n, D] a unit's key gradients
  std::vector<float> zero;            // [D] a row of zeros for missing tile queries
};

// Copy the unit's keys (and values) transposed, [D, ld], zero-padded past n.
void transpose_rows(const Rows& x, int64_t bh, const int64_t* tokens, int64_t n, int64_t dim, int64_t ld,
                    std::vector<float>& out) {
  out.assign(dim * ld, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* src = row_of(x, bh, tokens[j], dim);
    for (int64_t d = 0; d < dim; ++d) out[d * ld + j] = src[d];
  }
}

// scores[qi][j - lo] = scale * <rows[qi], keys[j]> + bias[j] for j in lo .. hi (padded to LANES):
// each score one multiply-add chain over d
void tile_scores(const float* const* rows, const float* kt, const float* bias, int64_t ld, int64_t dim,
                 int64_t lo, int64_t hi, float scale, float* scores, int64_t width) {
  for (int64_t j0 = lo; j0 <= hi; j0 += LANES) {
    vf acc[TILE] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const vf k = load(kt + d * ld + j0);
      for (int qi = 0; qi < TILE; ++qi) acc[qi] += rows[qi][d] * k;
    }
    const vf b = load(bias + j0);
    for (int qi = 0; qi < TILE; ++qi) store(scores + qi * width + (j0 - lo), acc[qi] * scale + b);
  }
}

// out[qi][:] = sum_j weights[qi][j - lo] * rows_j[:], j in lo .. hi (a chain over j per element)
void tile_combine(const float* weights, int64_t width, const float* const* key_rows, int64_t lo, int64_t hi,
                  int64_t dim, float* out) {
  int64_t d0 = 0;
  for (; d0 + LANES <= dim; d0 += LANES) {
    vf acc[TILE] = {};
    for (int64_t j = lo; j <= hi; ++j) {
      const vf v = load(key_rows[j] + d0);
      for (int qi = 0; qi < TILE; ++qi) acc[qi] += weights[qi * width + (j - lo)] * v;
    }
    for (int qi = 0; qi < TILE; ++qi) store(out + qi * dim + d0, acc[qi]);
  }
  // A head width that is not a multiple of LANES: explicit fused multiply-adds, so that the
  // rounding of every term is the same whichever way the compiler vectorises the loop.
  for (; d0 < dim; ++d0) {
    for (int qi = 0; qi < TILE; ++qi) {
      float acc = 0.0f;
      for (int64_t j = lo; j <= hi; ++j) acc = std::fma(weights[qi * width + (j - lo)], key_rows[j][d0], acc);
      out[qi * dim + d0] = acc;
    }
  }
}

// rows[j] += sum_qi weights[qi][j - lo] * sources[qi] for j in lo .. hi
void tile_accumulate(const float* weights, int64_t width, int count, const float* const* sources, int64_t lo,
                     int64_t hi, int64_t dim, float* rows) {
  for (int64_t j = lo; j <= hi; ++j) {
    float* target = rows + j * dim;
    int64_t d0 = 0;
    for (; d0 + LANES <= dim; d0 += LANES) {
      vf acc = load(target + d0);
      for (int qi = 0; qi < count; ++qi) acc += weights[qi * width + (j - lo)] * load(sources[qi] + d0);
      store(target + d0, acc);
    }
    for (; d0 < dim; ++d0)
      for (int qi = 0; qi < count; ++qi) target[d0] = std::fma(weights[qi * width + (j - lo)], sources[qi][d0], target[d0]);
  }
}

struct Tile {
  int64_t first, count;    // queries [first, first + count) of the unit (global indices)
  int64_t lo, hi;          // union of their key ranges
  const float* rows[TILE]; // query rows (missing ones: zeros)
};

void tile_of(const Units& u, const Rows& q, int64_t bh, int64_t first, int64_t end, int64_t dim, const float* zero,
             Tile& t) {
  t.first = first;
  t.count = std::min<int64_t>(TILE, end - first);
  t.lo = u.query_lo[first];
  t.hi = u.query_hi[first];
  for (int qi = 0; qi < TILE; ++qi) {
    if (qi < t.count) {
      t.rows[qi] = row_of(q, bh, u.query_tokens[first + qi], dim);
      t.lo = std::min(t.lo, u.query_lo[first + qi]);
      t.hi = std::max(t.hi, u.query_hi[first + qi]);
    } else {
      t.rows[qi] = zero;
    }
  }
}

// Turn a tile's scores into probabilities: exp(score - shift_qi) inside each query's range, 0
// outside (and for missing queries). shift: the row maximum (forward) or log-sum-exp (backward).
void tile_probabilities(const Units& u, const Tile& t, const float* scores, float* probs, int64_t width,
                        const float* shifts) {
  vi lane;
  for (int l = 0; l < LANES; ++l) lane[l] = l;
  for (int qi = 0; qi < TILE; ++qi) {
    float* p = probs + qi * width;
    if (qi >= t.count) {
      std::fill(p, p + width, 0.0f);
      continue;
    }
    const int32_t lo = int32_t(u.query_lo[t.first + qi] - t.lo), hi = int32_t(u.query_hi[t.first + qi] - t.lo);
    const float* s = scores + qi * width;
    const float shift = shifts[qi];
    for (int64_t j0 = 0; j0 < width; j0 += LANES) {
      const vi j = lane + int32_t(j0);
      const vf e = exp_nonpositive(load(s + j0) - shift);
      store(p + j0, (j >= lo && j <= hi) ? e : vf{});
    }
  }
}

int64_t tile_width(int64_t lo, int64_t hi) { return round_up(hi - lo + 1, LANES); }

// The tile of queries first .. (at most TILE, before end) of a unit, with its scores in scratch.s
// (and room for TILE x width in scratch.p): returns width.
int64_t score_tile(const Units& u, const Rows& q, int64_t bh, int64_t first, int64_t end, int64_t dim, int64_t ld,
                   float scale, Scratch& scratch, Tile& t) {
  tile_of(u, q, bh, first, end, dim, scratch.zero.data(), t);
  const int64_t width = tile_width(t.lo, t.hi);
  scratch.s.resize(TILE * width);
  scratch.p.resize(TILE * width);
  tile_scores(t.rows, scratch.kt.data(), scratch.bias.data(), ld, dim, t.lo, t.hi, scale, scratch.s.data(), width);
  return width;
}

}  // namespace

extern "C" {

// out rows and lse [by query row] for every query of every unit
void listed_attention_forward(const Units* units, const Rows* q, const Rows* k, const Rows* v, const Rows* out,
                              const Rows* lse, int64_t dim, float scale) {
  const Units& u = *units;
#pragma omp parallel
  {
    Scratch scratch;
    scratch.zero.assign(dim, 0.0f);
    std::vector<const float*> value_rows;
    std::vector<float> result(TILE * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < u.n_units; ++unit) {
      const int64_t bh = u.bh[unit];
      const int64_t k0 = u.key_start[unit], n = u.key_start[unit + 1] - k0;
      const int64_t q0 = u.query_start[unit], q1 = u.query_start[unit + 1];
      if (n == 0 || q1 == q0) continue;
      const int64_t* tokens = u.key_tokens + k0;
      const int64_t ld = round_up(n, LANES) + LANES;
      transpose_rows(*k, bh, tokens, n, dim, ld, scratch.kt);
      scratch.bias.assign(ld, 0.0f);
      if (u.key_bias) std::copy(u.key_bias + k0, u.key_bias + k0 + n, scratch.bias.begin());
      value_rows.resize(n);
      for (int64_t j = 0; j < n; ++j) value_rows[j] = row_of(*v, bh, tokens[j], dim);
      for (int64_t first = q0; first < q1; first += TILE) {
        Tile t;
        const int64_t width = score_tile(u, *q, bh, first, q1, dim, ld, scale, scratch, t);
        float maxima[TILE] = {};
        for (int qi = 0; qi < t.count; ++qi) {
          const int64_t lo = u.query_lo[first + qi] - t.lo, hi = u.query_hi[first + qi] - t.lo;
          float m = -INFINITY;
          for (int64_t j = lo; j <= hi; ++j) m = std::max(m, scratch.s[qi * width + j]);
          maxima[qi] = m;
        }
        tile_probabilities(u, t, scratch.s.data(), scratch.p.data(), width, maxima);
        tile_combine(scratch.p.data(), width, value_rows.data(), t.lo, t.hi, dim, result.data());
        for (int qi = 0; qi < t.count; ++qi) {
          const float* p = scratch.p.data() + qi * width;
          vf partial = {};
          for (int64_t j0 = 0; j0 < width; j0 += LANES) partial += load(p + j0);
          const float total = sum_lanes(partial);
          const int64_t token = u.query_tokens[first + qi];
          float* o = row_of(*out, bh, token, dim);
          const float inverse = 1.0f / total;
          for (int64_t d = 0; d < dim; ++d) o[d] = result[qi * dim + d] * inverse;
          *row_of(*lse, bh, token, 1) = maxima[qi] + std::log(total);
        }
      }
    }
  }
}

// grad_q (written), grad_k, grad_v (added to; rows of one group's keys touched by that group
// only), grad_bias [sum L] (written, may be null)
void listed_attention_backward(const Units* units, const int64_t* group_start, int64_t n_groups, const Rows* q,
                               const Rows* k, const Rows* v, const Rows* out, const Rows* lse, const Rows* grad_out,
                               const Rows* grad_q, const Rows* grad_k, const Rows* grad_v, float* grad_bias,
                               int64_t dim, float scale) {
  const Units& u = *units;
#pragma omp parallel
  {
    Scratch scratch;
    scratch.zero.assign(dim, 0.0f);
    std::vector<const float*> key_rows, value_rows;
    std::vector<float> result(TILE * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t group = 0; group < n_groups; ++group) {
      for (int64_t unit = group_start[group]; unit < group_start[group + 1]; ++unit) {
        const int64_t bh = u.bh[unit];
        const int64_t k0 = u.key_start[unit], n = u.key_start[unit + 1] - k0;
        const int64_t q0 = u.query_start[unit], q1 = u.query_start[unit + 1];
        if (grad_bias) std::fill(grad_bias + k0, grad_bias + k0 + n, 0.0f);
        if (n == 0 || q1 == q0) continue;
        const int64_t* tokens = u.key_tokens + k0;
        const int64_t ld = round_up(n, LANES) + LANES;
        transpose_rows(*k, bh, tokens, n, dim, ld, scratch.kt);
        transpose_rows(*v, bh, tokens, n, dim, ld, scratch.vt);
        scratch.bias.assign(ld, 0.0f);
        if (u.key_bias) std::copy(u.key_bias + k0, u.key_bias + k0 + n, scratch.bias.begin());
        scratch.no_bias.assign(ld, 0.0f);
        key_rows.resize(n);
        for (int64_t j = 0; j < n; ++j) key_rows[j] = row_of(*k, bh, tokens[j], dim);
        scratch.grad_k.assign(n * dim, 0.0f);
        scratch.grad_v.assign(n * dim, 0.0f);
        for (int64_t first = q0; first < q1; first += TILE) {
          Tile t;
          const int64_t width = score_tile(u, *q, bh, first, q1, dim, ld, scale, scratch, t);
          scratch.ds.resize(TILE * width);
          float shifts[TILE] = {}, deltas[TILE] = {};
          const float* grad_rows[TILE];
          for (int qi = 0; qi < TILE; ++qi) {
            grad_rows[qi] = scratch.zero.data();
            if (qi >= t.count) continue;
            const int64_t token = u.query_tokens[first + qi];
            shifts[qi] = *row_of(*lse, bh, token, 1);
            grad_rows[qi] = row_of(*grad_out, bh, token, dim);
            deltas[qi] = dot(grad_rows[qi], row_of(*out, bh, token, dim), dim);
          }
          tile_probabilities(u, t, scratch.s.data(), scratch.p.data(), width, shifts);
          // dP = dO . v, scored like q . k (unit scale, no bias)
          tile_scores(grad_rows, scratch.vt.data(), scratch.no_bias.data(), ld, dim, t.lo, t.hi, 1.0f, scratch.ds.data(),
                      width);
          for (int qi = 0; qi < TILE; ++qi) {
            float* ds = scratch.ds.data() + qi * width;
            const float* p = scratch.p.data() + qi * width;
            for (int64_t j0 = 0; j0 < width; j0 += LANES) store(ds + j0, load(p + j0) * (load(ds + j0) - deltas[qi]));
          }
          // dQ = scale * dS . K
          tile_combine(scratch.ds.data(), width, key_rows.data(), t.lo, t.hi, dim, result.data());
          for (int qi = 0; qi < t.count; ++qi) {
            float* g = row_of(*grad_q, bh, u.query_tokens[first + qi], dim);
            for (int64_t d = 0; d < dim; ++d) g[d] = result[qi * dim + d] * scale;
          }
          // dK_j += scale * sum_qi dS[qi][j] q_qi (dS scaled in place); dV_j += sum_qi P[qi][j] dO_qi;
          // dbias_j += sum_qi dS[qi][j]
          if (grad_bias) {
            for (int64_t j = t.lo; j <= t.hi; ++j) {
              float total = 0.0f;
              for (int qi = 0; qi < t.count; ++qi) total += scratch.ds[qi * width + (j - t.lo)];
              grad_bias[k0 + j] += total;
            }
          }
          for (int64_t j0 = 0; j0 < TILE * width; j0 += LANES) store(scratch.ds.data() + j0, load(scratch.ds.data() + j0) * scale);
          tile_accumulate(scratch.ds.data(), width, int(t.count), t.rows, t.lo, t.hi, dim, scratch.grad_k.data());
          tile_accumulate(scratch.p.data(), width, int(t.count), grad_rows, t.lo, t.hi, dim, scratch.grad_v.data());
        }
        for (int64_t j = 0; j < n; ++j) {
          float* gk = row_of(*grad_k, bh, tokens[j], dim);
          float* gv = row_of(*grad_v, bh, tokens[j], dim);
          const float* lk = scratch.grad_k.data() + j * dim;
          const float* lv = scratch.grad_v.data() + j * dim;
          for (int64_t d = 0; d < dim; ++d) {
            gk[d] += lk[d];
            gv[d] += lv[d];
          }
        }
      }
    }
  }
}

// the version of the functions' signatures in this library (cpu.py checks it)
int attnlab_cpu_kernels_abi_version() { return 2; }

}  // extern "C"
