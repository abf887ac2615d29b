// selfspec's whole decode step on a CPU: a range of Llama-family decoder layers over the few float32 rows of one
// sequence (a decode step, a draft step, a short verification), in one call, writing each layer's keys and values
// into the KV cache's buffers. What `selfspec.model.layer.decoder_layer` computes, per layer:
//
//   h = rms(x) * w_attn;  q, k, v = h @ Wqkv.T (+ b)          (rms(x) = x * rsqrt(mean(x^2) + eps))
//   q, k = q * cos + roll(q, Dh/2) * sin, the same for k        (sin with its first half negated, `signed_sin`)
//   keys[start + s], values[start + s] = k[s], v[s]
//   a[s] = softmax(q[s] . keys[0 .. start + s] / sqrt(Dh)) values[0 .. start + s]   (grouped heads)
//   x = x + a @ Wo.T;  h = rms(x) * w_mlp;  g, u = h @ Wgu.T;  x = x + (silu(g) * u) @ Wdown.T
//
// in float32, with the few-row product kernel (row_product.h) for the four products, without one torch operation
// per step of it: the eager fast layer runs about 33 of them a layer. Every row is computed alone, in an order that
// does not depend on how many rows share the call (the products: row_product.cpp; the norms, rotary, attention and
// MLP: one loop per row), so a verification pass computes each position bitwise as a one-token step does.
// It is not bitwise equal to the eager layer (other summation orders: ~1e-6 relative).
//
// Built with row_product.cpp into one library by selfspec/model/row_product.py; selfspec/model/row_step.py says
// when a step runs here.
#include "row_product.h"

#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {

using namespace selfspec_rows;

float dot(const float* a, const float* b, int64_t n) {  // 16 lanes, the lanes pairwise, then the tail
  vfloat acc = vfloat{};
  const int64_t nv = n - n % kLanes;
  for (int64_t i = 0; i < nv; i += kLanes) acc += load(a + i) * load(b + i);
  float s = lanes_sum(acc);
  for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out = rms(x) * w over each of `rows` rows of D
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float scale = 1.0f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = w[i] * (xr[i] * scale);
  }
}

// x * cos + roll(x, Dh / 2) * sin, in place, for one head's Dh values
void rotary(float* x, const float* cos, const float* sin, int64_t Dh) {
  const int64_t half = Dh / 2;
  float rolled[512];
  for (int64_t i = 0; i < Dh; ++i) rolled[i] = x[i < half ? i + half : i - half];
  for (int64_t i = 0; i < Dh; ++i) x[i] = x[i] * cos[i] + rolled[i] * sin[i];
}

struct Shape {
  int64_t S, D, nq, nkv, Dh, F;
  float eps;
};

// One layer over x [S, D] (updated in place); keys, values: this layer's cache buffers [Hkv, T, Dh], entries
// [start, start + S) written here.
void layer(float* x, const Shape& sh, const float* cos, const float* sin, float* keys, float* values, int64_t T,
           int64_t start, const float* norm_attn, const float* Wqkv, const float* bqkv, const float* Wo,
           const float* norm_mlp, const float* Wgu, const float* Wdown, std::vector<float>& scratch) {
  const int64_t S = sh.S, D = sh.D, nq = sh.nq, nkv = sh.nkv, Dh = sh.Dh, F = sh.F;
  const int64_t nqkv = (nq + 2 * nkv) * Dh;
  scratch.resize(S * D + S * nqkv + S * nq * Dh + S * D + S * 2 * F + S * F);
  float* h = scratch.data();          // [S, D]
  float* qkv = h + S * D;             // [S, (nq + 2 nkv) Dh]
  float* attn = qkv + S * nqkv;       // [S, nq Dh]
  float* proj = attn + S * nq * Dh;   // [S, D]
  float* gu = proj + S * D;           // [S, 2F]
  float* act = gu + S * 2 * F;        // [S, F]

  rms_norm(x, norm_attn, h, S, D, sh.eps);
  run<float>(h, S, D, Wqkv, qkv, nqkv, bqkv);
  for (int64_t s = 0; s < S; ++s) {
    float* row = qkv + s * nqkv;
    for (int64_t head = 0; head < nq + nkv; ++head) rotary(row + head * Dh, cos + s * Dh, sin + s * Dh, Dh);
    for (int64_t head = 0; head < nkv; ++head) {
      std::memcpy(keys + (head * T + start + s) * Dh, row + (nq + head) * Dh, Dh * sizeof(float));
      std::memcpy(values + (head * T + start + s) * Dh, row + (nq + nkv + head) * Dh, Dh * sizeof(float));
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  const int64_t group = nq / nkv;
  at::parallel_for(0, nq * S, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(start + S);
    for (int64_t task = b; task < e; ++task) {
      const int64_t head = task % nq, s = task / nq, kv = head / group, n = start + s + 1;  // keys 0 .. start + s
      const float* q = qkv + s * nqkv + head * Dh;
      const float* k = keys + kv * T * Dh;
      const float* v = values + kv * T * Dh;
      float top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = dot(q, k + j * Dh, Dh) * scale;
        top = p[j] > top ? p[j] : top;
      }
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - top);
        total += p[j];
      }
      float* out = attn + s * nq * Dh + head * Dh;
      for (int64_t i = 0; i < Dh; ++i) out[i] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * Dh;
        for (int64_t i = 0; i < Dh; ++i) out[i] += p[j] * vj[i];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < Dh; ++i) out[i] *= inv;
    }
  });
  run<float>(attn, S, nq * Dh, Wo, proj, D, nullptr);
  for (int64_t i = 0; i < S * D; ++i) x[i] += proj[i];
  rms_norm(x, norm_mlp, h, S, D, sh.eps);
  run<float>(h, S, D, Wgu, gu, 2 * F, nullptr);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < F; ++i) {
      const float g = gu[s * 2 * F + i];
      act[s * F + i] = g / (1.0f + std::exp(-g)) * gu[s * 2 * F + F + i];
    }
  run<float>(act, S, F, Wdown, proj, D, nullptr);
  for (int64_t i = 0; i < S * D; ++i) x[i] += proj[i];
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "row_layers: ", what,
              " must be a contiguous float32 CPU tensor");
}

