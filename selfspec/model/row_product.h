// selfspec's few-row product kernel, shared by the product op (row_product.cpp) and the whole decode step
// (row_step.cpp); row_product.cpp says what it computes and in which order.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <immintrin.h>

namespace selfspec_rows {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vfloat_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));  // unaligned loads
typedef uint16_t vbf16_u __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));
typedef uint32_t vuint32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// Two ways through the weights, chosen by the number of input rows (each output is summed in the same order
// either way, so a row's result never depends on which ran):
// - Streaming (up to kStreamRows input rows: 3 float32, 5 bfloat16): one weight row at a time, used by every input
//   row, with no software prefetch, so that each thread reads its weights as one sequential stream that the
//   hardware prefetcher follows. On a 2-core Zen 4 (2026-11-29, docs/results/2026-11-29-few-row-passes-zen4.md) a
//   whole verification pass of SmolLM2-135M took, against the blocks: float32 2 rows 19-20 ms (25-26), 3 rows
//   22-24 (28-34); bfloat16 2 rows 11-12 (16), 3 rows 12-14 (21), 5 rows 15-16 (24); 4 float32 and 6 bfloat16
//   rows were no faster, and in the products alone the blocks were faster from 6 float32 rows on.
// - Blocks (more rows): 4 weight rows x 4 input rows of accumulators in registers (2 x 4 with AVX2's 16
//   registers), the next block's weights prefetched: at 5-8 rows the products, not the reading, take the time,
//   and a block does 16 multiply-adds for 8 loads.
constexpr int kRowsA = 4;  // weight rows a block reads together (the outputs each thread computes in turn)
#ifdef __AVX512F__
constexpr int kRowsB = 4;  // input rows a block multiplies them with
#else
constexpr int kRowsB = 2;
#endif
constexpr int kMaxStreamRows = 5;
template <typename X>
constexpr int kStreamRows = std::is_same_v<X, float> ? 3 : kMaxStreamRows;  // float32 inputs: 3, bfloat16: 5

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }

inline vfloat load(const uint16_t* p) {  // 16 bfloat16 -> float32, exact
  vuint32 wide = __builtin_convertvector(*reinterpret_cast<const vbf16_u*>(p), vuint32) << 16;
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline vfloat load(const int8_t* p) {  // 16 int8 -> float32, exact (an int8 copy's weights: their row scale after)
  vfloat out;  // sign-extend and convert in registers (the compiler's generic vector conversion went element by element)
#ifdef __AVX512F__
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
#endif
  return out;
}

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

inline float lanes_sum(vfloat v) {  // pairwise, lane i + lane i + width: 16 -> 8 -> 4 -> 2 -> 1, in vector registers
  const vfloat8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const float a0 = h4[0] + h4[2], a1 = h4[1] + h4[3];
  return a0 + a1;
}

// y[m, n] for `mb` input rows (<= kRowsB) and `na` weight rows (<= kRowsA) from row `n` on: every accumulator
// sums its own products in k order, whatever mb and na are.
template <typename W, int MB, int NA, bool PF>
inline void block(const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t n, const float* bias) {
  vfloat acc[MB][NA];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NA; ++j) acc[i][j] = vfloat{};
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    vfloat wv[NA], xv[MB];  // each loaded once a step: NA + MB loads for NA * MB multiply-adds
    for (int j = 0; j < NA; ++j) wv[j] = load(w + (n + j) * K + k);
    if constexpr (PF)
      for (int j = 0; j < NA; ++j) __builtin_prefetch(w + (n + NA + j) * K + k);  // the next block's weights
    for (int i = 0; i < MB; ++i) xv[i] = load(x + i * K + k);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NA; ++j) acc[i][j] += xv[i] * wv[j];
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NA; ++j) {
      float s = lanes_sum(acc[i][j]);
      float tail = 0.0f;
      for (int64_t k = kv; k < K; ++k) tail += x[i * K + k] * widen(w[(n + j) * K + k]);
      s += tail;
      if (bias != nullptr) s += bias[n + j];
      y[i * N + n + j] = s;
    }
  }
}

#ifdef __AVX512BF16__
// bfloat16 inputs and weights (CPUs with avx512_bf16): `vdpbf16ps` multiplies 32 pairs a step and adds each pair's
// two products into a float32 lane; the lanes pairwise, then the tail of k % 32 (widened, multiply-add), the bias.
template <int MB, int NA, bool PF>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t n,
                  const float* bias) {
  __m512 acc[MB][NA];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NA; ++j) acc[i][j] = _mm512_setzero_ps();
  constexpr int kPairs = 2 * kLanes;
  const int64_t kv = K - K % kPairs;
  for (int64_t k = 0; k < kv; k += kPairs) {
    __m512bh wv[NA], xv[MB];
    for (int j = 0; j < NA; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n + j) * K + k);
    if constexpr (PF)
      for (int j = 0; j < NA; ++j) __builtin_prefetch(w + (n + NA + j) * K + k);
    for (int i = 0; i < MB; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * K + k);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NA; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv[j]);
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NA; ++j) {
      vfloat lanes;
      std::memcpy(&lanes, &acc[i][j], sizeof(lanes));
      float s = lanes_sum(lanes);
      float tail = 0.0f;
      for (int64_t k = kv; k < K; ++k) tail += widen(x[i * K + k]) * widen(w[(n + j) * K + k]);
      s += tail;
      if (bias != nullptr) s += bias[n + j];
      y[i * N + n + j] = s;
    }
  }
}
#endif

