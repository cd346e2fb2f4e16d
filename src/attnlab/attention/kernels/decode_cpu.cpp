// Attention of a few queries through a cache, on the CPU: the `cpu` back-end of full and local
// attention's cached calls (a decode step, a speculative verification; kernels/decode_cpu.py), and
// of routing and sinkhorn attention's and NSA's selected branch's (listed_attention_cpu, at the end),
// and NSA's compressed branch with its block selection (compressed_selection_cpu).
//
// Query t of row b sees the keys at positions lo..positions[b, t] of the cache's storage
// [B, G, L, D] (lo = position - window + 1 with a window, else 0). Each task, one (row, query head),
// reads those keys and values once for all of its T queries, scoring W keys at a time (W: the
// CPU's vector width in floats, 16 with AVX-512, else 8): a key block is multiplied by each query
// in vector lanes and the W lane sums are taken together by a ladder of shuffles; then each block
// of W value rows, read once, is weighed into the output rows of up to 8 queries at a time, held
// in registers. Only the keys some query sees are read, not the whole storage (torch's fused
// attention reads every position of it, masked), each block prefetched a few blocks ahead as
// non-temporal data (PREFETCH_AHEAD); float32 storage is read in place. bfloat16
// storage is loaded two vectors at a time, in an order of the elements the queries are put in too
// (a shift or a mask a vector: for one query as fast as the memory on an AVX2 EPYC, where widening
// each half took 1.1-1.6x the time, and for 7 queries 0.87-0.97x the time of converting each block
// into float32 once; docs/bench/decode-operator/). A bfloat16 cache beside float32 weights reads
// half the bytes. float32 or bfloat16 queries and storage, the arithmetic in float32; head widths
// 16 to 128 in steps of 16.
//
// Registered as the torch operator attnlab::cached_attention_cpu, so a compiled decode step calls
// it from inductor's C++ wrapper without a return to Python.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "nsa_select.h"

