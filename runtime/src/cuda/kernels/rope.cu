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
// One thread per unit (row, head, u < (head_dim - rotary_dim / 2) / W) of W elements: W
// consecutive rotation pairs (i, i + rotary_dim / 2) or W copied elements, grid-stride over
// rows * heads * units. W is 16 bytes of elements (8 bf16 or f16, 4 f32), loaded and stored as
// one vector access, where W divides rotary_dim / 2 and head_dim - rotary_dim and both pointers
// are 16-byte aligned; 1 otherwise. Each element gets the same arithmetic whatever W, so W
// changes no bit. The thread reads what it writes before writing it, so in-place use
// (`out == x`) is allowed.

template <int W, typename T>
__device__ void rope_units(T* out, const T* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim,
                           int rotary_dim, int rotated_heads, float factor, float sign) {
    const int half = rotary_dim / 2;
    const int rot_units = half / W;
    const int units = rot_units + (head_dim - rotary_dim) / W;
    const i64 total = (i64)batch * seq * n_heads * units;
    GRID_STRIDE(k, total) {
        const int u = (int)(k % units);
        const i64 rh = k / units; // row * n_heads + head
        const i64 row = rh / n_heads;
        const int h = (int)(rh - row * n_heads);
        const i64 head = row * n_heads * head_dim + (i64)h * head_dim;
        if (u >= rot_units) {
            // Past the rotary part: copied (through f32, as the host kernel).
            const i64 e = head + rotary_dim + (i64)(u - rot_units) * W;
            const Vec<T, W> a = ldv<W>(x, e);
            Vec<T, W> o;
#pragma unroll
            for (int j = 0; j < W; ++j) o.v[j] = from_f32<T>(to_f32(a.v[j]));
            stv<W>(out, e, o);
            continue;
        }
        const i64 lo = head + (i64)u * W, hi = lo + half;
        const Vec<T, W> a = ldv<W>(x, lo), b = ldv<W>(x, hi);
        Vec<T, W> olo, ohi;
        if (h >= rotated_heads) {
#pragma unroll
            for (int j = 0; j < W; ++j) {
                olo.v[j] = from_f32<T>(to_f32(a.v[j]));
                ohi.v[j] = from_f32<T>(to_f32(b.v[j]));
            }
        } else {
            const float pos = (float)(int)(row % seq);
#pragma unroll
            for (int j = 0; j < W; ++j) {
                // As transformers: position_ids.float() * inv_freq, then cos and sin in f32,
                // then times the attention factor.
                const float angle = pos * inv_freq[u * W + j];
                float sn, cs;
                sincosf(angle, &sn, &cs);
                sn *= factor;
                cs *= factor;
                sn *= sign;
                const float av = to_f32(a.v[j]), bv = to_f32(b.v[j]);
                olo.v[j] = from_f32<T>(av * cs - bv * sn);
                ohi.v[j] = from_f32<T>(bv * cs + av * sn);
            }
        }
        stv<W>(out, lo, olo);
        stv<W>(out, hi, ohi);
    }
}

template <typename T>
__device__ void rope(T* out, const T* x, const float* inv_freq, int batch, int seq, int n_heads, int head_dim,
                     int rotary_dim, int rotated_heads, float factor, float sign) {
    constexpr int N = VecWidth<T>::N;
    const bool vec = (rotary_dim / 2) % N == 0 && (head_dim - rotary_dim) % N == 0 && aligned16(out) && aligned16(x);
    if (vec)
        rope_units<N>(out, x, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, sign);
    else
        rope_units<1>(out, x, inv_freq, batch, seq, n_heads, head_dim, rotary_dim, rotated_heads, factor, sign);
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