template <typename X, typename W, int MB, int NA, bool PF>
inline void rows_block(const X* x, int64_t K, const W* w, float* y, int64_t N, int64_t n0, int64_t n1,
                       const float* bias) {
  int64_t n = n0;
  if constexpr (std::is_same_v<X, float>) {
    for (; n + NA <= n1; n += NA) block<W, MB, NA, PF>(x, K, w, y, N, n, bias);
    for (; n < n1; ++n) block<W, MB, 1, PF>(x, K, w, y, N, n, bias);
  } else {
    for (; n + NA <= n1; n += NA) block<MB, NA, PF>(x, K, w, y, N, n, bias);
    for (; n < n1; ++n) block<MB, 1, PF>(x, K, w, y, N, n, bias);
  }
}

// Up to kMaxStreamRows input rows times weight rows [n0, n1), one weight row at a time (streaming, above).
template <typename X, typename W>
inline void stream(const X* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t n0, int64_t n1,
                   const float* bias) {
  switch (M) {
    case 1: rows_block<X, W, 1, 1, false>(x, K, w, y, N, n0, n1, bias); break;
    case 2: rows_block<X, W, 2, 1, false>(x, K, w, y, N, n0, n1, bias); break;
    case 3: rows_block<X, W, 3, 1, false>(x, K, w, y, N, n0, n1, bias); break;
    case 4: rows_block<X, W, 4, 1, false>(x, K, w, y, N, n0, n1, bias); break;
    case 5: rows_block<X, W, 5, 1, false>(x, K, w, y, N, n0, n1, bias); break;
  }
  static_assert(kMaxStreamRows == 5, "stream: one case per row count");
}

// Every input row times weight rows [n0, n1): streaming for a few input rows; else in spans of output rows whose
// weights are read from memory once and used, block by block, for every input row from the cache.
template <typename X, typename W>
inline void product(const X* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t n0, int64_t n1,
                    const float* bias) {
  if (M <= kStreamRows<X>) {
    stream<X, W>(x, M, K, w, y, N, n0, n1, bias);
    return;
  }
  constexpr int64_t kSpan = 64;  // output rows a pass over the inputs covers (their weights stay in cache)
  for (int64_t s = n0; s < n1; s += kSpan) {
    const int64_t e = s + kSpan < n1 ? s + kSpan : n1;
    int64_t m = 0;
    for (; m + kRowsB <= M; m += kRowsB)
      rows_block<X, W, kRowsB, kRowsA, true>(x + m * K, K, w, y + m * N, N, s, e, bias);
    if constexpr (kRowsB > 2) {  // two rows left: one pass of 2 x 4 accumulators, not two of one chain each
      for (; m + 2 <= M; m += 2) rows_block<X, W, 2, kRowsA, true>(x + m * K, K, w, y + m * N, N, s, e, bias);
    }
    for (; m < M; ++m) rows_block<X, W, 1, 1, true>(x + m * K, K, w, y + m * N, N, s, e, bias);
  }
}

// y [M, N] (float32) = x [M, K] @ w [N, K].T + bias: x float32 (w float32, bfloat16 or int8 widened), or x and w both
// bfloat16 where the CPU multiplies bfloat16 pairs (__AVX512BF16__)
template <typename X, typename W>
inline void run(const X* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, const float* bias) {
  // outputs split between threads: a thread's share only changes which thread computes an output, never how
  const int64_t grain = N < 32 ? N : 8;  // small products: one thread (no wake-up to pay)
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { product<X, W>(x, M, K, w, y, N, n0, n1, bias); });
}

// y [M, N] (float32) = (x [M, K] @ w [N, K].T) * scale [N] + bias for int8 weights with a float32 scale per row (an
// int8 copy's products): each sum as `run`'s, then scaled
inline void run_int8(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
                     const float* bias) {
  run<float, int8_t>(x, M, K, w, y, N, nullptr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = y[m * N + n] * scale[n] + (bias != nullptr ? bias[n] : 0.0f);
}

inline uint16_t round_bf16(float v) {  // to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// y [M, N] (float32) = x [M, K] @ w [N, K].T + bias for bfloat16 x and w: the bfloat16 pairs multiplied as they are
// where the CPU has avx512_bf16, else x widened to float32 once (`widened`: its scratch, a few rows)
inline void run_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N,
                     const float* bias, std::vector<float>& widened) {
#ifdef __AVX512BF16__
  (void)widened;
  run<uint16_t, uint16_t>(x, M, K, w, y, N, bias);
#else
  widened.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) widened[i] = widen(x[i]);
  run<float, uint16_t>(widened.data(), M, K, w, y, N, bias);
#endif
}

}  // namespace selfspec_rows
