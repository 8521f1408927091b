// Mixture-of-experts kernels, mirroring runtime/src/kernels/moe.rs: top-k routing and the
// packed layout, dispatch of tokens into the packed buffer, the grouped matmul over it, the
// weighted combine, and their backward passes.
//
// The packed buffer has `N*k` rows (`N` tokens, `k` experts each) grouped by expert, and by
// token within a group: `rows[r]` is the slot `t*k + j` packed row `r` holds, `slots[t*k + j]`
// the packed row of slot `j` of token `t`, `offsets[e]..offsets[e+1]` expert `e`'s group.
// `moe_route_pack` computes all three on the device (no host synchronisation), so a plan's
// addresses are fixed and only the group boundaries change from step to step; the grouped
// matmul kernels read the boundaries from device memory.
//
// Order. Every sum runs in the host kernel's order where the host's order is a plain loop
// (softmax, top-k, renormalisation and the routing gradient per token; a token's slots in slot
// order; the combine's weight gradient over channels), with each product and sum rounded on
// its own (`__fmul_rn` / `__fadd_rn`, no contracted multiply-add) and sums started at -0.0 as
// Rust's `Sum` starts them: with the same `expf` the results are the host's bits (on the CPU
// simulator they are; a GPU's `expf` may differ from the host's libm in the last place). The
// grouped matmuls sum each output over the reduced dimension in increasing order with `fmaf`
// (the host's gemm crate blocks it otherwise): deterministic, equal to the host's within f32
// summation-order error.

/// Rows and columns of a grouped-matmul tile; the grouped-matmul kernels run 16 x 16 threads.
#define MOE_TILE 16
/// Threads of `moe_route_pack`'s single block, and the most experts it packs.
#define MOE_PACK_THREADS 256

template <typename T>
__device__ void moe_route_softmax(float* weights, int* experts, const T* logits, int n_tokens, int n_experts,
                                  int k, int normalize) {
    GRID_STRIDE(t, n_tokens) {
        const T* l = logits + t * n_experts;
        float mx = -pt_inf();
        for (int e = 0; e < n_experts; ++e) mx = fmaxf(mx, ld(l, e));
        float sum = 0.0f;
        for (int e = 0; e < n_experts; ++e) sum = __fadd_rn(sum, expf(ld(l, e) - mx));
        int* chosen = experts + t * k;
        float* w = weights + t * k;
        // The k largest probabilities, largest first, ties to the lower index (a strict `>`).
        for (int j = 0; j < k; ++j) {
            int best = -1;
            float best_p = 0.0f;
            for (int e = 0; e < n_experts; ++e) {
                bool taken = false;
                for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
                if (taken) continue;
                const float p = expf(ld(l, e) - mx) / sum;
                if (best < 0 || p > best_p) {
                    best = e;
                    best_p = p;
                }
            }
            chosen[j] = best < 0 ? 0 : best;
            w[j] = best_p;
        }
        if (normalize) {
            float s = -0.0f;
            for (int j = 0; j < k; ++j) s = __fadd_rn(s, w[j]);
            for (int j = 0; j < k; ++j) w[j] = w[j] / s;
        }
    }
}

/// Step 1 of the routing: for each token of `logits [N, E]`, the softmax in f32, the `k`
/// largest probabilities (largest first, ties to the lower expert) into `weights [N, k]`
/// (f32), divided by their sum when `normalize`, and the chosen experts into `experts [N, k]`.
/// One thread per token. Grid-stride over N.
extern "C" __global__ void moe_route_softmax_f32(float* weights, int* experts, const float* logits, int n_tokens, int n_experts, int k, int normalize) { moe_route_softmax(weights, experts, logits, n_tokens, n_experts, k, normalize); }
extern "C" __global__ void moe_route_softmax_bf16(float* weights, int* experts, const bf16* logits, int n_tokens, int n_experts, int k, int normalize) { moe_route_softmax(weights, experts, logits, n_tokens, n_experts, k, normalize); }
extern "C" __global__ void moe_route_softmax_f16(float* weights, int* experts, const f16* logits, int n_tokens, int n_experts, int k, int normalize) { moe_route_softmax(weights, experts, logits, n_tokens, n_experts, k, normalize); }

