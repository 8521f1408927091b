// Rotary position embedding in HF's rotate-half form, mirroring runtime/src/kernels/rope.rs.
// `inv_freq` [rotary_dim / 2] is the table `rope_inv_freq` computes on the host (with any
// long-context scaling already applied), uploaded once.
//
// Each head of `head_dim` elements is `rotary_dim / 2` rotation pairs (i, i + rotary_dim / 2)
// followed by `head_dim - rotary_dim` elements past the rotary part, which are copied; the heads
// from `rotated_heads` on are copied whole (v's heads in Phi-3's packed qkv). A whole-head RoPE
// is `rotary_dim == head_dim`, `rotated_heads == n_heads`. cos and sin are multiplied by
// `factor` (YaRN's and LongRoPE's attention factor; 1 otherwise), after they are computed, as
// the host kernel and transformers do.
//
// One thread per unit (row, head, u < head_dim - rotary_dim / 2): a rotation pair or one copied
// element, grid-stride over rows * heads * units. The thread reads what it writes before writing
// it, so in-place use (`out == x`) is allowed.

template <typename T>
__device__ void rope(T* out, const T* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim,
                     int rotary_dim, int rotated_heads, float factor, float sign) {
    const int half = rotary_dim / 2;
    const int units = head_dim - half;
    const i64 total = (i64)batch * seq * n_heads * units;
    GRID_STRIDE(k, total) {
        const int u = (int)(k % units);
        const i64 rh = k / units; // row * n_heads + head
        const i64 row = rh / n_heads;
        const int h = (int)(rh - row * n_heads);
        const i64 head = row * n_heads * head_dim + (i64)h * head_dim;
        if (u >= half) {
            // Past the rotary part: copied.
            const i64 e = head + rotary_dim + (u - half);
            st(out, e, ld(x, e));
            continue;
        }
        const i64 lo = head + u, hi = lo + half;
        const float a = ld(x, lo), b = ld(x, hi);
        if (h >= rotated_heads) {
            st(out, lo, a);
            st(out, hi, b);
            continue;
        }
        // As transformers: position_ids.float() * inv_freq, then cos and sin in f32, then
        // times the attention factor.
        const float angle = (float)(int)(row % seq) * inv_freq[u];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        sn *= factor;
        cs *= factor;
        sn *= sign;
        st(out, lo, a * cs - b * sn);
        st(out, hi, b * cs + a * sn);
    }
}

/// In each of the first `rotated_heads` heads: out[.., i] = (x[i] cos - x[i + R/2] sin) f,
/// out[.., i + R/2] = (x[i + R/2] cos + x[i] sin) f for i < R/2 (R = rotary_dim, f = factor),
/// with angle t * inv_freq[i] for position t = row % seq; every other element copied. `x`,
/// `out` [batch, seq, n_heads * head_dim].
extern "C" __global__ void rope_forward_f32(float* out, const float* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, 1.0f); }
extern "C" __global__ void rope_forward_bf16(bf16* out, const bf16* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, 1.0f); }
extern "C" __global__ void rope_forward_f16(f16* out, const f16* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(out, x, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, 1.0f); }
/// The transposed rotation of the rotated part: dx[i] = (dout[i] cos + dout[i + R/2] sin) f,
/// dx[i + R/2] = (dout[i + R/2] cos - dout[i] sin) f; every other element copied.
extern "C" __global__ void rope_backward_f32(float* dx, const float* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, -1.0f); }
extern "C" __global__ void rope_backward_bf16(bf16* dx, const bf16* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, -1.0f); }
extern "C" __global__ void rope_backward_f16(f16* dx, const f16* dout, const float* inv_freq, int batch, int seq, int n_heads, int head_dim, int rotary_dim, int rotated_heads, float factor) { rope(dx, dout, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, -1.0f); }