namespace {

using attnlab_cpu::exp_nonpositive;
using attnlab_cpu::sum_lanes;

// W keys are scored together, W floats to a vector: by default the CPU's vector width, 16 with
// AVX-512 (one zmm register) and 8 otherwise (one ymm register with AVX2). A 16-float vector
// without AVX-512 is two registers, and a block of 16 such partial sums no longer fits in them: on
// a 2-core AMD EPYC (AVX2) the 16-key kernel took 1.8-7x the 8-key one's time (bench/decode_operator_ab.py,
// docs/bench/decode-operator/). The `lanes` argument picks either width on any CPU (the tests run both).
#if defined(__AVX512F__)
constexpr int NATIVE_LANES = 16;
constexpr int VECTOR_REGISTERS = 32;
#else
constexpr int NATIVE_LANES = 8;
constexpr int VECTOR_REGISTERS = 16;
#endif

template <int W>
struct Lanes {  // GCC/Clang vector extensions of W lanes
  typedef float floats __attribute__((vector_size(W * sizeof(float))));
  typedef uint16_t halves __attribute__((vector_size(W * sizeof(uint16_t))));
  typedef uint32_t words __attribute__((vector_size(W * sizeof(uint32_t))));
};
template <int W>
using floats = typename Lanes<W>::floats;

constexpr float NEGATIVE_INFINITY = -std::numeric_limits<float>::infinity();
constexpr int64_t MAX_QUERIES = 64;
constexpr int64_t MAX_LANES = 16;

// queries whose output rows stay in registers together while the values are weighed: the vector
// registers but 4 (a W-float vector may take several), at most 8 queries
template <int W>
constexpr int query_block(int head_vectors) {
  const int registers_per_vector = std::max(1, W / NATIVE_LANES);
  return std::max(1, std::min(8, (VECTOR_REGISTERS - 4) / registers_per_vector / head_vectors));
}

template <int W>
inline floats<W> load(const float* p) {
  floats<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <class V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }

template <int W>
inline floats<W> load_bf16(const uint16_t* p) {  // W bfloat16 -> float32: the bits shifted up
  typename Lanes<W>::halves half;
  std::memcpy(&half, p, sizeof(half));
  const typename Lanes<W>::words bits = __builtin_convertvector(half, typename Lanes<W>::words) << 16;
  floats<W> x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline uint16_t to_bf16(float x) {  // rounded to the nearest, ties to even (as torch's conversion)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// n rows of width D (a multiple of 16) starting at element `offset` of `base`, as float32 in out
inline void rows_to_float(const void* base, int64_t offset, int64_t n, int64_t width, bool bf16, float* out) {
  if (!bf16) {
    std::memcpy(out, static_cast<const float*>(base) + offset, n * width * sizeof(float));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < n * width; i += NATIVE_LANES) store(out + i, load_bf16<NATIVE_LANES>(p + i));
}

// a float32 row of width elements written at element `offset` of `base`, as float32 or bfloat16
inline void write_row(void* base, int64_t offset, const float* row, int64_t width, bool bf16) {
  if (!bf16) {
    std::memcpy(static_cast<float*>(base) + offset, row, width * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + offset;
  for (int64_t i = 0; i < width; ++i) out[i] = to_bf16(row[i]);
}

// How a task reads its keys and values: float32 in place, or bfloat16 converted in registers as
// it is loaded (AS_LOADED); bfloat16 in pairs of vectors (PAIRED: a head of an even number of
// vectors); bfloat16 converted into a float32 block once, where several queries would each convert
// it (CONVERT_ONCE: an odd number)
enum class Reading { AS_LOADED, PAIRED, CONVERT_ONCE };

// Rows of a [L, D] storage read as W-float vectors; at(row, d): vector d of the row whose first
// element is `row` (d is a compile-time constant once the loops over it are unrolled)
template <int W>
struct Float32Rows {
  const float* base;
  floats<W> at(int64_t row, int d) const { return load<W>(base + row + d * W); }
};
template <int W>
struct BFloat16Rows {
  const uint16_t* base;
  floats<W> at(int64_t row, int d) const { return load_bf16<W>(base + row + d * W); }
};

// bfloat16 rows in paired order: the row's elements in chunks of 2W, each read by one load as W
// 32-bit words (word i: element 2i in its low half, 2i + 1 in its high half); vector d is chunk
// d / 2's even elements (the words shifted up, d even) or its odd ones (their high halves, d odd).
// A shift or a mask per W floats where a conversion in order widens each half first: the queries
// are put in the same order (and the outputs back), as a dot product and a weighted sum of rows
// do not depend on the order of the elements.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "paired bfloat16 reading assumes little-endian words");
template <int W>
struct BFloat16PairedRows {
  const uint16_t* base;
  floats<W> at(int64_t row, int d) const {
    typename Lanes<W>::words bits;
    std::memcpy(&bits, base + row + d / 2 * 2 * W, sizeof(bits));
    bits = d % 2 ? bits & 0xFFFF0000u : bits << 16;
    floats<W> x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
};

// each chunk of 2W elements of `rows` (n_elements of them) in paired order (its even elements,
// then its odd ones), or back (to_paired false)
template <int W>
void reorder_pairs(float* rows, int64_t n_elements, bool to_paired) {
  float chunk[2 * W];
  for (int64_t c = 0; c < n_elements; c += 2 * W) {
    std::memcpy(chunk, rows + c, sizeof(chunk));
    for (int i = 0; i < 2 * W; ++i) {
      const int paired = i % 2 * W + i / 2;  // where element i of the chunk goes in paired order
      if (to_paired)
        rows[c + paired] = chunk[i];
      else
        rows[c + i] = chunk[paired];
    }
  }
}

// f(rows) with the rows of `storage` from element `offset` on, as the storage's dtype and the
// reading take them
template <int W, Reading READING, class F>
inline void with_rows(const void* storage, bool bf16, int64_t offset, F f) {
  if constexpr (READING == Reading::PAIRED) return f(BFloat16PairedRows<W>{static_cast<const uint16_t*>(storage) + offset});
  if (bf16) return f(BFloat16Rows<W>{static_cast<const uint16_t*>(storage) + offset});
  f(Float32Rows<W>{static_cast<const float*>(storage) + offset});
}

// The lane sums of W vectors p[0..W-1] as one vector (lane k: the sum of p[k]'s lanes): log2(W)
// rounds of half-width shuffles and adds, a fixed order
inline floats<16> lane_sums(const floats<16>* p) {
  floats<16> a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline floats<8> lane_sums(const floats<8>* p) {
  floats<8> a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

struct Task {
  float* queries;           // [T, D] float32, already scaled by 1/sqrt(D) (PAIRED: reordered here)
  const void* keys;         // the storage, at this row's key/value head: [L, D]
  const void* values;
  bool bf16_storage;
  const int64_t* lo;        // [T] the first and last key each query sees
  const int64_t* hi;
  int64_t n_queries;
  int64_t first, end;       // keys first..end-1: those some query sees
  float* scores;            // scratch [T, end - first rounded up to 16]
  void* block;              // scratch [16, D] floats: a key block as float32 (the last one,
                            // shorter than W, PAIRED: as stored; bfloat16 rows several queries read)
  float* out;               // [T, D] float32
};

// scores[t, j0 + k] = q_t . k_(j0 + k) for the W keys of one block (keys: its rows), -inf for
// the keys query t does not see
template <int W, int DV, class Rows>
void score_block(const Task& task, int64_t stride, int64_t j0, Rows keys) {
  using vf = floats<W>;
  constexpr int64_t D = DV * W;
  vf key_index;  // exact: positions are far below 2^24
  for (int l = 0; l < W; ++l) key_index[l] = static_cast<float>(j0 + l);
  for (int64_t t = 0; t < task.n_queries; ++t) {
    vf q[DV], partial[W];
    for (int d = 0; d < DV; ++d) q[d] = load<W>(task.queries + t * D + d * W);
    for (int k = 0; k < W; ++k) {
      vf sum = q[0] * keys.at(k * D, 0);
      for (int d = 1; d < DV; ++d) sum += q[d] * keys.at(k * D, d);
      partial[k] = sum;
    }
    const vf s = lane_sums(partial);
    const auto visible = (key_index >= static_cast<float>(task.lo[t])) & (key_index <= static_cast<float>(task.hi[t]));
    store(task.scores + t * stride + (j0 - task.first), visible ? s : vf{} + NEGATIVE_INFINITY);
  }
}

// A task reads its keys, then its values, once each and in order, and at long contexts they are
// most of what a decode step reads from memory. Each block's rows are prefetched PREFETCH_AHEAD bytes
// before it is scored or weighed, as non-temporal data (locality 0), so that the stream keeps less of
// the last-level cache from the step's weights. On a 2-core AMD EPYC with AVX-512 (Zen 5), 8 KiB
// ahead took a compiled full-attention step at 4096 tokens of context 0.77-0.92x its time and at 256
// 0.98-1.03x, and the calls of width 64 over 4000 keys read cold 0.70-0.95x; calls over keys already
// in cache take about 0.5 us more (docs/bench/decode-operator/, bench/decode_operator_ab.py).
constexpr int64_t PREFETCH_AHEAD = 8192;
constexpr int64_t CACHE_LINE = 64;

// The W rows of width D that lie PREFETCH_AHEAD bytes past key j0's block, prefetched where the task
// reads them (keys before `end`)
template <int W, int64_t D>
inline void prefetch_ahead(const void* storage, bool bf16, int64_t j0, int64_t end) {
  const int64_t element = bf16 ? 2 : 4;
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_AHEAD / (W * D * element)) * W;  // keys, whole blocks
  if (j0 + ahead + W > end) return;
  const char* rows = static_cast<const char*>(storage) + (j0 + ahead) * D * element;
  for (int64_t byte = 0; byte < W * D * element; byte += CACHE_LINE) __builtin_prefetch(rows + byte, 0, 0);
}

// every query's scores over the keys first..end-1: whole blocks of W read from the storage, a last
// shorter block copied into the block scratch, as float32 (PAIRED: as stored) and padded with zero
// rows (the storage may end before W rows) (CONVERT_ONCE: every block converted into the float32
// block once, not once per query that loads it)
template <int W, int DV, Reading READING>
void score(const Task& task, int64_t stride) {
  constexpr int64_t D = DV * W;
  for (int64_t j0 = task.first; j0 < task.end; j0 += W) {
    const int64_t n = std::min<int64_t>(W, task.end - j0);
    prefetch_ahead<W, D>(task.keys, task.bf16_storage, j0, task.end);
    const auto score_rows = [&](auto keys) { score_block<W, DV>(task, stride, j0, keys); };
    if (READING != Reading::CONVERT_ONCE && n == W) {
      with_rows<W, READING>(task.keys, task.bf16_storage, j0 * D, score_rows);
    } else if constexpr (READING == Reading::PAIRED) {
      uint16_t* block = static_cast<uint16_t*>(task.block);
      std::memcpy(block, static_cast<const uint16_t*>(task.keys) + j0 * D, n * D * sizeof(uint16_t));
      std::memset(block + n * D, 0, (W - n) * D * sizeof(uint16_t));
      score_rows(BFloat16PairedRows<W>{block});
    } else {
      float* block = static_cast<float*>(task.block);
      rows_to_float(task.keys, j0 * D, n, D, task.bf16_storage, block);
      std::memset(block + n * D, 0, (W - n) * D * sizeof(float));
      score_rows(Float32Rows<W>{block});
    }
  }
}

// each query's softmax weights in place of its scores; fills total[t] (their sum)
template <int W>
void softmax_rows(const Task& task, int64_t stride, float* total) {
  using vf = floats<W>;
  for (int64_t t = 0; t < task.n_queries; ++t) {
    float* s = task.scores + t * stride;
    vf running = vf{} + NEGATIVE_INFINITY;
    for (int64_t j = 0; j < stride; j += W) running = running > load<W>(s + j) ? running : load<W>(s + j);
    float top = running[0];
    for (int l = 1; l < W; ++l) top = std::max(top, running[l]);
    vf sum = {};
    for (int64_t j = 0; j < stride; j += W) {
      const vf e = exp_nonpositive(load<W>(s + j) - top);  // -inf -> 0
      store(s + j, e);
      sum += e;
    }
    total[t] = sum_lanes(sum);  // > 0: every query sees at least its own key
  }
}

// out[t0 .. t0 + NB - 1] += sum_k weight[t, j0 + k] v_(j0 + k) over the n rows of one value block
// (values: its rows): the NB queries' rows in registers (NB, DV compile-time: no array indexed at
// run time)
template <int W, int DV, int NB, class Rows>
void weigh_block(const Task& task, int64_t stride, int64_t t0, int64_t j0, int64_t n, Rows values) {
  using vf = floats<W>;
  constexpr int64_t D = DV * W;
  vf acc[NB][DV];
  for (int t = 0; t < NB; ++t)
    for (int d = 0; d < DV; ++d) acc[t][d] = load<W>(task.out + (t0 + t) * D + d * W);
  const float* weights = task.scores + t0 * stride + (j0 - task.first);
  for (int64_t k = 0; k < n; ++k) {
    for (int t = 0; t < NB; ++t) {  // a row's loads (and conversions) are the same for every t: taken once
      const vf weight = vf{} + weights[t * stride + k];
      for (int d = 0; d < DV; ++d) acc[t][d] += weight * values.at(k * D, d);
    }
  }
  for (int t = 0; t < NB; ++t)
    for (int d = 0; d < DV; ++d) store(task.out + (t0 + t) * D + d * W, acc[t][d]);
}

template <int W, int DV, int NB = query_block<W>(DV), class Rows>
void weigh_any(const Task& task, int64_t stride, int64_t t0, int64_t n_block, int64_t j0, int64_t n, Rows values) {
  if constexpr (NB > 1) {
    if (n_block < NB) return weigh_any<W, DV, NB - 1>(task, stride, t0, n_block, j0, n, values);
  }
  weigh_block<W, DV, NB>(task, stride, t0, j0, n, values);
}

// out[t] = sum_j weight[t, j] v_j / total[t]: each value block read once, weighed into
// query_block(DV) queries' rows at a time (CONVERT_ONCE: the values of more queries than that
// converted into the float32 block once)
template <int W, int DV, Reading READING>
void weigh_values(const Task& task, int64_t stride, const float* total) {
  using vf = floats<W>;
  constexpr int64_t D = DV * W, BLOCK = query_block<W>(DV);
  std::fill(task.out, task.out + task.n_queries * D, 0.0f);
  for (int64_t j0 = task.first; j0 < task.end; j0 += W) {
    const int64_t n = std::min<int64_t>(W, task.end - j0);
    prefetch_ahead<W, D>(task.values, task.bf16_storage, j0, task.end);
    if (READING == Reading::CONVERT_ONCE && task.n_queries > BLOCK) {
      float* block = static_cast<float*>(task.block);
      rows_to_float(task.values, j0 * D, n, D, true, block);
      const Float32Rows<W> values{block};
      for (int64_t t0 = 0; t0 < task.n_queries; t0 += BLOCK)
        weigh_any<W, DV>(task, stride, t0, std::min<int64_t>(BLOCK, task.n_queries - t0), j0, n, values);
      continue;
    }
    constexpr Reading IN_PLACE = READING == Reading::PAIRED ? Reading::PAIRED : Reading::AS_LOADED;
    with_rows<W, IN_PLACE>(task.values, task.bf16_storage, j0 * D, [&](auto values) {
      for (int64_t t0 = 0; t0 < task.n_queries; t0 += BLOCK)
        weigh_any<W, DV>(task, stride, t0, std::min<int64_t>(BLOCK, task.n_queries - t0), j0, n, values);
    });
  }
  for (int64_t t = 0; t < task.n_queries; ++t) {
    const vf inverse = vf{} + 1.0f / total[t];
    for (int d = 0; d < DV; ++d) store(task.out + t * D + d * W, load<W>(task.out + t * D + d * W) * inverse);
  }
}

// flatten: every call inside inlined, one body per instantiation (left to GCC's inliner, the
// float32 path ran slower once the bfloat16 one was instantiated beside it)
template <int W, int DV, Reading READING>
__attribute__((flatten)) void attend(const Task& task) {
  const int64_t stride = (task.end - task.first + W - 1) / W * W;
  float total[MAX_QUERIES];
  if constexpr (READING == Reading::PAIRED) reorder_pairs<W>(task.queries, task.n_queries * DV * W, true);
  score<W, DV, READING>(task, stride);
  softmax_rows<W>(task, stride, total);
  weigh_values<W, DV, READING>(task, stride, total);
  if constexpr (READING == Reading::PAIRED) reorder_pairs<W>(task.out, task.n_queries * DV * W, false);
}

// f(std::integral_constant<int, DV>{}) for a head width of head_vectors vectors of W floats (head
// widths: multiples of 16, up to 128): the listed and compressed kernels take DV as a compile-time
// constant
template <int W, int DV = 128 / W, class F>
void with_head_vectors(int64_t head_vectors, F f) {
  if constexpr (DV > 16 / W) {
    if (head_vectors < DV) return with_head_vectors<W, DV - 16 / W>(head_vectors, f);
  }
  f(std::integral_constant<int, DV>{});
}

// attend<W, DV> for a head width of head_vectors vectors of W (head widths: multiples of 16). Its
// own recursion rather than with_head_vectors: through the lambda, the float32 kernel of 64-wide
// heads took 1.03-1.07x the time on an AVX2 EPYC (bench/decode_operator_ab.py --against HEAD)
template <int W, int DV = 128 / W>
void attend_any(const Task& task, int64_t head_vectors) {
  if constexpr (DV > 16 / W) {
    if (head_vectors < DV) return attend_any<W, DV - 16 / W>(task, head_vectors);
  }
  // bfloat16 rows are read in pairs of vectors; a head of an odd number of vectors converts them
  // into float32 once where several queries read them, else as they are loaded
  if (task.bf16_storage && DV % 2 == 0) return attend<W, DV, Reading::PAIRED>(task);
  if (task.bf16_storage && task.n_queries > 1) return attend<W, DV, Reading::CONVERT_ONCE>(task);
  attend<W, DV, Reading::AS_LOADED>(task);
}

bool is_bf16(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16; }

// q [B, H, T, D] (any strides with unit stride along D: a slice of the step's projections is read in
// place), keys and values [B, G, L, D] (a slice of a cache's heads read in place), positions [B, T]
// int64, window (0: none) -> [B, H, T, D]
// laid out as [B, T, H, D] in memory, so that merging the heads back into rows is a view, not a copy;
// lanes: the keys scored together, 8 or 16 (0: the CPU's vector width)
at::Tensor cached_attention_cpu(const at::Tensor& q_in, const at::Tensor& keys_in, const at::Tensor& values_in,
                                const at::Tensor& positions_in, int64_t window, int64_t lanes) {
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  // each position's rows contiguous, rows and heads by their strides (a slice of a cache's heads read
  // in place); any other layout copied
  const bool in_place = keys_in.stride(3) == 1 && keys_in.stride(2) == keys_in.size(3) &&
                        values_in.strides() == keys_in.strides();
  const at::Tensor keys = in_place ? keys_in : keys_in.contiguous();
  const at::Tensor values = in_place ? values_in : values_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  const int64_t batch = q.size(0), n_heads = q.size(1), n_queries = q.size(2), width = q.size(3);
  const int64_t n_groups = keys.size(1), length = keys.size(2);
  TORCH_CHECK(width % 16 == 0 && width >= 16 && width <= 128,
              "cached_attention_cpu: head width must be 16 to 128 in steps of 16, got ", width);
  TORCH_CHECK(n_queries <= MAX_QUERIES, "cached_attention_cpu: at most ", MAX_QUERIES, " queries, got ", n_queries);
  TORCH_CHECK(n_heads % n_groups == 0 && keys.size(3) == width && values.sizes() == keys.sizes() &&
                  keys.size(0) == batch, "cached_attention_cpu: shapes do not match");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "cached_attention_cpu: keys and values differ in dtype");
  for (const at::Tensor* x : {&q, &keys})
    TORCH_CHECK(x->scalar_type() == at::kFloat || is_bf16(*x), "cached_attention_cpu: float32 or bfloat16 only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == at::IntArrayRef({batch, n_queries}),
              "cached_attention_cpu: positions must be int64 [B, T]");
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "cached_attention_cpu: lanes must be 0, 8 or 16, got ", lanes);
  const int64_t key_lanes = lanes ? lanes : NATIVE_LANES;
  at::Tensor out = at::empty({batch, n_queries, n_heads, width}, q.options());  // [B, T, H, D]
  const bool bf16_queries = is_bf16(q), bf16_storage = is_bf16(keys);
  const int64_t element = bf16_storage ? 2 : 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(width));
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t per_group = n_heads / n_groups;
  at::parallel_for(0, batch * n_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(n_queries * width), rows(n_queries * width), block(MAX_LANES * width);
    std::vector<float> scores(n_queries * ((length + MAX_LANES - 1) / MAX_LANES * MAX_LANES));
    std::vector<int64_t> lo(n_queries), hi(n_queries);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / n_heads, h = index % n_heads, g = h / per_group;
      int64_t first = length, last = 0;
      for (int64_t t = 0; t < n_queries; ++t) {
        hi[t] = std::min(position[b * n_queries + t], length - 1);
        lo[t] = window > 0 ? std::max<int64_t>(hi[t] - window + 1, 0) : 0;
        first = std::min(first, lo[t]);
        last = std::max(last, hi[t]);
      }
      for (int64_t t = 0; t < n_queries; ++t)  // query rows by q's strides
        rows_to_float(q.data_ptr(), b * q.stride(0) + h * q.stride(1) + t * q.stride(2), 1, width, bf16_queries,
                      queries.data() + t * width);
      for (float& x : queries) x *= scale;
      const int64_t storage_offset = (b * keys.stride(0) + g * keys.stride(1)) * element;
      const Task task{queries.data(),
                      static_cast<const char*>(keys.data_ptr()) + storage_offset,
                      static_cast<const char*>(values.data_ptr()) + storage_offset,
                      bf16_storage, lo.data(), hi.data(), n_queries, first, last + 1,
                      scores.data(), block.data(), rows.data()};
      if (key_lanes == 16)
        attend_any<16>(task, width / 16);
      else
        attend_any<8>(task, width / 8);
      for (int64_t t = 0; t < n_queries; ++t) {  // row t of this head: out[b, t, h]
        write_row(out.data_ptr(), ((b * n_queries + t) * n_heads + h) * width, rows.data() + t * width, width,
                  bf16_queries);
      }
    }
  });
  return out.transpose(1, 2);  // [B, H, T, D]
}


// ---------------------------------------------------------------------------------------------
// Attention over listed blocks of a cache's storage: the `cpu` back-end of routing and sinkhorn
// attention's cached calls and of NSA's selected branch. Query t of row b, head h reads the blocks
// n = 0..N-1 of `block` keys starting at position starts[b, h, t, n], each key's score raised by the
// block's bias[b, h, t, n] (-inf: no such block); keys past the query's position or the storage are
// hidden. Routing lists each query's W + 1 keys as blocks of one; sinkhorn its chosen buckets
// (their log sorting weights as biases) and its own; NSA its selected blocks. The keys and values
// are read in place from the storage, float32 or bfloat16 (no gathered copy, no conversion of it),
// the arithmetic in float32.

struct ListedTask {
  const float* query;     // [D] float32, scaled by 1/sqrt(D)
  const void* keys;       // the storage at this row's key/value head: [L, D]
  const void* values;
  bool bf16_storage;
  const int64_t* starts;  // [N]
  const float* biases;    // [N]
  int64_t n_blocks, block, position, length;
  float* scores;          // scratch [N * block rounded up to 16]
  float* out;             // [D] float32
};

template <int W>
inline floats<W> storage_row(const void* base, bool bf16, int64_t offset) {
  return bf16 ? load_bf16<W>(static_cast<const uint16_t*>(base) + offset)
              : load<W>(static_cast<const float*>(base) + offset);
}

template <int W, int DV>
__attribute__((flatten)) void attend_listed(const ListedTask& task) {
  using vf = floats<W>;
  constexpr int64_t D = DV * W;
  const int64_t n_keys = task.n_blocks * task.block, padded = (n_keys + W - 1) / W * W;
  vf q[DV];
  for (int d = 0; d < DV; ++d) q[d] = load<W>(task.query + d * W);
  float top = NEGATIVE_INFINITY;
  for (int64_t n = 0; n < task.n_blocks; ++n) {
    const float bias = task.biases[n];
    for (int64_t s = 0; s < task.block; ++s) {
      const int64_t j = task.starts[n] + s;
      float& score = task.scores[n * task.block + s];
      if (!(bias > NEGATIVE_INFINITY) || j < 0 || j > task.position || j >= task.length) {
        score = NEGATIVE_INFINITY;
        continue;
      }
      vf sum = q[0] * storage_row<W>(task.keys, task.bf16_storage, j * D);
      for (int d = 1; d < DV; ++d) sum += q[d] * storage_row<W>(task.keys, task.bf16_storage, j * D + d * W);
      score = attnlab_cpu::sum_lanes(sum) + bias;
      top = std::max(top, score);
    }
  }
  vf acc[DV] = {};
  if (top == NEGATIVE_INFINITY) {  // no key seen (not for routing or sinkhorn: a query sees itself)
    for (int d = 0; d < DV; ++d) store(task.out + d * W, acc[d]);
    return;
  }
  std::fill(task.scores + n_keys, task.scores + padded, NEGATIVE_INFINITY);
  vf sum = {};
  for (int64_t j = 0; j < padded; j += W) {
    const vf e = exp_nonpositive(load<W>(task.scores + j) - top);  // -inf -> 0
    store(task.scores + j, e);
    sum += e;
  }
  const float total = attnlab_cpu::sum_lanes(sum);
  for (int64_t n = 0; n < task.n_blocks; ++n) {
    for (int64_t s = 0; s < task.block; ++s) {
      const float weight = task.scores[n * task.block + s];
      if (weight == 0.0f) continue;  // hidden (or too small to count)
      const int64_t j = task.starts[n] + s;
      const vf w = vf{} + weight;
      for (int d = 0; d < DV; ++d) acc[d] += w * storage_row<W>(task.values, task.bf16_storage, j * D + d * W);
    }
  }
  const vf inverse = vf{} + 1.0f / total;
  for (int d = 0; d < DV; ++d) store(task.out + d * W, acc[d] * inverse);
}

// q [B, H, T, D] (unit stride along D), keys and values [B, G, L, D] (each position's row
// contiguous; rows and heads by their strides: a slice of a cache's heads is read in place), starts
// [B, H, T, N] int64, biases [B, H, T, N] float32, block >= 1, positions [B, T] int64 ->
// [B, H, T, D] laid out as [B, T, H, D] in memory (as cached_attention_cpu's)
at::Tensor listed_attention_cpu(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& starts_in, const at::Tensor& biases_in, int64_t block,
                                const at::Tensor& positions_in) {
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor starts = starts_in.contiguous(), biases = biases_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  const int64_t batch = q.size(0), n_heads = q.size(1), n_queries = q.size(2), width = q.size(3);
  const int64_t n_groups = keys.size(1), length = keys.size(2), n_blocks = starts.size(3);
  TORCH_CHECK(width % 16 == 0 && width >= 16 && width <= 128,
              "listed_attention_cpu: head width must be 16 to 128 in steps of 16, got ", width);
  TORCH_CHECK(n_heads % n_groups == 0 && keys.size(3) == width && values.sizes() == keys.sizes() &&
                  keys.size(0) == batch, "listed_attention_cpu: shapes do not match");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == width && values.strides() == keys.strides(),
              "listed_attention_cpu: each position's key and value rows must be contiguous, with the same strides");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "listed_attention_cpu: keys and values differ in dtype");
  for (const at::Tensor* x : {&q, &keys})
    TORCH_CHECK(x->scalar_type() == at::kFloat || is_bf16(*x), "listed_attention_cpu: float32 or bfloat16 only");
  TORCH_CHECK(starts.scalar_type() == at::kLong && biases.scalar_type() == at::kFloat &&
                  starts.sizes() == at::IntArrayRef({batch, n_heads, n_queries, n_blocks}) &&
                  biases.sizes() == starts.sizes(),
              "listed_attention_cpu: starts (int64) and biases (float32) must be [B, H, T, N]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == at::IntArrayRef({batch, n_queries}),
              "listed_attention_cpu: positions must be int64 [B, T]");
  TORCH_CHECK(block >= 1, "listed_attention_cpu: block must be at least 1, got ", block);
  at::Tensor out = at::empty({batch, n_queries, n_heads, width}, q.options());  // [B, T, H, D]
  const bool bf16_queries = is_bf16(q), bf16_storage = is_bf16(keys);
  const int64_t element = bf16_storage ? 2 : 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(width));
  const int64_t per_group = n_heads / n_groups;
  const int64_t n_keys = n_blocks * block;
  at::parallel_for(0, batch * n_heads * n_queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(width), row(width), scores((n_keys + MAX_LANES - 1) / MAX_LANES * MAX_LANES);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (n_heads * n_queries), h = index / n_queries % n_heads, t = index % n_queries;
      rows_to_float(q.data_ptr(), b * q.stride(0) + h * q.stride(1) + t * q.stride(2), 1, width, bf16_queries,
                    query.data());
      for (float& x : query) x *= scale;
      const int64_t storage_offset = (b * keys.stride(0) + h / per_group * keys.stride(1)) * element;
      const ListedTask task{query.data(),
                            static_cast<const char*>(keys.data_ptr()) + storage_offset,
                            static_cast<const char*>(values.data_ptr()) + storage_offset,
                            bf16_storage,
                            starts.data_ptr<int64_t>() + index * n_blocks,
                            biases.data_ptr<float>() + index * n_blocks,
                            n_blocks, block, positions.data_ptr<int64_t>()[b * n_queries + t], length,
                            scores.data(), row.data()};
      with_head_vectors<NATIVE_LANES>(width / NATIVE_LANES, [&](auto vectors) {
        attend_listed<NATIVE_LANES, decltype(vectors)::value>(task);
      });
      write_row(out.data_ptr(), ((b * n_queries + t) * n_heads + h) * width, row.data(), width, bf16_queries);
    }
  });
  return out.transpose(1, 2);  // [B, H, T, D]
}