/// Step 2 of the routing: the packed layout of `experts [n_slots]` (step 1's, every id in
/// 0..n_experts), by a stable counting sort: `offsets [n_experts + 1]` the groups' starts and
/// the total, `rows [n_slots]` each packed row's slot, `slots [n_slots]` each slot's packed
/// row, slots in increasing order within a group. Integer work only, in a fixed order.
/// Launch: exactly one block of MOE_PACK_THREADS (256) threads; n_experts <= 256.
extern "C" __global__ void moe_route_pack(int* rows, int* slots, int* offsets, const int* experts, int n_slots, int n_experts) {
    __shared__ int tile[MOE_PACK_THREADS];
    __shared__ int cursor[MOE_PACK_THREADS];
    if (blockDim.x != MOE_PACK_THREADS || n_experts > MOE_PACK_THREADS) __trap();
    const int tid = threadIdx.x;
    // Each expert's count: its thread counts it in every tile of slots.
    int count = 0;
    for (int s0 = 0; s0 < n_slots; s0 += MOE_PACK_THREADS) {
        const int s = s0 + tid;
        tile[tid] = s < n_slots ? experts[s] : -1;
        __syncthreads();
        const int m = min(MOE_PACK_THREADS, n_slots - s0);
        if (tid < n_experts)
            for (int j = 0; j < m; ++j) count += tile[j] == tid;
        __syncthreads();
    }
    if (tid < n_experts) cursor[tid] = count;
    __syncthreads();
    if (tid == 0) {
        int start = 0;
        for (int e = 0; e < n_experts; ++e) {
            const int c = cursor[e];
            cursor[e] = start;
            offsets[e] = start;
            start += c;
        }
        offsets[n_experts] = start;
    }
    __syncthreads();
    // Tile by tile in slot order: a slot's row is its expert's cursor plus the number of
    // earlier slots of the tile with the same expert; the tile's last such slot moves the
    // cursor past its row.
    for (int s0 = 0; s0 < n_slots; s0 += MOE_PACK_THREADS) {
        const int s = s0 + tid;
        const int e = s < n_slots ? experts[s] : -1;
        const bool mine = e >= 0 && e < n_experts;
        tile[tid] = mine ? e : -1;
        __syncthreads();
        const int m = min(MOE_PACK_THREADS, n_slots - s0);
        int row = 0;
        bool last = false;
        if (mine) {
            int before = 0;
            for (int j = 0; j < tid; ++j) before += tile[j] == e;
            row = cursor[e] + before;
            rows[row] = s;
            slots[s] = row;
            last = true;
            for (int j = tid + 1; j < m; ++j) last &= tile[j] != e;
        }
        __syncthreads();
        if (last) cursor[e] = row + 1;
        __syncthreads();
    }
}

template <typename T>
__device__ void moe_route_backward(T* dlogits, const float* dweights, const T* logits, const int* experts,
                                   int n_tokens, int n_experts, int k, int normalize) {
    GRID_STRIDE(t, n_tokens) {
        const T* l = logits + t * n_experts;
        T* dl = dlogits + t * n_experts;
        const int* chosen = experts + t * k;
        const float* dw = dweights + t * k;
        float mx = -pt_inf();
        for (int e = 0; e < n_experts; ++e) mx = fmaxf(mx, ld(l, e));
        float sum = 0.0f;
        for (int e = 0; e < n_experts; ++e) sum = __fadd_rn(sum, expf(ld(l, e) - mx));
        // dp for the chosen probabilities: w_j = p_j / S, so dp_j = (dw_j - sum_i dw_i w_i) / S;
        // without renormalising, dp_j = dw_j.
        float s = 1.0f, dot = 0.0f;
        if (normalize) {
            s = -0.0f;
            for (int j = 0; j < k; ++j) s = __fadd_rn(s, expf(ld(l, chosen[j]) - mx) / sum);
            dot = -0.0f;
            for (int j = 0; j < k; ++j) {
                const float p = expf(ld(l, chosen[j]) - mx) / sum;
                dot = __fadd_rn(dot, __fmul_rn(dw[j], p / s));
            }
        }
        // Softmax: dl_i = p_i (dp_i - sum_j dp_j p_j).
        float dot2 = -0.0f;
        for (int j = 0; j < k; ++j) {
            const float p = expf(ld(l, chosen[j]) - mx) / sum;
            const float dp = normalize ? (dw[j] - dot) / s : dw[j];
            dot2 = __fadd_rn(dot2, __fmul_rn(dp, p));
        }
        for (int e = 0; e < n_experts; ++e) {
            float dp = 0.0f;
            for (int j = 0; j < k; ++j)
                if (chosen[j] == e) dp = normalize ? (dw[j] - dot) / s : dw[j];
            const float p = expf(ld(l, e) - mx) / sum;
            st(dl, e, p * (dp - dot2));
        }
    }
}

