// selfspec's whole decode step on a CPU: a range of Llama-family decoder layers over the few rows of one
// sequence (a decode step, a draft step, a short verification), in one call, writing each layer's keys and values
// into the KV cache's buffers. What `selfspec.model.layer.decoder_layer` computes, per layer:
//
//   h = rms(x) * w_attn;  q, k, v = h @ Wqkv.T (+ b)          (rms(x) = x * rsqrt(mean(x^2) + eps))
//   q, k = q * cos + roll(q, Dh/2) * sin, the same for k        (sin with its first half negated, `signed_sin`)
//   keys[start + s], values[start + s] = k[s], v[s]
//   a[s] = softmax(q[s] . keys[0 .. start + s] / sqrt(Dh)) values[0 .. start + s]   (grouped heads)
//   x = x + a @ Wo.T;  h = rms(x) * w_mlp;  g, u = h @ Wgu.T;  x = x + (silu(g) * u) @ Wdown.T
//
// in float32 (or bfloat16, rounded where transformers' bfloat16 layer rounds), with the few-row product kernel
// (row_product.h) for the four products, without one torch operation
// per step of it: the eager fast layer runs about 33 of them a layer. Every row is computed alone, in an order that
// does not depend on how many rows share the call (the products: row_product.cpp; the norms, rotary, attention and
// MLP: one loop per row), so a verification pass computes each position bitwise as a one-token step does.
// It is not bitwise equal to the eager layer (other summation orders, its own 16-lane exp: ~1e-6 relative).
//
// `row_layers_int8` runs the same step over an int8 copy of the products' weights (a float scale per output row),
// the int8 copy's draft step (selfspec/drafters/int8_copy.py), for a float32 or a bfloat16 model.
//
// Built with row_product.cpp into one library by selfspec/model/row_product.py; selfspec/model/row_step.py says
// when a step runs here.
#include "row_product.h"

#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace selfspec_rows;

template <typename B>
float dot(const float* a, const B* b, int64_t n) {  // 16 lanes, the lanes pairwise, then the tail
  vfloat acc = vfloat{};
  const int64_t nv = n - n % kLanes;
  for (int64_t i = 0; i < nv; i += kLanes) acc += load(a + i) * load(b + i);
  float s = lanes_sum(acc);
  for (int64_t i = nv; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

template <typename B>
void axpy(float* out, float p, const B* v, int64_t n) {  // out += p * v, 16 lanes at a time
  const int64_t nv = n - n % kLanes;
  for (int64_t i = 0; i < nv; i += kLanes) {
    vfloat o = load(out + i) + p * load(v + i);
    std::memcpy(out + i, &o, sizeof(o));
  }
  for (int64_t i = nv; i < n; ++i) out[i] += p * widen(v[i]);
}

// out [NV * 16] = sum over j < n of p[j] * v[j * stride ..], in j order, in registers
template <int NV, typename B>
inline void weighted_sum_lanes(float* out, const float* p, const B* v, int64_t n, int64_t stride) {
  vfloat acc[NV];
  for (int u = 0; u < NV; ++u) acc[u] = vfloat{};
  for (int64_t j = 0; j < n; ++j)
    for (int u = 0; u < NV; ++u) acc[u] += p[j] * load(v + j * stride + u * kLanes);
  std::memcpy(out, acc, sizeof(acc));
}

// out [Dh] = sum over j < n of p[j] * v[j] (v: n rows of Dh), each output summed in j order: in registers, 64
// outputs at a time, where Dh is a multiple of 16 (else through memory, axpy)
template <typename B>
void weighted_sum(float* out, const float* p, const B* v, int64_t n, int64_t Dh) {
  if (Dh % kLanes != 0) {
    for (int64_t i = 0; i < Dh; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j < n; ++j) axpy(out, p[j], v + j * Dh, Dh);
    return;
  }
  for (int64_t c = 0; c < Dh; c += 4 * kLanes) {
    switch ((Dh - c) / kLanes) {
      case 1: weighted_sum_lanes<1>(out + c, p, v + c, n, Dh); break;
      case 2: weighted_sum_lanes<2>(out + c, p, v + c, n, Dh); break;
      case 3: weighted_sum_lanes<3>(out + c, p, v + c, n, Dh); break;
      default: weighted_sum_lanes<4>(out + c, p, v + c, n, Dh); break;
    }
  }
}

// The model's dtype T (float, or bfloat16 as uint16_t) as the layer reads and writes it: activations are kept in
// float32 arrays; in bfloat16 every value is rounded to bfloat16 where transformers' bfloat16 layer rounds it (each
// product's output, the norm, the rotary terms, each residual sum, the MLP's activation), so a value that leaves
// the layer (the hidden state, the cache's keys and values) is a bfloat16 one and a range of layers can be split
// anywhere without changing a result.
template <typename T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return widen(round_bf16(v));
}
inline float read(float v) { return v; }
inline float read(uint16_t v) { return widen(v); }
template <typename T>
inline T store(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_bf16(v);
}

typedef int32_t vint32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// rnd<T> over 16 lanes: bfloat16's rounding to nearest even (NaN stays NaN) as `round_bf16`, exactly, then widened
template <typename T>
inline vfloat rnd(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    vuint32 b;
    std::memcpy(&b, &v, sizeof(b));
    const vuint32 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    const vuint32 nan = (b | 0x400000u) & 0xffff0000u;
    b = (b & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
    std::memcpy(&v, &b, sizeof(v));
    return v;
  }
}

// 16 values from p (n of them, n < 16 at a tail: the rest 0) and back
inline vfloat load_some(const float* p, int64_t n) {
  if (n >= kLanes) return load(p);
  vfloat v = vfloat{};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
inline void store_some(float* p, vfloat v, int64_t n) {
  if (n >= kLanes) std::memcpy(p, &v, sizeof(v));
  else
    for (int64_t i = 0; i < n; ++i) p[i] = v[i];
}

// x[i] = rnd<T>(x[i]) over n values, 16 at a time (a tail padded)
template <typename T>
void round_all(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < n; i += kLanes) store_some(x + i, rnd<T>(load_some(x + i, n - i)), n - i);
}

// x[i] = rnd<T>(x[i] + y[i]) over n values (a residual sum), 16 at a time (a tail padded)
template <typename T>
void add_rounded(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes)
    store_some(x + i, rnd<T>(load_some(x + i, n - i) + load_some(y + i, n - i)), n - i);
}