// ---------------------------------------------------------------------------------------------
// NSA's compressed branch and its block selection through a cache: the `cpu` back-end of native
// sparse attention's cached calls (attention/nsa.py). The R query heads of key/value head g at query
// t of row b see the memory slot, then the compressed blocks complete at the query's position
// (block i: tokens i d .. i d + l - 1, complete once its last token is at or before the query), read
// in place from the cache's compressed storage [B, G, N, D], float32 or bfloat16: only those, not
// every slot of the storage, so a step's cost follows the position, not the cache's capacity. The
// heads' probabilities, summed, choose the query's selection blocks by nsa_select.h's rule, as the
// whole-sequence kernel (nsa_cpu.cpp) does.

struct CompressedTask {
  const float* queries;       // [R, D] float32, scaled by 1/sqrt(D)
  const float* memory_key;    // [D] float32: the memory slot, seen by every query
  const float* memory_value;
  const void* keys;           // the compressed storage at this row's key/value head: [N, D]
  const void* values;
  bool bf16_storage;
  int64_t n_heads;            // R
  int64_t n_visible;          // compressed blocks the query sees
  int64_t stride;             // of the probabilities: 1 + N rounded up to 16
  float* probabilities;       // scratch [R, stride]
  float* mass;                // [1 + n_visible]: the probabilities summed over the heads
  float* out;                 // [R, D] float32
};