/// The routing's gradient: `dlogits [N, E]` (overwritten) from `dweights [N, k]` (f32) through
/// the renormalisation (when `normalize`) and the softmax, for the experts `experts [N, k]`
/// chose; the choice itself has no gradient. One thread per token. Grid-stride over N.
extern "C" __global__ void moe_route_backward_f32(float* dlogits, const float* dweights, const float* logits, const int* experts, int n_tokens, int n_experts, int k, int normalize) { moe_route_backward(dlogits, dweights, logits, experts, n_tokens, n_experts, k, normalize); }
extern "C" __global__ void moe_route_backward_bf16(bf16* dlogits, const float* dweights, const bf16* logits, const int* experts, int n_tokens, int n_experts, int k, int normalize) { moe_route_backward(dlogits, dweights, logits, experts, n_tokens, n_experts, k, normalize); }
extern "C" __global__ void moe_route_backward_f16(f16* dlogits, const float* dweights, const f16* logits, const int* experts, int n_tokens, int n_experts, int k, int normalize) { moe_route_backward(dlogits, dweights, logits, experts, n_tokens, n_experts, k, normalize); }

template <typename T>
__device__ void moe_dispatch(T* xs, const T* x, const int* rows, int n_rows, int channels, int k) {
    GRID_STRIDE(i, (i64)n_rows * channels) {
        const i64 r = i / channels;
        const int c = (int)(i - r * channels);
        xs[i] = x[(i64)(rows[r] / k) * channels + c];
    }
}

/// xs[r, :] = x[rows[r] / k, :]: the tokens of `x [N, C]` gathered into the packed `xs [N*k,
/// C]` (n_rows = N*k). Grid-stride over n_rows * channels.
extern "C" __global__ void moe_dispatch_f32(float* xs, const float* x, const int* rows, int n_rows, int channels, int k) { moe_dispatch(xs, x, rows, n_rows, channels, k); }
extern "C" __global__ void moe_dispatch_bf16(bf16* xs, const bf16* x, const int* rows, int n_rows, int channels, int k) { moe_dispatch(xs, x, rows, n_rows, channels, k); }
extern "C" __global__ void moe_dispatch_f16(f16* xs, const f16* x, const int* rows, int n_rows, int channels, int k) { moe_dispatch(xs, x, rows, n_rows, channels, k); }

template <typename T>
__device__ void moe_dispatch_backward(T* dx, const T* dxs, const int* slots, int n_tokens, int channels, int k) {
    GRID_STRIDE(i, (i64)n_tokens * channels) {
        const i64 t = i / channels;
        const int c = (int)(i - t * channels);
        float acc = ld(dxs, (i64)slots[t * k] * channels + c);
        for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, ld(dxs, (i64)slots[t * k + j] * channels + c));
        st(dx, i, acc);
    }
}

/// dx[t, :] = sum over j in order of dxs[slots[t*k + j], :]: the packed gradient `dxs [N*k, C]`
/// summed back into `dx [N, C]` (overwritten). Grid-stride over n_tokens * channels.
extern "C" __global__ void moe_dispatch_backward_f32(float* dx, const float* dxs, const int* slots, int n_tokens, int channels, int k) { moe_dispatch_backward(dx, dxs, slots, n_tokens, channels, k); }
extern "C" __global__ void moe_dispatch_backward_bf16(bf16* dx, const bf16* dxs, const int* slots, int n_tokens, int channels, int k) { moe_dispatch_backward(dx, dxs, slots, n_tokens, channels, k); }
extern "C" __global__ void moe_dispatch_backward_f16(f16* dx, const f16* dxs, const int* slots, int n_tokens, int channels, int k) { moe_dispatch_backward(dx, dxs, slots, n_tokens, channels, k); }

