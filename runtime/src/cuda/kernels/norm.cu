// Row normalisations, mirroring runtime/src/kernels/norm.rs: `nn.LayerNorm` (biased variance)
// and LLaMA's RMSNorm, forward and backward, f32 statistics whatever the storage type.
//
// Row kernels give each row to one block (grid.x any: blocks stride over rows; 1-D blocks of
// a multiple of 32 threads, 256 intended) and reduce with fixed block trees. Each thread owns
// parts of 16 bytes of a row (8 bf16 or f16, 4 f32: common.cuh's `row_parts`), loaded and
// stored as one vector access where the row's pointer is 16-byte aligned and element by element
// otherwise (rows of a width that is not a multiple of the part, offset pointers); the parts
// and the order of every sum are the same on both paths, so the path changes no bit. Weight and bias
// gradients are column sums over rows: `norm_backward_params_partial_*` writes per-chunk
// partials [n_chunks, C] (as reduce.cu's column sums), each thread a part of 16 bytes of a row's
// columns with the same vector-or-element choice per part, and reduce.cu's
// `column_sum_finish_*` adds them in order into dweight / dbias (overwriting or accumulating).

template <typename T>
__device__ void layer_norm_forward(T* out, float* mean, float* rstd, const T* x, const T* weight, const T* bias,
                                   int rows, int channels, float eps) {
    __shared__ float scratch[32];
    constexpr int N = VecWidth<T>::N;
    const bool vw = aligned16(weight), vb = bias && aligned16(bias);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + (i64)r * channels;
        T* orow = out + (i64)r * channels;
        const bool vx = aligned16(xr), vo = aligned16(orow);
        float s = 0.0f;
        row_parts<N>(channels, [&](int c, int n) {
            float v[N];
            ld_part<N>(v, xr, c, n, vx);
            for (int k = 0; k < n; ++k) s += v[k];
        });
        const float mu = block_sum(s, scratch) / (float)channels;
        float q = 0.0f;
        row_parts<N>(channels, [&](int c, int n) {
            float v[N];
            ld_part<N>(v, xr, c, n, vx);
            for (int k = 0; k < n; ++k) {
                float d = v[k] - mu;
                q += d * d;
            }
        });
        const float var = block_sum(q, scratch) / (float)channels;
        const float rs = 1.0f / sqrtf(var + eps);
        row_parts<N>(channels, [&](int c, int n) {
            float v[N], w[N], b[N];
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            if (bias) ld_part<N>(b, bias, c, n, vb);
            for (int k = 0; k < n; ++k) {
                float o = (v[k] - mu) * rs * w[k];
                if (bias) o += b[k];
                v[k] = o;
            }
            st_part<N>(orow, c, v, n, vo);
        });
        if (threadIdx.x == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

/// out[r] = (x[r] - mean_r) * rstd_r * weight + bias, rstd_r = 1 / sqrt(var_r + eps), for `x`,
/// `out` [rows, C], `weight`, `bias` [C] (`bias` may be null); writes mean, rstd [rows] (f32)
/// for the backward.
extern "C" __global__ void layer_norm_forward_f32(float* out, float* mean, float* rstd, const float* x, const float* weight, const float* bias, int rows, int channels, float eps) { layer_norm_forward(out, mean, rstd, x, weight, bias, rows, channels, eps); }
extern "C" __global__ void layer_norm_forward_bf16(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* weight, const bf16* bias, int rows, int channels, float eps) { layer_norm_forward(out, mean, rstd, x, weight, bias, rows, channels, eps); }
extern "C" __global__ void layer_norm_forward_f16(f16* out, float* mean, float* rstd, const f16* x, const f16* weight, const f16* bias, int rows, int channels, float eps) { layer_norm_forward(out, mean, rstd, x, weight, bias, rows, channels, eps); }

template <typename T>
__device__ void layer_norm_backward(T* dx, const T* dout, const T* x, const T* weight, const float* mean,
                                    const float* rstd, int rows, int channels) {
    __shared__ float scratch[32];
    constexpr int N = VecWidth<T>::N;
    const bool vw = aligned16(weight);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = (i64)r * channels;
        const T *xr = x + base, *dr = dout + base;
        T* dxr = dx + base;
        const bool vx = aligned16(xr), vd = aligned16(dr), vdx = aligned16(dxr);
        const float mu = mean[r], rs = rstd[r];
        float gs = 0.0f, gns = 0.0f;
        row_parts<N>(channels, [&](int c, int n) {
            float d[N], v[N], w[N];
            ld_part<N>(d, dr, c, n, vd);
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            for (int k = 0; k < n; ++k) {
                float g = d[k] * w[k];
                gs += g;
                gns += g * ((v[k] - mu) * rs);
            }
        });
        const float g_mean = block_sum(gs, scratch) / (float)channels;
        const float gn_mean = block_sum(gns, scratch) / (float)channels;
        row_parts<N>(channels, [&](int c, int n) {
            float d[N], v[N], w[N];
            ld_part<N>(d, dr, c, n, vd);
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            for (int k = 0; k < n; ++k) {
                float nk = (v[k] - mu) * rs;
                d[k] = (d[k] * w[k] - g_mean - nk * gn_mean) * rs;
            }
            st_part<N>(dxr, c, d, n, vdx);
        });
    }
}

/// dx = (g - mean(g) - n * mean(g * n)) * rstd with n = (x - mean) * rstd, g = dout * weight;
/// overwrites dx [rows, C]. Weight and bias gradients: `norm_backward_params_partial_*`.
extern "C" __global__ void layer_norm_backward_f32(float* dx, const float* dout, const float* x, const float* weight, const float* mean, const float* rstd, int rows, int channels) { layer_norm_backward(dx, dout, x, weight, mean, rstd, rows, channels); }
extern "C" __global__ void layer_norm_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, const bf16* weight, const float* mean, const float* rstd, int rows, int channels) { layer_norm_backward(dx, dout, x, weight, mean, rstd, rows, channels); }
extern "C" __global__ void layer_norm_backward_f16(f16* dx, const f16* dout, const f16* x, const f16* weight, const float* mean, const float* rstd, int rows, int channels) { layer_norm_backward(dx, dout, x, weight, mean, rstd, rows, channels); }