// each head's probabilities over the memory slot and the visible blocks, its output, and their mass
template <int W, int DV>
__attribute__((flatten)) void attend_compressed(const CompressedTask& task) {
  using vf = floats<W>;
  constexpr int64_t D = DV * W;
  const int64_t n_keys = 1 + task.n_visible;
  for (int64_t r = 0; r < task.n_heads; ++r) {
    vf q[DV];
    for (int d = 0; d < DV; ++d) q[d] = load<W>(task.queries + r * D + d * W);
    float* p = task.probabilities + r * task.stride;
    vf memory = q[0] * load<W>(task.memory_key);
    for (int d = 1; d < DV; ++d) memory += q[d] * load<W>(task.memory_key + d * W);
    p[0] = attnlab_cpu::sum_lanes(memory);
    float top = p[0];
    for (int64_t j = 0; j < task.n_visible; ++j) {
      vf sum = q[0] * storage_row<W>(task.keys, task.bf16_storage, j * D);
      for (int d = 1; d < DV; ++d) sum += q[d] * storage_row<W>(task.keys, task.bf16_storage, j * D + d * W);
      p[1 + j] = attnlab_cpu::sum_lanes(sum);
      top = std::max(top, p[1 + j]);
    }
    const int64_t padded = (n_keys + W - 1) / W * W;
    std::fill(p + n_keys, p + padded, NEGATIVE_INFINITY);
    vf sum = {};
    for (int64_t j = 0; j < padded; j += W) {
      const vf e = exp_nonpositive(load<W>(p + j) - top);  // -inf -> 0
      store(p + j, e);
      sum += e;
    }
    const vf inverse = vf{} + 1.0f / attnlab_cpu::sum_lanes(sum);
    for (int64_t j = 0; j < padded; j += W) store(p + j, load<W>(p + j) * inverse);
    vf acc[DV];
    for (int d = 0; d < DV; ++d) acc[d] = (vf{} + p[0]) * load<W>(task.memory_value + d * W);
    for (int64_t j = 0; j < task.n_visible; ++j) {
      const vf weight = vf{} + p[1 + j];
      for (int d = 0; d < DV; ++d) acc[d] += weight * storage_row<W>(task.values, task.bf16_storage, j * D + d * W);
    }
    for (int d = 0; d < DV; ++d) store(task.out + r * D + d * W, acc[d]);
  }
  for (int64_t j = 0; j < n_keys; ++j) {
    float total = 0.0f;
    for (int64_t r = 0; r < task.n_heads; ++r) total += task.probabilities[r * task.stride + j];
    task.mass[j] = total;
  }
}