/// Which expert's rows grouped-matmul block `tile` covers: the blocks count the experts' row
/// tiles in expert order (ceil(group / MOE_TILE) each), so a grid of ceil(R / MOE_TILE) +
/// n_experts blocks covers every group whatever the boundaries; false for a block past the
/// last tile. Every thread of a block gets the same answer.
__device__ __forceinline__ bool moe_group_tile(const int* offsets, int n_experts, int tile, int& e, int& r0, int& r1) {
    for (e = 0; e < n_experts; ++e) {
        const int lo = offsets[e], hi = offsets[e + 1];
        const int tiles = hi > lo ? (hi - lo + MOE_TILE - 1) / MOE_TILE : 0;
        if (tile < tiles) {
            r0 = lo + tile * MOE_TILE;
            r1 = min(hi, r0 + MOE_TILE);
            return true;
        }
        tile -= tiles;
    }
    return false;
}

template <typename T>
__device__ void grouped_linear_forward(T* ys, const T* xs, const int* offsets, const T* const* weights,
                                       int n_experts, int d_in, int d_out) {
    __shared__ float xt[MOE_TILE][MOE_TILE + 1];
    __shared__ float wt[MOE_TILE][MOE_TILE + 1];
    int e, r0, r1;
    if (!moe_group_tile(offsets, n_experts, blockIdx.x, e, r0, r1)) return;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int r = r0 + ty, o = blockIdx.y * MOE_TILE + tx, wo = blockIdx.y * MOE_TILE + ty;
    const T* w = weights[e];
    float acc = 0.0f;
    for (int i0 = 0; i0 < d_in; i0 += MOE_TILE) {
        const int i = i0 + tx;
        xt[ty][tx] = (r < r1 && i < d_in) ? ld(xs, (i64)r * d_in + i) : 0.0f;
        wt[ty][tx] = (wo < d_out && i < d_in) ? ld(w, (i64)wo * d_in + i) : 0.0f;
        __syncthreads();
        for (int j = 0; j < MOE_TILE; ++j) acc = fmaf(xt[ty][j], wt[tx][j], acc);
        __syncthreads();
    }
    if (r < r1 && o < d_out) st(ys, (i64)r * d_out + o, acc);
}

/// The grouped matmul: for each expert e, rows offsets[e]..offsets[e+1] of `xs [R, d_in]`
/// times expert e's weight `[d_out, d_in]` (`weights`, a device table of n_experts pointers)
/// transposed, into `ys [R, d_out]`; each output summed over d_in in increasing order. Rows
/// outside every group are not written. Launch: blocks of (MOE_TILE, MOE_TILE) threads; grid
/// (ceil(R / MOE_TILE) + n_experts, ceil(d_out / MOE_TILE)).
extern "C" __global__ void grouped_linear_forward_f32(float* ys, const float* xs, const int* offsets, const float* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_forward(ys, xs, offsets, weights, n_experts, d_in, d_out); }
extern "C" __global__ void grouped_linear_forward_bf16(bf16* ys, const bf16* xs, const int* offsets, const bf16* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_forward(ys, xs, offsets, weights, n_experts, d_in, d_out); }
extern "C" __global__ void grouped_linear_forward_f16(f16* ys, const f16* xs, const int* offsets, const f16* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_forward(ys, xs, offsets, weights, n_experts, d_in, d_out); }

template <typename T>
__device__ void grouped_linear_backward_dx(T* dxs, const T* dys, const int* offsets, const T* const* weights,
                                           int n_experts, int d_in, int d_out) {
    __shared__ float gt[MOE_TILE][MOE_TILE + 1];
    __shared__ float wt[MOE_TILE][MOE_TILE + 1];
    int e, r0, r1;
    if (!moe_group_tile(offsets, n_experts, blockIdx.x, e, r0, r1)) return;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int r = r0 + ty, i = blockIdx.y * MOE_TILE + tx;
    const T* w = weights[e];
    float acc = 0.0f;
    for (int o0 = 0; o0 < d_out; o0 += MOE_TILE) {
        gt[ty][tx] = (r < r1 && o0 + tx < d_out) ? ld(dys, (i64)r * d_out + o0 + tx) : 0.0f;
        wt[ty][tx] = (o0 + ty < d_out && i < d_in) ? ld(w, (i64)(o0 + ty) * d_in + i) : 0.0f;
        __syncthreads();
        for (int j = 0; j < MOE_TILE; ++j) acc = fmaf(gt[ty][j], wt[j][tx], acc);
        __syncthreads();
    }
    if (r < r1 && i < d_in) st(dxs, (i64)r * d_in + i, acc);
}