/// The factor an RMS norm multiplies its normalised rows by: the weight `w`, or 1 + w in f32.
__device__ __forceinline__ float rms_scale(float w, int unit_offset) { return unit_offset ? 1.0f + w : w; }

template <typename T>
__device__ void rms_norm_forward(T* out, float* rstd, const T* x, const T* weight, int rows, int channels, float eps, int unit_offset) {
    __shared__ float scratch[32];
    constexpr int N = VecWidth<T>::N;
    const bool vw = aligned16(weight);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + (i64)r * channels;
        T* orow = out + (i64)r * channels;
        const bool vx = aligned16(xr), vo = aligned16(orow);
        float q = 0.0f;
        row_parts<N>(channels, [&](int c, int n) {
            float v[N];
            ld_part<N>(v, xr, c, n, vx);
            for (int k = 0; k < n; ++k) q += v[k] * v[k];
        });
        const float rs = 1.0f / sqrtf(block_sum(q, scratch) / (float)channels + eps);
        row_parts<N>(channels, [&](int c, int n) {
            float v[N], w[N];
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            for (int k = 0; k < n; ++k) v[k] = rms_scale(w[k], unit_offset) * (v[k] * rs);
            st_part<N>(orow, c, v, n, vo);
        });
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

/// out[r] = s * (x[r] * rstd_r), rstd_r = 1 / sqrt(mean(x[r]^2) + eps), with the scale s = weight,
/// or s = 1 + weight when unit_offset (Gemma); writes rstd [rows]. A norm per head of width D
/// launches with rows = all heads of all rows and channels = D.
extern "C" __global__ void rms_norm_forward_f32(float* out, float* rstd, const float* x, const float* weight, int rows, int channels, float eps, int unit_offset) { rms_norm_forward(out, rstd, x, weight, rows, channels, eps, unit_offset); }
extern "C" __global__ void rms_norm_forward_bf16(bf16* out, float* rstd, const bf16* x, const bf16* weight, int rows, int channels, float eps, int unit_offset) { rms_norm_forward(out, rstd, x, weight, rows, channels, eps, unit_offset); }
extern "C" __global__ void rms_norm_forward_f16(f16* out, float* rstd, const f16* x, const f16* weight, int rows, int channels, float eps, int unit_offset) { rms_norm_forward(out, rstd, x, weight, rows, channels, eps, unit_offset); }

template <typename T>
__device__ void rms_norm_backward(T* dx, const T* dout, const T* x, const T* weight, const float* rstd, int rows, int channels, int unit_offset) {
    __shared__ float scratch[32];
    constexpr int N = VecWidth<T>::N;
    const bool vw = aligned16(weight);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = (i64)r * channels;
        const T *xr = x + base, *dr = dout + base;
        T* dxr = dx + base;
        const bool vx = aligned16(xr), vd = aligned16(dr), vdx = aligned16(dxr);
        const float rs = rstd[r];
        float gns = 0.0f;
        row_parts<N>(channels, [&](int c, int n) {
            float d[N], v[N], w[N];
            ld_part<N>(d, dr, c, n, vd);
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            for (int k = 0; k < n; ++k) gns += (d[k] * rms_scale(w[k], unit_offset)) * (v[k] * rs);
        });
        const float gn_mean = block_sum(gns, scratch) / (float)channels;
        row_parts<N>(channels, [&](int c, int n) {
            float d[N], v[N], w[N];
            ld_part<N>(d, dr, c, n, vd);
            ld_part<N>(v, xr, c, n, vx);
            ld_part<N>(w, weight, c, n, vw);
            for (int k = 0; k < n; ++k) {
                float g = d[k] * rms_scale(w[k], unit_offset);
                d[k] = (g - (v[k] * rs) * gn_mean) * rs;
            }
            st_part<N>(dxr, c, d, n, vdx);
        });
    }
}