// q [B, H, T, D] (the queries without rotary; unit stride along D), memory [2, G, D] (the memory
// slot's key and value), keys and values [B, G, N, D] (the compressed storage: each slot's row
// contiguous, rows and heads by their strides), positions [B, T] int64, the compress block l, its
// stride d, the selection block l' and n_select -> (out [B, H, T, D] laid out as [B, T, H, D] as
// cached_attention_cpu's, the chosen selection blocks [B, G, T, n_select] int64: ascending, then -1
// for slots left empty)
std::tuple<at::Tensor, at::Tensor> compressed_selection_cpu(
    const at::Tensor& q_in, const at::Tensor& memory_in, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& positions_in, int64_t compress_block, int64_t stride, int64_t selection_block,
    int64_t n_select) {
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  const int64_t batch = q.size(0), n_heads = q.size(1), n_queries = q.size(2), width = q.size(3);
  const int64_t n_groups = keys.size(1), n_slots = keys.size(2);
  TORCH_CHECK(width % 16 == 0 && width >= 16 && width <= 128,
              "compressed_selection_cpu: head width must be 16 to 128 in steps of 16, got ", width);
  TORCH_CHECK(n_heads % n_groups == 0 && keys.size(0) == batch && keys.size(3) == width &&
                  values.sizes() == keys.sizes() && memory_in.sizes() == at::IntArrayRef({2, n_groups, width}),
              "compressed_selection_cpu: shapes do not match");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == width && values.strides() == keys.strides(),
              "compressed_selection_cpu: each slot's key and value rows must be contiguous, with the same strides");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "compressed_selection_cpu: keys and values differ in dtype");
  for (const at::Tensor* x : {&q, &keys})
    TORCH_CHECK(x->scalar_type() == at::kFloat || is_bf16(*x), "compressed_selection_cpu: float32 or bfloat16 only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == at::IntArrayRef({batch, n_queries}),
              "compressed_selection_cpu: positions must be int64 [B, T]");
  TORCH_CHECK(stride >= 1 && compress_block % stride == 0 && selection_block % stride == 0 && n_select >= 1,
              "compressed_selection_cpu: the blocks must be whole strides and n_select at least 1");
  // the memory slot as the reference sees it: in the queries' dtype
  const at::Tensor memory = memory_in.to(q.scalar_type()).to(at::kFloat).contiguous();
  at::Tensor out = at::empty({batch, n_queries, n_heads, width}, q.options());  // [B, T, H, D]
  at::Tensor chosen = at::empty({batch, n_groups, n_queries, n_select}, positions.options());
  const bool bf16_queries = is_bf16(q), bf16_storage = is_bf16(keys);
  const int64_t element = bf16_storage ? 2 : 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(width));
  const int64_t per_group = n_heads / n_groups;
  const int64_t probability_stride = (1 + n_slots + MAX_LANES - 1) / MAX_LANES * MAX_LANES;
  const int64_t config[4] = {compress_block, stride, selection_block, n_select};
  at::parallel_for(0, batch * n_groups * n_queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(per_group * width), rows(per_group * width);
    std::vector<float> probabilities(per_group * probability_stride), mass(1 + n_slots), importance;
    std::vector<int64_t> order;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (n_groups * n_queries), g = index / n_queries % n_groups, t = index % n_queries;
      const int64_t position = positions.data_ptr<int64_t>()[b * n_queries + t];
      TORCH_CHECK(position >= 0, "compressed_selection_cpu: negative position ", position);
      const int64_t complete = position + 1 < compress_block ? 0 : (position + 1 - compress_block) / stride + 1;
      for (int64_t r = 0; r < per_group; ++r)
        rows_to_float(q.data_ptr(), b * q.stride(0) + (g * per_group + r) * q.stride(1) + t * q.stride(2), 1, width,
                      bf16_queries, queries.data() + r * width);
      for (float& x : queries) x *= scale;
      const int64_t storage_offset = (b * keys.stride(0) + g * keys.stride(1)) * element;
      const float* memory_rows = memory.data_ptr<float>() + g * width;
      const CompressedTask task{queries.data(), memory_rows, memory_rows + n_groups * width,
                                static_cast<const char*>(keys.data_ptr()) + storage_offset,
                                static_cast<const char*>(values.data_ptr()) + storage_offset,
                                bf16_storage, per_group, std::min(complete, n_slots), probability_stride,
                                probabilities.data(), mass.data(), rows.data()};
      with_head_vectors<NATIVE_LANES>(width / NATIVE_LANES, [&](auto vectors) {
        attend_compressed<NATIVE_LANES, decltype(vectors)::value>(task);
      });
      attnlab_cpu::choose_blocks(mass.data(), 1 + task.n_visible, position, config, importance, order,
                                 chosen.data_ptr<int64_t>() + index * n_select, nullptr);
      for (int64_t r = 0; r < per_group; ++r) {  // head g * R + r of query t: out[b, t, h]
        write_row(out.data_ptr(), ((b * n_queries + t) * n_heads + g * per_group + r) * width,
                  rows.data() + r * width, width, bf16_queries);
      }
    }
  });
  return {out.transpose(1, 2), chosen};  // [B, H, T, D], [B, G, T, n_select]
}