/// The grouped matmul's input gradient: for each expert e, rows offsets[e]..offsets[e+1] of
/// `dxs [R, d_in]` = the same rows of `dys [R, d_out]` times expert e's weight `[d_out,
/// d_in]`; each summed over d_out in increasing order. Launch as `grouped_linear_forward_*`,
/// grid (ceil(R / MOE_TILE) + n_experts, ceil(d_in / MOE_TILE)).
extern "C" __global__ void grouped_linear_backward_dx_f32(float* dxs, const float* dys, const int* offsets, const float* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_backward_dx(dxs, dys, offsets, weights, n_experts, d_in, d_out); }
extern "C" __global__ void grouped_linear_backward_dx_bf16(bf16* dxs, const bf16* dys, const int* offsets, const bf16* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_backward_dx(dxs, dys, offsets, weights, n_experts, d_in, d_out); }
extern "C" __global__ void grouped_linear_backward_dx_f16(f16* dxs, const f16* dys, const int* offsets, const f16* const* weights, int n_experts, int d_in, int d_out) { grouped_linear_backward_dx(dxs, dys, offsets, weights, n_experts, d_in, d_out); }

template <typename T>
__device__ void grouped_linear_backward_dw(T* const* dweights, const T* dys, const T* xs, const int* offsets,
                                           int d_in, int d_out) {
    __shared__ float gt[MOE_TILE][MOE_TILE + 1];
    __shared__ float xt[MOE_TILE][MOE_TILE + 1];
    const int e = blockIdx.z, tx = threadIdx.x, ty = threadIdx.y;
    const int i = blockIdx.x * MOE_TILE + tx, o = blockIdx.y * MOE_TILE + ty;
    const int lo = offsets[e], hi = offsets[e + 1];
    float acc = 0.0f;
    for (int r0 = lo; r0 < hi; r0 += MOE_TILE) {
        const int r = r0 + ty;
        const int oc = blockIdx.y * MOE_TILE + tx;
        gt[ty][tx] = (r < hi && oc < d_out) ? ld(dys, (i64)r * d_out + oc) : 0.0f;
        xt[ty][tx] = (r < hi && i < d_in) ? ld(xs, (i64)r * d_in + i) : 0.0f;
        __syncthreads();
        for (int j = 0; j < MOE_TILE; ++j) acc = fmaf(gt[j][ty], xt[j][tx], acc);
        __syncthreads();
    }
    if (o < d_out && i < d_in) st(dweights[e], (i64)o * d_in + i, acc);
}

/// The grouped matmul's weight gradients: expert e's `[d_out, d_in]` (`dweights`, a device
/// table of one pointer per expert; overwritten, zero for an empty group) = the sum over its
/// rows offsets[e]..offsets[e+1], in increasing order, of dys[r, :]^T xs[r, :]. Launch:
/// blocks of (MOE_TILE, MOE_TILE) threads; grid (ceil(d_in / MOE_TILE), ceil(d_out /
/// MOE_TILE), n_experts).
extern "C" __global__ void grouped_linear_backward_dw_f32(float* const* dweights, const float* dys, const float* xs, const int* offsets, int d_in, int d_out) { grouped_linear_backward_dw(dweights, dys, xs, offsets, d_in, d_out); }
extern "C" __global__ void grouped_linear_backward_dw_bf16(bf16* const* dweights, const bf16* dys, const bf16* xs, const int* offsets, int d_in, int d_out) { grouped_linear_backward_dw(dweights, dys, xs, offsets, d_in, d_out); }
extern "C" __global__ void grouped_linear_backward_dw_f16(f16* const* dweights, const f16* dys, const f16* xs, const int* offsets, int d_in, int d_out) { grouped_linear_backward_dw(dweights, dys, xs, offsets, d_in, d_out); }

template <typename T>
__device__ void moe_combine(T* out, const T* ys, const float* weights, const int* slots, int n_tokens, int channels,
                            int k) {
    GRID_STRIDE(i, (i64)n_tokens * channels) {
        const i64 t = i / channels;
        const int c = (int)(i - t * channels);
        float acc = __fmul_rn(ld(ys, (i64)slots[t * k] * channels + c), weights[t * k]);
        for (int j = 1; j < k; ++j)
            acc = __fadd_rn(acc, __fmul_rn(ld(ys, (i64)slots[t * k + j] * channels + c), weights[t * k + j]));
        st(out, i, acc);
    }
}