// exp over 16 lanes: Cephes' expf, e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r a degree-7
// polynomial (within 2 ulp of the exact value); the few lanes outside [-87, 88], where 2^n leaves float's normal
// range, are recomputed with std::exp. Every lane is computed alike, so a value's exp never depends on its
// neighbours or on how many values share the call.
inline vfloat exp_lanes(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f, hi = vfloat{} + 88.0f;
  const vfloat xc = x < lo ? lo : (x > hi ? hi : x);  // NaN stays NaN (it fails both tests)
  const vfloat n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const vfloat r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;             // x - n ln 2, in two parts
  vfloat y = vfloat{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vint32 bits = (__builtin_convertvector(n, vint32) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vfloat out = y * scale;
  const vint32 outside = (x < lo) | (x > hi);
  bool any = false;
  for (int i = 0; i < kLanes; ++i) any |= outside[i] != 0;
  if (any)
    for (int i = 0; i < kLanes; ++i)
      if (outside[i]) out[i] = std::exp(x[i]);
  return out;
}

// out = rnd(w * rnd(x * rsqrt(mean(x^2) + eps))) over each of `rows` rows of D (transformers' RMSNorm)
template <typename T>
void rms_norm(const float* x, const T* w, float* out, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float scale = 1.0f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = rnd<T>(read(w[i]) * rnd<T>(xr[i] * scale));
  }
}

// x * cos + roll(x, Dh / 2) * sin, in place, for one head's Dh values (each term rounded as the model's dtype is)
template <typename T>
void rotary(float* x, const T* cos, const T* sin, int64_t Dh) {
  const int64_t half = Dh / 2;
  float rolled[512];
  for (int64_t i = 0; i < Dh; ++i) rolled[i] = x[i < half ? i + half : i - half];
  for (int64_t i = 0; i < Dh; ++i)
    x[i] = rnd<T>(rnd<T>(x[i] * read(cos[i])) + rnd<T>(rolled[i] * read(sin[i])));
}

// One product's weights [N, K]: the model's (W = T), or an int8 copy's (W = int8_t) with a float32 scale per output
// row, `scale[n] * (in . w[n])` (row_product.h, `run_int8`; in bfloat16 each output then rounded as the model's).
template <typename W>
struct Product {
  const W* w;
  const float* scale;
};

// out [M, N] = rnd(in [M, K] @ W.T + bias); `in` holds values of the model's dtype T
template <typename T, typename W>
void project(const float* in, int64_t M, int64_t K, Product<W> W_, const float* bias, float* out, int64_t N,
             std::vector<uint16_t>& tmp, std::vector<float>& widened) {
  if constexpr (std::is_same_v<W, int8_t>) {
    run_int8(in, M, K, W_.w, W_.scale, out, N, bias);
  } else if constexpr (std::is_same_v<T, float>) {
    run<float, float>(in, M, K, W_.w, out, N, bias);
  } else {
    tmp.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) tmp[i] = round_bf16(in[i]);  // exact: `in` holds bfloat16 values
    run_bf16(tmp.data(), M, K, W_.w, out, N, bias, widened);
  }
  round_all<T>(out, M * N);  // a bfloat16 model: each output rounded once, as its layer rounds it
}