// Routing's keys through a cache: for each query (row b, routed head r, position p), the last
// `n_keys` positions at or before p whose cluster is the query's own (clusters[b, r, p]), latest
// first, -1 past the ones there are: what a top-k of the matching positions gives, found by a scan
// back from p that stops at the n_keys-th match (a step's cost follows the window, not the storage).
// clusters [B, R, L] int64, positions [B, T] int64 -> [B, R, T, n_keys] int64
at::Tensor routed_keys_cpu(const at::Tensor& clusters_in, const at::Tensor& positions_in, int64_t n_keys) {
  const at::Tensor clusters = clusters_in.contiguous(), positions = positions_in.contiguous();
  TORCH_CHECK(clusters.dim() == 3 && clusters.scalar_type() == at::kLong,
              "routed_keys_cpu: clusters must be int64 [B, R, L]");
  const int64_t batch = clusters.size(0), n_routed = clusters.size(1), length = clusters.size(2);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 2 && positions.size(0) == batch,
              "routed_keys_cpu: positions must be int64 [B, T]");
  TORCH_CHECK(n_keys >= 1, "routed_keys_cpu: n_keys must be at least 1, got ", n_keys);
  const int64_t n_queries = positions.size(1);
  at::Tensor picked = at::empty({batch, n_routed, n_queries, n_keys}, clusters.options());
  const int64_t* cluster = clusters.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  int64_t* out = picked.data_ptr<int64_t>();
  at::parallel_for(0, batch * n_routed * n_queries, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (n_routed * n_queries), r = index / n_queries % n_routed, t = index % n_queries;
      const int64_t* row = cluster + (b * n_routed + r) * length;
      const int64_t p = position[b * n_queries + t];
      TORCH_CHECK(p >= 0 && p < length, "routed_keys_cpu: position ", p, " outside the storage of ", length);
      int64_t* keys = out + index * n_keys;
      int64_t found = 0;
      for (int64_t j = p; j >= 0 && found < n_keys; --j)
        if (row[j] == row[p]) keys[found++] = j;
      std::fill(keys + found, keys + n_keys, int64_t{-1});
    }
  });
  return picked;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("cached_attention_cpu(Tensor q, Tensor keys, Tensor values, Tensor positions, int window, int lanes=0) "
        "-> Tensor");
  m.def("listed_attention_cpu(Tensor q, Tensor keys, Tensor values, Tensor starts, Tensor biases, int block, "
        "Tensor positions) -> Tensor");
  m.def("routed_keys_cpu(Tensor clusters, Tensor positions, int n_keys) -> Tensor");
  m.def("compressed_selection_cpu(Tensor q, Tensor memory, Tensor keys, Tensor values, Tensor positions, "
        "int compress_block, int stride, int selection_block, int n_select) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("cached_attention_cpu", &cached_attention_cpu);
  m.impl("listed_attention_cpu", &listed_attention_cpu);
  m.impl("routed_keys_cpu", &routed_keys_cpu);
  m.impl("compressed_selection_cpu", &compressed_selection_cpu);
}