/// out[t, :] = sum over j in order of ys[slots[t*k + j], :] * weights[t*k + j]: the experts'
/// packed outputs `ys [N*k, C]` weighted back into `out [N, C]`. Grid-stride over
/// n_tokens * channels.
extern "C" __global__ void moe_combine_f32(float* out, const float* ys, const float* weights, const int* slots, int n_tokens, int channels, int k) { moe_combine(out, ys, weights, slots, n_tokens, channels, k); }
extern "C" __global__ void moe_combine_bf16(bf16* out, const bf16* ys, const float* weights, const int* slots, int n_tokens, int channels, int k) { moe_combine(out, ys, weights, slots, n_tokens, channels, k); }
extern "C" __global__ void moe_combine_f16(f16* out, const f16* ys, const float* weights, const int* slots, int n_tokens, int channels, int k) { moe_combine(out, ys, weights, slots, n_tokens, channels, k); }

template <typename T>
__device__ void moe_combine_backward_dys(T* dys, const T* dout, const float* weights, const int* slots, int n_slots,
                                         int channels, int k) {
    GRID_STRIDE(i, (i64)n_slots * channels) {
        const i64 s = i / channels;
        const int c = (int)(i - s * channels);
        st(dys, (i64)slots[s] * channels + c, __fmul_rn(ld(dout, (s / k) * channels + c), weights[s]));
    }
}

/// dys[slots[s], :] = dout[s / k, :] * weights[s] for every slot s of n_slots = N*k: the
/// combine's gradient of the packed outputs (each packed row is one slot's, so each is
/// written once). Grid-stride over n_slots * channels.
extern "C" __global__ void moe_combine_backward_dys_f32(float* dys, const float* dout, const float* weights, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_dys(dys, dout, weights, slots, n_slots, channels, k); }
extern "C" __global__ void moe_combine_backward_dys_bf16(bf16* dys, const bf16* dout, const float* weights, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_dys(dys, dout, weights, slots, n_slots, channels, k); }
extern "C" __global__ void moe_combine_backward_dys_f16(f16* dys, const f16* dout, const float* weights, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_dys(dys, dout, weights, slots, n_slots, channels, k); }

template <typename T>
__device__ void moe_combine_backward_weights(float* dweights, const T* dout, const T* ys, const int* slots,
                                             int n_slots, int channels, int k) {
    GRID_STRIDE(s, n_slots) {
        const i64 g0 = (s / k) * channels, y0 = (i64)slots[s] * channels;
        float acc = -0.0f;
        for (int c = 0; c < channels; ++c) acc = __fadd_rn(acc, __fmul_rn(ld(dout, g0 + c), ld(ys, y0 + c)));
        dweights[s] = acc;
    }
}

/// dweights[s] (f32) = the dot product, over channels in order, of dout[s / k, :] with the
/// expert's output ys[slots[s], :]: the combine's gradient of its weights. One thread per
/// slot. Grid-stride over n_slots.
extern "C" __global__ void moe_combine_backward_weights_f32(float* dweights, const float* dout, const float* ys, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_weights(dweights, dout, ys, slots, n_slots, channels, k); }
extern "C" __global__ void moe_combine_backward_weights_bf16(float* dweights, const bf16* dout, const bf16* ys, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_weights(dweights, dout, ys, slots, n_slots, channels, k); }
extern "C" __global__ void moe_combine_backward_weights_f16(float* dweights, const f16* dout, const f16* ys, const int* slots, int n_slots, int channels, int k) { moe_combine_backward_weights(dweights, dout, ys, slots, n_slots, channels, k); }

/// Threads of the load-balancing loss's one-block kernels: one per partial sum of the
/// probabilities (`AUX_PARTIALS` in runtime/src/kernels/moe.rs), and the most experts they take.
#define MOE_AUX_THREADS 256
/// Experts whose partials one pass of the in-order reduction gathers in shared memory.
#define MOE_AUX_GATHER 8

/// Row `r` of `layers` logits tensors `[n_tokens, E]` taken in layer then row order.
template <typename T>
__device__ __forceinline__ T* moe_aux_row(void* const* logits, int n_tokens, int n_experts, i64 r) {
    return (T*)logits[r / n_tokens] + (r % n_tokens) * n_experts;
}