/// dx = (g - n * mean(g * n)) * rstd with n = x * rstd, g = dout * s (s the forward's scale);
/// overwrites dx.
extern "C" __global__ void rms_norm_backward_f32(float* dx, const float* dout, const float* x, const float* weight, const float* rstd, int rows, int channels, int unit_offset) { rms_norm_backward(dx, dout, x, weight, rstd, rows, channels, unit_offset); }
extern "C" __global__ void rms_norm_backward_bf16(bf16* dx, const bf16* dout, const bf16* x, const bf16* weight, const float* rstd, int rows, int channels, int unit_offset) { rms_norm_backward(dx, dout, x, weight, rstd, rows, channels, unit_offset); }
extern "C" __global__ void rms_norm_backward_f16(f16* dx, const f16* dout, const f16* x, const f16* weight, const float* rstd, int rows, int channels, int unit_offset) { rms_norm_backward(dx, dout, x, weight, rstd, rows, channels, unit_offset); }

#define NORM_COL_TILE 32
#define NORM_ROW_LANES 8

/// Stores the `n` (at most `N`) f32 sums of `v` at `p + o`, in 16-byte stores of 4 where each
/// group of 4 is whole and its address aligned, element by element otherwise.
template <int N>
__device__ __forceinline__ void st_f32_parts(float* p, i64 o, const float (&v)[N / 4][4], int n) {
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
        const int at = 4 * q;
        if (at < n) st_part<4>(p, o + at, v[q], min(4, n - at), aligned16(p + o + at));
    }
}