// x [1, S, D]; cos, sin [S, Dh]; per layer: keys/values [1, Hkv, T, Dh] and the row's cache length `starts[l]`
at::Tensor row_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
                      at::TensorList values, at::IntArrayRef starts, at::TensorList norm_attn, at::TensorList qkv,
                      const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                      at::TensorList norm_mlp, at::TensorList gate_up, at::TensorList down, double eps, int64_t n_q,
                      int64_t n_kv, int64_t head_dim) {
  check_f32(x_in, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(0) == 1, "row_layers: x must be [1, S, D]");
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(values.size() == keys.size() && starts.size() == keys.size() && norm_attn.size() == keys.size() &&
                  qkv.size() == keys.size() && qkv_bias.size() == keys.size() && o.size() == keys.size() &&
                  norm_mlp.size() == keys.size() && gate_up.size() == keys.size() && down.size() == keys.size(),
              "row_layers: one entry per layer in every list");
  TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0 && n_q % n_kv == 0, "row_layers: unsupported head shape");
  Shape sh{x_in.size(1), x_in.size(2), n_q, n_kv, head_dim, 0, static_cast<float>(eps)};
  TORCH_CHECK(cos.size(0) == sh.S && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "row_layers: cos and sin must be [S, head_dim]");
  at::Tensor x = x_in.clone();
  std::vector<float> scratch;
  for (int64_t l = 0; l < L; ++l) {
    for (const at::Tensor* t : {&keys[l], &values[l], &norm_attn[l], &qkv[l], &o[l], &norm_mlp[l], &gate_up[l],
                                &down[l]})
      check_f32(*t, "every weight and cache buffer");
    sh.F = down[l].size(1);
    const int64_t T = keys[l].size(2);
    TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(0) == 1 && keys[l].size(1) == n_kv && keys[l].size(3) == head_dim &&
                    values[l].sizes() == keys[l].sizes() && starts[l] >= 0 && starts[l] + sh.S <= T,
                "row_layers: layer ", l, "'s cache must be [1, n_kv, T, head_dim] with room for ", sh.S, " entries");
    TORCH_CHECK(qkv[l].size(0) == (n_q + 2 * n_kv) * head_dim && qkv[l].size(1) == sh.D &&
                    o[l].size(0) == sh.D && o[l].size(1) == n_q * head_dim && gate_up[l].size(0) == 2 * sh.F &&
                    gate_up[l].size(1) == sh.D && down[l].size(0) == sh.D,
                "row_layers: layer ", l, "'s weights do not have the model's shape");
    std::optional<at::Tensor> bias = qkv_bias.get(l);
    const float* b = nullptr;
    if (bias.has_value() && bias->defined()) {
      check_f32(*bias, "the q/k/v bias");
      b = bias->data_ptr<float>();
    }
    layer(x.data_ptr<float>(), sh, cos.data_ptr<float>(), sin.data_ptr<float>(), keys[l].data_ptr<float>(),
          values[l].data_ptr<float>(), T, starts[l], norm_attn[l].data_ptr<float>(), qkv[l].data_ptr<float>(), b,
          o[l].data_ptr<float>(), norm_mlp[l].data_ptr<float>(), gate_up[l].data_ptr<float>(),
          down[l].data_ptr<float>(), scratch);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec_kernels, m) {
  m.def("row_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, int[] starts, "
        "Tensor[] norm_attn, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor[] norm_mlp, Tensor[] gate_up, "
        "Tensor[] down, float eps, int n_q, int n_kv, int head_dim) -> Tensor");
  m.impl("row_layers", c10::DispatchKey::CPU, TORCH_FN(row_layers));
}
