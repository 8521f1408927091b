// Pointwise activations, mirroring runtime/src/kernels/activation.rs: GELU (tanh form, HF
// `gelu_new`), ReLU, SiLU, SwiGLU (also over Phi-3's packed `[gate | up]` rows), GeGLU, Gemma's
// soft-cap and constant scale, and their backwards.
//
// Every entry point is a grid-stride loop over `n` elements: any grid, any 1-D block (256
// threads is the intended launch), 16-byte vector loads and stores where every pointer is
// 16-byte aligned (`map1` and its kin in common.cuh; the same arithmetic per element, so the
// same bits, with a scalar tail). Each element is independent, so in-place use (`out == x`,
// `dx == dout`) is allowed. Backwards overwrite their input gradients.

#define GELU_K 0.7978846f // sqrt(2 / pi), as the host's GELU_K
#define GELU_C 0.044715f

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/// sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3): gelu(x) = x * sigmoid(2u), the same
/// function as 0.5 x (1 + tanh(u)) without the cancellation in 1 + tanh for negative x.
__device__ __forceinline__ float gelu_s(float x) {
    float u = GELU_K * (x + GELU_C * (x * x * x));
    return sigmoid_f(2.0f * u);
}

template <typename T> __device__ void gelu_forward(T* out, const T* x, i64 n) {
    map1(out, x, n, [](float v) { return v * gelu_s(v); });
}

template <typename T> __device__ void gelu_backward(T* dx, const T* dout, const T* x, i64 n) {
    map2(dx, dout, x, n, [](float d, float v) {
        float s = gelu_s(v);
        float du = GELU_K * (1.0f + 3.0f * GELU_C * (v * v));
        return d * (s + 2.0f * v * s * (1.0f - s) * du);
    });
}

template <typename T> __device__ void relu_forward(T* out, const T* x, i64 n) {
    map1(out, x, n, [](float v) { return v <= 0.0f ? 0.0f : v; }); // NaN propagates, as torch.relu
}

template <typename T> __device__ void relu_backward(T* dx, const T* dout, const T* x, i64 n) {
    map2(dx, dout, x, n, [](float d, float v) { return v <= 0.0f ? 0.0f : d; });
}

template <typename T> __device__ void silu_forward(T* out, const T* x, i64 n) {
    map1(out, x, n, [](float v) { return v / (1.0f + expf(-v)); });
}

template <typename T> __device__ void silu_backward(T* dx, const T* dout, const T* x, i64 n) {
    map2(dx, dout, x, n, [](float d, float v) {
        float s = sigmoid_f(v);
        return d * (s * (1.0f + v * (1.0f - s)));
    });
}

template <typename T> __device__ void swiglu_forward(T* out, const T* gate, const T* up, i64 n) {
    map2(out, gate, up, n, [](float g, float u) { return g / (1.0f + expf(-g)) * u; });
}

template <typename T>
__device__ void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                                i64 n) {
    map3x2(dgate, dup, dout, gate, up, n, [](float d, float g, float u, float& dg, float& du) {
        float s = sigmoid_f(g);
        du = d * (g * s);
        dg = d * u * (s * (1.0f + g * (1.0f - s)));
    });
}

/// Phi-3's packed form: row r of `x` [rows, 2 width] is `[gate | up]`; `n` = rows * width
/// output elements, one per thread.
template <typename T> __device__ void packed_swiglu_forward(T* out, const T* x, int width, i64 n) {
    GRID_STRIDE(i, n) {
        const i64 r = i / width, c = i - r * width;
        const i64 g_at = r * 2 * width + c;
        float g = ld(x, g_at), u = ld(x, g_at + width);
        st(out, i, g / (1.0f + expf(-g)) * u);
    }
}

/// Row r of `dx` is `[dgate | dup]`, each element as `swiglu_backward` computes it. Each thread
/// reads its gate and up before writing their gradients, so `dx == x` is allowed.
template <typename T>
__device__ void packed_swiglu_backward(T* dx, const T* dout, const T* x, int width, i64 n) {
    GRID_STRIDE(i, n) {
        const i64 r = i / width, c = i - r * width;
        const i64 g_at = r * 2 * width + c;
        float d = ld(dout, i), g = ld(x, g_at), u = ld(x, g_at + width);
        float s = sigmoid_f(g);
        st(dx, g_at + width, d * (g * s));
        st(dx, g_at, d * u * (s * (1.0f + g * (1.0f - s))));
    }
}