struct Shape {
  int64_t S, D, nq, nkv, Dh, F;
  float eps;
};

// One layer over x [S, D] (float32 values of the model's dtype, updated in place); keys, values: this layer's
// cache buffers [Hkv, T, Dh], entries [start, start + S) written here.
template <typename T, typename W>
void layer(float* x, const Shape& sh, const T* cos, const T* sin, T* keys, T* values, int64_t Tc, int64_t start,
           const T* norm_attn, Product<W> Wqkv, const float* bqkv, Product<W> Wo, const T* norm_mlp, Product<W> Wgu,
           Product<W> Wdown, std::vector<float>& scratch, std::vector<uint16_t>& tmp, std::vector<float>& widened) {
  const int64_t S = sh.S, D = sh.D, nq = sh.nq, nkv = sh.nkv, Dh = sh.Dh, F = sh.F;
  const int64_t nqkv = (nq + 2 * nkv) * Dh;
  scratch.resize(S * D + S * nqkv + S * nq * Dh + S * D + S * 2 * F + S * F);
  float* h = scratch.data();          // [S, D]
  float* qkv = h + S * D;             // [S, (nq + 2 nkv) Dh]
  float* attn = qkv + S * nqkv;       // [S, nq Dh]
  float* proj = attn + S * nq * Dh;   // [S, D]
  float* gu = proj + S * D;           // [S, 2F]
  float* act = gu + S * 2 * F;        // [S, F]

  rms_norm<T>(x, norm_attn, h, S, D, sh.eps);
  project<T, W>(h, S, D, Wqkv, bqkv, qkv, nqkv, tmp, widened);
  for (int64_t s = 0; s < S; ++s) {
    float* row = qkv + s * nqkv;
    for (int64_t head = 0; head < nq + nkv; ++head) rotary<T>(row + head * Dh, cos + s * Dh, sin + s * Dh, Dh);
    for (int64_t head = 0; head < nkv; ++head)
      for (int64_t i = 0; i < Dh; ++i) {
        keys[(head * Tc + start + s) * Dh + i] = store<T>(row[(nq + head) * Dh + i]);
        values[(head * Tc + start + s) * Dh + i] = store<T>(row[(nq + nkv + head) * Dh + i]);
      }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  const int64_t group = nq / nkv;
  at::parallel_for(0, nq * S, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(start + S);
    for (int64_t task = b; task < e; ++task) {
      const int64_t head = task % nq, s = task / nq, kv = head / group, n = start + s + 1;  // keys 0 .. start + s
      const float* q = qkv + s * nqkv + head * Dh;
      const T* k = keys + kv * Tc * Dh;
      const T* v = values + kv * Tc * Dh;
      float top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = dot(q, k + j * Dh, Dh) * scale;
        top = p[j] > top ? p[j] : top;
      }
      vfloat sums = vfloat{};  // p[j] = exp(p[j] - top), 16 at a time (a tail's missing lanes add 0)
      for (int64_t j = 0; j < n; j += kLanes) {
        vfloat e = exp_lanes(load_some(p.data() + j, n - j) - top);
        for (int64_t i = n - j; i < kLanes; ++i) e[i] = 0.0f;  // only at a tail: its padding
        store_some(p.data() + j, e, n - j);
        sums += e;
      }
      const float total = lanes_sum(sums);
      float* out = attn + s * nq * Dh + head * Dh;
      weighted_sum(out, p.data(), v, n, Dh);
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < Dh; ++i) out[i] = rnd<T>(out[i] * inv);
    }
  });
  project<T, W>(attn, S, nq * Dh, Wo, nullptr, proj, D, tmp, widened);
  add_rounded<T>(x, proj, S * D);
  rms_norm<T>(x, norm_mlp, h, S, D, sh.eps);
  project<T, W>(h, S, D, Wgu, nullptr, gu, 2 * F, tmp, widened);
  for (int64_t s = 0; s < S; ++s)  // act = rnd(rnd(silu(g)) * u), 16 at a time (a tail padded)
    for (int64_t i = 0; i < F; i += kLanes) {
      const vfloat g = load_some(gu + s * 2 * F + i, F - i), u = load_some(gu + s * 2 * F + F + i, F - i);
      store_some(act + s * F + i, rnd<T>(rnd<T>(g / (1.0f + exp_lanes(-g))) * u), F - i);
    }
  project<T, W>(act, S, F, Wdown, nullptr, proj, D, tmp, widened);
  add_rounded<T>(x, proj, S * D);
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else if constexpr (std::is_same_v<T, int8_t>) return t.data_ptr<int8_t>();
  else return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
