// Rotary position embedding in HF's rotate-half form, mirroring runtime/src/kernels/rope.rs.
// `inv_freq` [head_dim / 2] is the table `rope_inv_freq` computes on the host (with any
// long-context scaling already applied), uploaded once.
//
// One thread per rotation pair (row, head, i < D/2): grid-stride over rows * heads * D/2. The
// thread reads its pair before writing it, so in-place use (`out == x`) is allowed.

template <typename T>
__device__ void rope(T* out, const T* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim,
                     float sign) {
    const int half = head_dim / 2;
    const i64 pairs = (i64)batch * seq * n_heads * half;
    GRID_STRIDE(k, pairs) {
        const int i = (int)(k % half);
        const i64 rh = k / half; // row * n_heads + head
        const i64 row = rh / n_heads;
        const int h = (int)(rh - row * n_heads);
        // As transformers: position_ids.float() * inv_freq, then cos and sin in f32.
        const float angle = (float)(int)(row % seq) * inv_freq[i];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        sn *= sign;
        const i64 lo = row * n_heads * head_dim + (i64)h * head_dim + i, hi = lo + half;
        const float a = ld(x, lo), b = ld(x, hi);
        st(out, lo, a * cs - b * sn);
        st(out, hi, b * cs + a * sn);
    }
}

/// out[.., i] = x[i] cos - x[i + D/2] sin, out[.., i + D/2] = x[i + D/2] cos + x[i] sin, with
/// angle t * inv_freq[i] for position t = row % seq; `x`, `out` [batch, seq, n_heads * D].
extern "C" __global__ void rope_forward_f32(float* out, const float* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, 1.0f); }
extern "C" __global__ void rope_forward_bf16(bf16* out, const bf16* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, 1.0f); }
extern "C" __global__ void rope_forward_f16(f16* out, const f16* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, 1.0f); }
/// The transposed rotation: dx[i] = dout[i] cos + dout[i + D/2] sin,
/// dx[i + D/2] = dout[i + D/2] cos - dout[i] sin.
extern "C" __global__ void rope_backward_f32(float* dx, const float* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, -1.0f); }
extern "C" __global__ void rope_backward_bf16(bf16* dx, const bf16* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, -1.0f); }
extern "C" __global__ void rope_backward_f16(f16* dx, const f16* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, -1.0f); }