template <typename T>
__device__ void norm_backward_params_partial(float* dweight_part, float* dbias_part, const T* dout, const T* x,
                                             const float* mean, const float* rstd, int rows, int channels,
                                             int rows_per_chunk) {
    // Thread (tx, ty) owns the part of N columns at c = N * (32 * blockIdx.x + tx) (16 bytes of
    // `dout` and `x`; the row's last part shorter when N does not divide C) and the chunk's rows
    // r0 + ty, r0 + ty + 8, ...; each column is summed over those rows in order, then over the 8
    // row lanes in order, as one column per thread would sum it, so neither the part width nor
    // the load path changes a bit. The lane sums meet in shared memory laid out [lane][k][tx],
    // so a warp's accesses fall in distinct banks.
    constexpr int N = VecWidth<T>::N;
    __shared__ float tw[NORM_ROW_LANES][N][NORM_COL_TILE + 1];
    __shared__ float tb[NORM_ROW_LANES][N][NORM_COL_TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 c = ((i64)blockIdx.x * NORM_COL_TILE + tx) * N;
    const int n = c < channels ? min((i64)N, channels - c) : 0;
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    float aw[N], ab[N];
#pragma unroll
    for (int k = 0; k < N; ++k) aw[k] = ab[k] = 0.0f;
    if (n > 0) {
        for (int r = r0 + ty; r < r1; r += NORM_ROW_LANES) {
            const i64 i = (i64)r * channels + c;
            const float mu = mean ? mean[r] : 0.0f, rs = rstd[r];
            float d[N], v[N];
            ld_part<N>(d, dout, i, n, aligned16(dout + i));
            ld_part<N>(v, x, i, n, aligned16(x + i));
            for (int k = 0; k < n; ++k) {
                aw[k] += d[k] * ((v[k] - mu) * rs);
                ab[k] += d[k];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
        tw[ty][k][tx] = aw[k];
        tb[ty][k][tx] = ab[k];
    }
    __syncthreads();
    if (ty == 0 && n > 0) {
        float sw[N / 4][4], sb[N / 4][4];
        for (int k = 0; k < n; ++k) {
            float a = tw[0][k][tx], b = tb[0][k][tx];
            for (int j = 1; j < NORM_ROW_LANES; ++j) {
                a += tw[j][k][tx];
                b += tb[j][k][tx];
            }
            sw[k / 4][k % 4] = a;
            sb[k / 4][k % 4] = b;
        }
        const i64 o = (i64)blockIdx.y * channels + c;
        st_f32_parts<N>(dweight_part, o, sw, n);
        if (dbias_part) st_f32_parts<N>(dbias_part, o, sb, n);
    }
}

/// Per-chunk partials of the norm parameter gradients: dweight_part[k, c] = sum over the rows
/// of chunk k of dout * n with n = (x - mean) * rstd (layer norm) or x * rstd (RMS norm: pass
/// `mean` null), and dbias_part[k, c] = sum of dout (null to skip: RMS norm). Finish each with
/// `column_sum_finish_*` (reduce.cu) over n_chunks = ceil(rows / rows_per_chunk).
/// Launch: block (32, 8), grid (ceil(C / (32 N)), n_chunks) with N the elements in 16 bytes of
/// the storage type (4 for f32, 8 for bf16 and f16): each thread sums a part of N columns.
extern "C" __global__ void norm_backward_params_partial_f32(float* dweight_part, float* dbias_part, const float* dout, const float* x, const float* mean, const float* rstd, int rows, int channels, int rows_per_chunk) { norm_backward_params_partial(dweight_part, dbias_part, dout, x, mean, rstd, rows, channels, rows_per_chunk); }
extern "C" __global__ void norm_backward_params_partial_bf16(float* dweight_part, float* dbias_part, const bf16* dout, const bf16* x, const float* mean, const float* rstd, int rows, int channels, int rows_per_chunk) { norm_backward_params_partial(dweight_part, dbias_part, dout, x, mean, rstd, rows, channels, rows_per_chunk); }
extern "C" __global__ void norm_backward_params_partial_f16(float* dweight_part, float* dbias_part, const f16* dout, const f16* x, const float* mean, const float* rstd, int rows, int channels, int rows_per_chunk) { norm_backward_params_partial(dweight_part, dbias_part, dout, x, mean, rstd, rows, channels, rows_per_chunk); }