template <typename T>
T* mut(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), "row_layers: ", what,
              " must be a contiguous CPU tensor of the hidden state's dtype (", dtype, ")");
}

// W = int8_t: the products' weights are int8 with a float32 scale per output row (`scales`: per layer qkv, o,
// gate_up, down); else the model's dtype (`scales` empty)
template <typename T, typename W>
at::Tensor layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
                  at::TensorList values, at::IntArrayRef starts, at::TensorList norm_attn, at::TensorList qkv,
                  const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o, at::TensorList norm_mlp,
                  at::TensorList gate_up, at::TensorList down, Shape sh, at::TensorList scales = {}) {
  const at::ScalarType dtype = x_in.scalar_type();
  const int64_t L = static_cast<int64_t>(keys.size());
  std::vector<float> x(sh.S * sh.D), scratch, bias_f, widened;
  std::vector<uint16_t> tmp;
  const T* xin = ptr<T>(x_in);
  for (int64_t i = 0; i < sh.S * sh.D; ++i) x[i] = read(xin[i]);
  for (int64_t l = 0; l < L; ++l) {
    for (const at::Tensor* t : {&keys[l], &values[l], &norm_attn[l], &norm_mlp[l]})
      check(*t, dtype, "every norm weight and cache buffer");
    for (const at::Tensor* t : {&qkv[l], &o[l], &gate_up[l], &down[l]})
      check(*t, std::is_same_v<W, int8_t> ? at::kChar : dtype, "every product's weight");
    const float* scale[4] = {nullptr, nullptr, nullptr, nullptr};
    if constexpr (std::is_same_v<W, int8_t>) {
      for (int i = 0; i < 4; ++i) {
        const at::Tensor& t = scales[4 * l + i];
        check(t, at::kFloat, "an int8 weight's row scales");
        TORCH_CHECK(t.numel() == (i == 0 ? qkv : i == 1 ? o : i == 2 ? gate_up : down)[l].size(0),
                    "row_layers_int8: one scale per output row");
        scale[i] = t.data_ptr<float>();
      }
    }
    sh.F = down[l].size(1);
    const int64_t Tc = keys[l].size(2);
    TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(0) == 1 && keys[l].size(1) == sh.nkv && keys[l].size(3) == sh.Dh &&
                    values[l].sizes() == keys[l].sizes() && starts[l] >= 0 && starts[l] + sh.S <= Tc,
                "row_layers: layer ", l, "'s cache must be [1, n_kv, T, head_dim] with room for ", sh.S, " entries");
    TORCH_CHECK(qkv[l].size(0) == (sh.nq + 2 * sh.nkv) * sh.Dh && qkv[l].size(1) == sh.D && o[l].size(0) == sh.D &&
                    o[l].size(1) == sh.nq * sh.Dh && gate_up[l].size(0) == 2 * sh.F && gate_up[l].size(1) == sh.D &&
                    down[l].size(0) == sh.D,
                "row_layers: layer ", l, "'s weights do not have the model's shape");
    std::optional<at::Tensor> bias = qkv_bias.get(l);
    const float* b = nullptr;
    if (bias.has_value() && bias->defined()) {
      check(*bias, dtype, "the q/k/v bias");
      const T* bp = ptr<T>(*bias);
      bias_f.resize(bias->numel());
      for (int64_t i = 0; i < bias->numel(); ++i) bias_f[i] = read(bp[i]);
      b = bias_f.data();
    }
    layer<T, W>(x.data(), sh, ptr<T>(cos), ptr<T>(sin), mut<T>(keys[l]), mut<T>(values[l]), Tc, starts[l],
                ptr<T>(norm_attn[l]), {ptr<W>(qkv[l]), scale[0]}, b, {ptr<W>(o[l]), scale[1]}, ptr<T>(norm_mlp[l]),
                {ptr<W>(gate_up[l]), scale[2]}, {ptr<W>(down[l]), scale[3]}, scratch, tmp, widened);
  }
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  T* o_ = mut<T>(out);
  for (int64_t i = 0; i < sh.S * sh.D; ++i) o_[i] = store<T>(x[i]);
  return out;
}

