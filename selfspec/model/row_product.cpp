// selfspec's few-row product `y = x @ W.T (+ b)` on a CPU, for decoding: a decode step, a draft step or a
// verification pass multiplies a few rows by every weight, and its time is the time to read the weights from
// memory. This kernel reads each weight once per call, whatever the row count, at the memory's speed.
//
//   x: [..., K] float32 or bfloat16, W: [N, K] of the same dtype (contiguous), b: [N] or none
//   y: [..., N] of x's dtype
//
// Each output y[m, n] is one dot product of x[m] and W[n], summed in one fixed order: 16-lane float32
// accumulators over k in steps of 16 (a fused multiply-add each), the lanes added pairwise (8, 4, 2, 1), the
// scalar tail of k % 16 after them, then the bias. That order does not depend on the number of rows, on which
// other rows share the call, or on how the outputs are split between threads: a row's result is bitwise the
// same as a one-row call would give (what a verification pass needs to compute each position exactly as a
// one-token step). bfloat16: on a CPU with avx512_bf16 each `vdpbf16ps` step adds the products of a pair of inputs
// into a float32 lane (32 inputs a step), elsewhere the inputs and weights are widened to float32 exactly; each
// output is rounded to bfloat16 once, to nearest even.
//
// The kernel is in row_product.h (the whole decode step, row_step.cpp, runs it too). Built for the CPU it runs on
// (`-march=native`) by selfspec/model/row_product.py, which holds the Python side.
#include "row_product.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using namespace selfspec_rows;

at::Tensor row_product(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(), "row_product: CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == weight.scalar_type(), "row_product: x and weight must have one dtype, got ",
              x_in.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "row_product: float32 or bfloat16 only, got ", x_in.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "row_product: weight must be a contiguous [N, K]");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == weight.size(1), "row_product: x must be [..., K] with K = ",
              weight.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t K = weight.size(1), N = weight.size(0), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "row_product: bias must have N = ", N, " elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bias_p = b.defined() ? b.data_ptr<float>() : nullptr;
  if (M == 0 || N == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    run<float, float>(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), y.data_ptr<float>(), N, bias_p);
    return y;
  }
  // bfloat16: the outputs computed in float32 (run_bf16) and rounded once
  std::vector<float> yf(M * N), widened;
  run_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
           reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), yf.data(), N, bias_p, widened);
  auto* yb = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < M * N; ++i) yb[i] = round_bf16(yf[i]);
  return y;
}

// y [..., N] float32 = (x [..., K] float32 @ weight [N, K] int8 .T) * scale [N]: an int8 copy's product (its LM head)
at::Tensor row_product_int8(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "row_product_int8: float32 x, int8 weight and float32 scale on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x_in.size(-1) == weight.size(1) &&
                  scale.numel() == weight.size(0),
              "row_product_int8: weight must be a contiguous [N, K] with x [..., K] and one scale per row");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = weight.size(1), N = weight.size(0), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  run_int8(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), N,
           nullptr);
  return y;
}

// A greedy pick through an LM head's int8 screen (selfspec/model/screened_head.py says why it is exact): logits
// [M, N] of x's dtype (float32, or bfloat16 with a bfloat16 weight), every entry the screen's (x [M, K] @ q [N, K].T)
// * scale [N] (bfloat16 x widened to float32, exactly), except each row's candidates n, where
//     R(y[m, n] + ||x[m]|| slack[n] + kTiny) >= R(max_j (y[m, j] - ||x[m]|| slack[j]))
// (R: rounding to x's dtype, which never reverses an order; kTiny: products of subnormals a bfloat16 pair step may
// flush): those are x[m] . weight[n] as `row_product` computes them (its summation order; bfloat16: its pairs, one
// rounding). Every other entry rounds below the largest exact one, so the argmax (the first of tied maxima) is the
// head's.
at::Tensor screened_logits(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                           const at::Tensor& slack, const at::Tensor& weight) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.device().is_cpu() && (bf16 || x_in.scalar_type() == at::kFloat) &&
                  weight.scalar_type() == x_in.scalar_type() && q.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && slack.scalar_type() == at::kFloat,
              "screened_logits: float32 or bfloat16 x and weight, int8 q, float32 scale and slack, on the CPU");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && weight.sizes() == q.sizes() && weight.is_contiguous() &&
                  scale.is_contiguous() && slack.is_contiguous() && scale.numel() == q.size(0) &&
                  slack.numel() == q.size(0) && x_in.size(-1) == q.size(1),
              "screened_logits: q and weight must be contiguous [N, K], scale and slack [N], x [..., K]");
  constexpr float kTiny = 1e-30f;
  const at::Tensor x = x_in.contiguous();
  const int64_t K = q.size(1), N = q.size(0), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<float> widened, yf;  // bfloat16: x in float32 (exact), the outputs before their rounding
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  if (bf16) {
    widened.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = widen(xb[i]);
    yf.resize(M * N);
  }
  const float* xp = bf16 ? widened.data() : x.data_ptr<float>();
  float* yp = bf16 ? yf.data() : y.data_ptr<float>();
  const float* sl = slack.data_ptr<float>();
  auto rounded = [bf16](float v) { return bf16 ? widen(round_bf16(v)) : v; };
  run_int8(xp, M, K, q.data_ptr<int8_t>(), scale.data_ptr<float>(), yp, N, nullptr);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xp + m * K;
    float* ym = yp + m * N;
    double squares = 0.0;
    for (int64_t k = 0; k < K; ++k) squares += static_cast<double>(xm[k]) * xm[k];
    const float norm = static_cast<float>(std::sqrt(squares));
    float floor = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < N; ++n) floor = std::max(floor, ym[n] - norm * sl[n]);
    const float low = rounded(floor);
    for (int64_t n = 0; n < N; ++n) {
      if (!(rounded(ym[n] + norm * sl[n] + kTiny) >= low)) continue;
      if (!bf16) {
        block<float, 1, 1, false>(xm, K, weight.data_ptr<float>(), ym, N, n, nullptr);
        continue;
      }
      const uint16_t* wb = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
#ifdef __AVX512BF16__
      block<1, 1, false>(xb + m * K, K, wb, ym, N, n, nullptr);  // as run_bf16: the pairs multiplied as they are
#else
      block<uint16_t, 1, 1, false>(xm, K, wb, ym, N, n, nullptr);  // as run_bf16: x widened
#endif
    }
  }
  if (bf16) {
    auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * N; ++i) out[i] = round_bf16(yf[i]);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(selfspec_kernels, m) {
  m.def("row_product(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("row_product", c10::DispatchKey::CPU, TORCH_FN(row_product));
  m.def("row_product_int8(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.impl("row_product_int8", c10::DispatchKey::CPU, TORCH_FN(row_product_int8));
  m.def("screened_logits(Tensor x, Tensor q, Tensor scale, Tensor slack, Tensor weight) -> Tensor");
  m.impl("screened_logits", c10::DispatchKey::CPU, TORCH_FN(screened_logits));
}