template <typename T> __device__ void geglu_forward(T* out, const T* gate, const T* up, i64 n) {
    map2(out, gate, up, n, [](float g, float u) { return g * gelu_s(g) * u; });
}

template <typename T>
__device__ void geglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                               i64 n) {
    map3x2(dgate, dup, dout, gate, up, n, [](float d, float g, float u, float& dg, float& du) {
        float s = gelu_s(g);
        float dk = GELU_K * (1.0f + 3.0f * GELU_C * (g * g));
        du = d * (g * s);
        dg = d * u * (s + 2.0f * g * s * (1.0f - s) * dk);
    });
}

template <typename T> __device__ void softcap_forward(T* out, const T* x, float cap, i64 n) {
    map1(out, x, n, [cap](float v) { return cap * tanhf(v / cap); });
}

/// From the forward's output y: dx = dout (1 - (y / cap)^2).
template <typename T>
__device__ void softcap_backward(T* dx, const T* dout, const T* y, float cap, i64 n) {
    map2(dx, dout, y, n, [cap](float d, float v) {
        float t = v / cap;
        return d * (1.0f - t * t);
    });
}

/// `factor` arrives rounded to the storage type by the launcher.
template <typename T> __device__ void scale_forward(T* out, const T* x, float factor, i64 n) {
    map1(out, x, n, [factor](float v) { return v * factor; });
}