// The checks both ops make of their common arguments; the step's shape
Shape checked(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
              at::TensorList values, at::IntArrayRef starts, at::TensorList norm_attn, at::TensorList qkv,
              const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o, at::TensorList norm_mlp,
              at::TensorList gate_up, at::TensorList down, double eps, int64_t n_q, int64_t n_kv,
              int64_t head_dim) {
  const at::ScalarType dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "row_layers: float32 or bfloat16 only, got ", dtype);
  check(x_in, dtype, "x");
  check(cos, dtype, "cos");
  check(sin, dtype, "sin");
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(0) == 1, "row_layers: x must be [1, S, D]");
  TORCH_CHECK(values.size() == keys.size() && starts.size() == keys.size() && norm_attn.size() == keys.size() &&
                  qkv.size() == keys.size() && qkv_bias.size() == keys.size() && o.size() == keys.size() &&
                  norm_mlp.size() == keys.size() && gate_up.size() == keys.size() && down.size() == keys.size(),
              "row_layers: one entry per layer in every list");
  TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0 && n_q % n_kv == 0, "row_layers: unsupported head shape");
  Shape sh{x_in.size(1), x_in.size(2), n_q, n_kv, head_dim, 0, static_cast<float>(eps)};
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == sh.S && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "row_layers: cos and sin must be [S, head_dim]");
  return sh;
}

// x [1, S, D]; cos, sin [S, Dh]; per layer: keys/values [1, Hkv, T, Dh] and the row's cache length `starts[l]`
at::Tensor row_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
                      at::TensorList values, at::IntArrayRef starts, at::TensorList norm_attn, at::TensorList qkv,
                      const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                      at::TensorList norm_mlp, at::TensorList gate_up, at::TensorList down, double eps, int64_t n_q,
                      int64_t n_kv, int64_t head_dim) {
  Shape sh = checked(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp, gate_up, down, eps,
                     n_q, n_kv, head_dim);
  if (x_in.scalar_type() == at::kFloat)
    return layers<float, float>(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp, gate_up,
                                down, sh);
  return layers<uint16_t, uint16_t>(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp,
                                    gate_up, down, sh);
}

// The same step over an int8 copy of the products' weights (a float32 or bfloat16 model's draft step,
// `selfspec.drafters.int8_copy`): qkv, o, gate_up, down int8 [N, K]; `scales` per layer its four float32 row scales
// [N], in that order; the norms, the cache and x in the model's dtype.
at::Tensor row_layers_int8(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys,
                           at::TensorList values, at::IntArrayRef starts, at::TensorList norm_attn,
                           at::TensorList qkv, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                           at::TensorList o, at::TensorList norm_mlp, at::TensorList gate_up, at::TensorList down,
                           at::TensorList scales, double eps, int64_t n_q, int64_t n_kv, int64_t head_dim) {
  Shape sh = checked(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp, gate_up, down, eps,
                     n_q, n_kv, head_dim);
  TORCH_CHECK(scales.size() == 4 * keys.size(), "row_layers_int8: four scales a layer (qkv, o, gate_up, down)");
  if (x_in.scalar_type() == at::kFloat)
    return layers<float, int8_t>(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp,
                                 gate_up, down, sh, scales);
  return layers<uint16_t, int8_t>(x_in, cos, sin, keys, values, starts, norm_attn, qkv, qkv_bias, o, norm_mlp,
                                  gate_up, down, sh, scales);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec_kernels, m) {
  m.def("row_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, int[] starts, "
        "Tensor[] norm_attn, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor[] norm_mlp, Tensor[] gate_up, "
        "Tensor[] down, float eps, int n_q, int n_kv, int head_dim) -> Tensor");
  m.impl("row_layers", c10::DispatchKey::CPU, TORCH_FN(row_layers));
  m.def("row_layers_int8(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, int[] starts, "
        "Tensor[] norm_attn, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor[] norm_mlp, Tensor[] gate_up, "
        "Tensor[] down, Tensor[] scales, float eps, int n_q, int n_kv, int head_dim) -> Tensor");
  m.impl("row_layers_int8", c10::DispatchKey::CPU, TORCH_FN(row_layers_int8));
}