/// The softmax of one row in the host's order, `p[e] = expf(l[e] - max) / sum`, and its top-k
/// (largest first, ties to the lower expert) added to `counts`; returns the sum.
template <typename T>
__device__ float moe_aux_softmax(float* p, int* chosen, int* counts, const T* l, int n_experts, int k) {
    float mx = -pt_inf();
    for (int e = 0; e < n_experts; ++e) mx = fmaxf(mx, ld(l, e));
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e) {
        p[e] = expf(ld(l, e) - mx);
        sum = __fadd_rn(sum, p[e]);
    }
    for (int e = 0; e < n_experts; ++e) p[e] = p[e] / sum;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < n_experts; ++e) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        chosen[j] = best < 0 ? 0 : best;
        counts[chosen[j]] += 1;
    }
    return sum;
}

/// The per-expert counts (rows whose top-k holds the expert) and, when `probs` is not null,
/// summed probabilities of every layer's rows, in the host's order: thread `j` sums rows
/// `j, j + 256, ...` (layer then row order) in f64, and the partials are added in thread order,
/// `MOE_AUX_GATHER` experts at a time through shared memory. Counts are integers, exact in any
/// order. Every thread of the one block must call it.
template <typename T>
__device__ void moe_aux_sums(int* counts, double* probs, const void* const* logits, int layers, int n_tokens,
                             int n_experts, int k) {
    __shared__ double gather[MOE_AUX_THREADS][MOE_AUX_GATHER];
    __shared__ int gather_counts[MOE_AUX_THREADS][MOE_AUX_GATHER];
    if (blockDim.x != MOE_AUX_THREADS || n_experts > MOE_AUX_THREADS || k > n_experts) __trap();
    const int tid = threadIdx.x;
    double mine[MOE_AUX_THREADS];
    int mine_counts[MOE_AUX_THREADS], chosen[MOE_AUX_THREADS];
    float p[MOE_AUX_THREADS];
    for (int e = 0; e < n_experts; ++e) {
        mine[e] = 0.0;
        mine_counts[e] = 0;
    }
    const i64 rows = (i64)layers * n_tokens;
    for (i64 r = tid; r < rows; r += MOE_AUX_THREADS) {
        moe_aux_softmax(p, chosen, mine_counts, moe_aux_row<T>((void* const*)logits, n_tokens, n_experts, r), n_experts, k);
        for (int e = 0; e < n_experts; ++e) mine[e] += (double)p[e];
    }
    for (int e0 = 0; e0 < n_experts; e0 += MOE_AUX_GATHER) {
        for (int g = 0; g < MOE_AUX_GATHER; ++g) {
            const bool in = e0 + g < n_experts;
            gather[tid][g] = in ? mine[e0 + g] : 0.0;
            gather_counts[tid][g] = in ? mine_counts[e0 + g] : 0;
        }
        __syncthreads();
        if (tid < MOE_AUX_GATHER && e0 + tid < n_experts) {
            double s = 0.0;
            int c = 0;
            for (int j = 0; j < MOE_AUX_THREADS; ++j) {
                s += gather[j][tid];
                c += gather_counts[j][tid];
            }
            if (probs) probs[e0 + tid] = s;
            counts[e0 + tid] = c;
        }
        __syncthreads();
    }
}

template <typename T>
__device__ void moe_aux_loss(float* out, const float* loss, const void* const* logits, int layers, int n_tokens,
                             int n_experts, int k, long long coef_bits) {
    __shared__ int counts[MOE_AUX_THREADS];
    __shared__ double probs[MOE_AUX_THREADS];
    moe_aux_sums<T>(counts, probs, logits, layers, n_tokens, n_experts, k);
    __syncthreads();
    if (threadIdx.x == 0) {
        const double rows = (double)((i64)layers * n_tokens);
        double aux = -0.0;
        for (int e = 0; e < n_experts; ++e) aux = __dadd_rn(aux, __dmul_rn((double)counts[e] / rows, probs[e] / rows));
        aux = __dmul_rn(aux, (double)n_experts);
        out[0] = __double2float_rn(__dadd_rn((double)loss[0], __dmul_rn(__longlong_as_double(coef_bits), aux)));
    }
}

/// `out[0] = loss[0] + coef * aux` (f32, summed in f64), with `aux` transformers'
/// `load_balancing_loss_func` over the router logits of `layers` sparse layers (a device table
/// of pointers to `[n_tokens, E]` tensors): `E * sum_e (c_e / R) (p_e / R)` over the `R` rows.
/// `coef_bits` is the f64 coefficient's bits. Launch: exactly one block of MOE_AUX_THREADS.
extern "C" __global__ void moe_aux_loss_f32(float* out, const float* loss, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long coef_bits) { moe_aux_loss<float>(out, loss, logits, layers, n_tokens, n_experts, k, coef_bits); }
extern "C" __global__ void moe_aux_loss_bf16(float* out, const float* loss, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long coef_bits) { moe_aux_loss<bf16>(out, loss, logits, layers, n_tokens, n_experts, k, coef_bits); }
extern "C" __global__ void moe_aux_loss_f16(float* out, const float* loss, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long coef_bits) { moe_aux_loss<f16>(out, loss, logits, layers, n_tokens, n_experts, k, coef_bits); }