/// out = gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
extern "C" __global__ void gelu_forward_f32(float* out, const float* x, i64 n) { gelu_forward(out, x, n); }
extern "C" __global__ void gelu_forward_bf16(bf16* out, const bf16* x, i64 n) { gelu_forward(out, x, n); }
extern "C" __global__ void gelu_forward_f16(f16* out, const f16* x, i64 n) { gelu_forward(out, x, n); }
/// dx = dout * gelu'(x).
extern "C" __global__ void gelu_backward_f32(float* dx, const float* dout, const float* x, i64 n) { gelu_backward(dx, dout, x, n); }
extern "C" __global__ void gelu_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, i64 n) { gelu_backward(dx, dout, x, n); }
extern "C" __global__ void gelu_backward_f16(f16* dx, const f16* dout, const f16* x, i64 n) { gelu_backward(dx, dout, x, n); }
/// out = max(x, 0).
extern "C" __global__ void relu_forward_f32(float* out, const float* x, i64 n) { relu_forward(out, x, n); }
extern "C" __global__ void relu_forward_bf16(bf16* out, const bf16* x, i64 n) { relu_forward(out, x, n); }
extern "C" __global__ void relu_forward_f16(f16* out, const f16* x, i64 n) { relu_forward(out, x, n); }
/// dx = x > 0 ? dout : 0.
extern "C" __global__ void relu_backward_f32(float* dx, const float* dout, const float* x, i64 n) { relu_backward(dx, dout, x, n); }
extern "C" __global__ void relu_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, i64 n) { relu_backward(dx, dout, x, n); }
extern "C" __global__ void relu_backward_f16(f16* dx, const f16* dout, const f16* x, i64 n) { relu_backward(dx, dout, x, n); }
/// out = x / (1 + e^-x).
extern "C" __global__ void silu_forward_f32(float* out, const float* x, i64 n) { silu_forward(out, x, n); }
extern "C" __global__ void silu_forward_bf16(bf16* out, const bf16* x, i64 n) { silu_forward(out, x, n); }
extern "C" __global__ void silu_forward_f16(f16* out, const f16* x, i64 n) { silu_forward(out, x, n); }
/// dx = dout * s (1 + x (1 - s)), s = sigmoid(x).
extern "C" __global__ void silu_backward_f32(float* dx, const float* dout, const float* x, i64 n) { silu_backward(dx, dout, x, n); }
extern "C" __global__ void silu_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, i64 n) { silu_backward(dx, dout, x, n); }
extern "C" __global__ void silu_backward_f16(f16* dx, const f16* dout, const f16* x, i64 n) { silu_backward(dx, dout, x, n); }
/// out = silu(gate) * up.
extern "C" __global__ void swiglu_forward_f32(float* out, const float* gate, const float* up, i64 n) { swiglu_forward(out, gate, up, n); }
extern "C" __global__ void swiglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, i64 n) { swiglu_forward(out, gate, up, n); }
extern "C" __global__ void swiglu_forward_f16(f16* out, const f16* gate, const f16* up, i64 n) { swiglu_forward(out, gate, up, n); }
/// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
extern "C" __global__ void swiglu_backward_f32(float* dgate, float* dup, const float* dout, const float* gate, const float* up, i64 n) { swiglu_backward(dgate, dup, dout, gate, up, n); }
extern "C" __global__ void swiglu_backward_bf16(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, i64 n) { swiglu_backward(dgate, dup, dout, gate, up, n); }
extern "C" __global__ void swiglu_backward_f16(f16* dgate, f16* dup, const f16* dout, const f16* gate, const f16* up, i64 n) { swiglu_backward(dgate, dup, dout, gate, up, n); }
/// out[r, c] = silu(x[r, c]) * x[r, width + c] for `x` [rows, 2 width], `n` = rows * width.
extern "C" __global__ void packed_swiglu_forward_f32(float* out, const float* x, int width, i64 n) { packed_swiglu_forward(out, x, width, n); }
extern "C" __global__ void packed_swiglu_forward_bf16(bf16* out, const bf16* x, int width, i64 n) { packed_swiglu_forward(out, x, width, n); }
extern "C" __global__ void packed_swiglu_forward_f16(f16* out, const f16* x, int width, i64 n) { packed_swiglu_forward(out, x, width, n); }
/// dx[r, c] = dout * up * silu'(gate), dx[r, width + c] = dout * silu(gate).
extern "C" __global__ void packed_swiglu_backward_f32(float* dx, const float* dout, const float* x, int width, i64 n) { packed_swiglu_backward(dx, dout, x, width, n); }
extern "C" __global__ void packed_swiglu_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, int width, i64 n) { packed_swiglu_backward(dx, dout, x, width, n); }
extern "C" __global__ void packed_swiglu_backward_f16(f16* dx, const f16* dout, const f16* x, int width, i64 n) { packed_swiglu_backward(dx, dout, x, width, n); }
/// out = gelu_tanh(gate) * up.
extern "C" __global__ void geglu_forward_f32(float* out, const float* gate, const float* up, i64 n) { geglu_forward(out, gate, up, n); }
extern "C" __global__ void geglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, i64 n) { geglu_forward(out, gate, up, n); }
extern "C" __global__ void geglu_forward_f16(f16* out, const f16* gate, const f16* up, i64 n) { geglu_forward(out, gate, up, n); }
/// dgate = dout * up * gelu'(gate), dup = dout * gelu(gate).
extern "C" __global__ void geglu_backward_f32(float* dgate, float* dup, const float* dout, const float* gate, const float* up, i64 n) { geglu_backward(dgate, dup, dout, gate, up, n); }
extern "C" __global__ void geglu_backward_bf16(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, i64 n) { geglu_backward(dgate, dup, dout, gate, up, n); }
extern "C" __global__ void geglu_backward_f16(f16* dgate, f16* dup, const f16* dout, const f16* gate, const f16* up, i64 n) { geglu_backward(dgate, dup, dout, gate, up, n); }
/// out = cap * tanh(x / cap).
extern "C" __global__ void softcap_forward_f32(float* out, const float* x, float cap, i64 n) { softcap_forward(out, x, cap, n); }
extern "C" __global__ void softcap_forward_bf16(bf16* out, const bf16* x, float cap, i64 n) { softcap_forward(out, x, cap, n); }
extern "C" __global__ void softcap_forward_f16(f16* out, const f16* x, float cap, i64 n) { softcap_forward(out, x, cap, n); }
/// dx = dout * (1 - (y / cap)^2).
extern "C" __global__ void softcap_backward_f32(float* dx, const float* dout, const float* y, float cap, i64 n) { softcap_backward(dx, dout, y, cap, n); }
extern "C" __global__ void softcap_backward_bf16(bf16* dx, const bf16* dout, const bf16* y, float cap, i64 n) { softcap_backward(dx, dout, y, cap, n); }
extern "C" __global__ void softcap_backward_f16(f16* dx, const f16* dout, const f16* y, float cap, i64 n) { softcap_backward(dx, dout, y, cap, n); }
/// out = x * factor.
extern "C" __global__ void scale_forward_f32(float* out, const float* x, float factor, i64 n) { scale_forward(out, x, factor, n); }
extern "C" __global__ void scale_forward_bf16(bf16* out, const bf16* x, float factor, i64 n) { scale_forward(out, x, factor, n); }
extern "C" __global__ void scale_forward_f16(f16* out, const f16* x, float factor, i64 n) { scale_forward(out, x, factor, n); }