template <typename T>
__device__ void moe_aux_grads(float* grads, const void* const* logits, int layers, int n_tokens, int n_experts,
                              int k, long long scale_bits) {
    __shared__ int counts[MOE_AUX_THREADS];
    moe_aux_sums<T>(counts, nullptr, logits, layers, n_tokens, n_experts, k);
    __syncthreads();
    const double scale = __longlong_as_double(scale_bits);
    for (int e = threadIdx.x; e < n_experts; e += MOE_AUX_THREADS)
        grads[e] = __double2float_rn(__dmul_rn((double)counts[e], scale));
}

/// Step 1 of the load-balancing loss's gradient: `grads [E]` (f32) the loss's gradient with
/// respect to each expert's probability in any row, `c_e * scale` with `scale = seed * coef *
/// E / R^2` (the f64's bits), from the counts of every layer's rows. Launch: exactly one block
/// of MOE_AUX_THREADS.
extern "C" __global__ void moe_aux_grads_f32(float* grads, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long scale_bits) { moe_aux_grads<float>(grads, logits, layers, n_tokens, n_experts, k, scale_bits); }
extern "C" __global__ void moe_aux_grads_bf16(float* grads, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long scale_bits) { moe_aux_grads<bf16>(grads, logits, layers, n_tokens, n_experts, k, scale_bits); }
extern "C" __global__ void moe_aux_grads_f16(float* grads, const void* const* logits, int layers, int n_tokens, int n_experts, int k, long long scale_bits) { moe_aux_grads<f16>(grads, logits, layers, n_tokens, n_experts, k, scale_bits); }

template <typename T>
__device__ void moe_aux_loss_backward(void* const* dlogits, const void* const* logits, const float* grads,
                                      int layers, int n_tokens, int n_experts) {
    GRID_STRIDE(r, (i64)layers * n_tokens) {
        const T* l = moe_aux_row<T>((void* const*)logits, n_tokens, n_experts, r);
        T* dl = moe_aux_row<T>(dlogits, n_tokens, n_experts, r);
        float mx = -pt_inf();
        for (int e = 0; e < n_experts; ++e) mx = fmaxf(mx, ld(l, e));
        float sum = 0.0f;
        for (int e = 0; e < n_experts; ++e) sum = __fadd_rn(sum, expf(ld(l, e) - mx));
        float dot = -0.0f;
        for (int e = 0; e < n_experts; ++e) dot = __fadd_rn(dot, __fmul_rn(expf(ld(l, e) - mx) / sum, grads[e]));
        for (int e = 0; e < n_experts; ++e) {
            const float p = expf(ld(l, e) - mx) / sum;
            st(dl, e, __fmul_rn(p, __fsub_rn(grads[e], dot)));
        }
    }
}

/// Step 2 of the load-balancing loss's gradient: each row of each layer's `dlogits` (a device
/// table of pointers to `[n_tokens, E]` tensors, overwritten) is `p * (g - p . g)` for the row's
/// softmax `p` of `logits` (a table of the same shapes) and step 1's `grads [E]`. One thread per
/// row. Grid-stride over layers * n_tokens.
extern "C" __global__ void moe_aux_loss_backward_f32(void* const* dlogits, const void* const* logits, const float* grads, int layers, int n_tokens, int n_experts) { moe_aux_loss_backward<float>(dlogits, logits, grads, layers, n_tokens, n_experts); }
extern "C" __global__ void moe_aux_loss_backward_bf16(void* const* dlogits, const void* const* logits, const float* grads, int layers, int n_tokens, int n_experts) { moe_aux_loss_backward<bf16>(dlogits, logits, grads, layers, n_tokens, n_experts); }
extern "C" __global__ void moe_aux_loss_backward_f16(void* const* dlogits, const void* const* logits, const float* grads, int layers, int n_tokens, int n_experts) { moe_aux_loss_backward<f16>(dlogits, logits, grads, layers, n_tokens, n_experts); }
