// Fused causal self-attention (flash-attention style) with grouped KV heads, an optional
// sliding window and separate or packed q/k/v, mirroring runtime/src/kernels/attention.rs.
// Nothing of size [T, T] is built: the forward keeps an online softmax per query row and saves
// only the row logsumexp; the backward recomputes the probabilities from it.
//
// Layouts. q, k, v are rows of [B, T, *] tensors: element d of head h at row (b, t) is at
// `(b * T + t) * stride + h * D + d`, with `q_stride` for q (and dq), `kv_stride` for k, v (and
// dk, dv). Separate tensors: q_stride = H * D, kv_stride = KV * D. GPT-2's packed
// [q | k | v] (`c_attn`'s output, and its gradient): pass q = qkv, k = qkv + H * D,
// v = qkv + (H + KV) * D and both strides (H + 2 KV) * D. `out`, `dout` are [B, T, H * D];
// `lse`, `delta` are [B, H, T] f32. Query head h reads kv head h / (H / KV), as `repeat_kv`.
// `window` W > 0: query t sees keys s with t - W < s <= t (transformers' sliding window);
// W <= 0: plain causal. Scale 1 / sqrt(D). D must be at most ATTN_MAX_D (the kernels trap
// otherwise).
//
// The plan runs bf16 and f16 attention with heads of 64, 128 or 256 as the flash kernels on
// tensor cores at the end of this file, and every other attention as the GEMM path before
// them; these fused scalar kernels are kept as the reference the CPU emulation checks against.
//
// Work split (correctness first; no tensor cores). All kernels: 1-D blocks of exactly
// ATTN_THREADS threads (4 warps). Each warp owns a few query (or key) rows; lane j handles key
// (or query) j of a 32-wide chunk for the dot products, then lane j owns dimensions
// j, j + 32, ... of its rows' accumulators. K/V (or Q/dO) chunks are staged in shared memory,
// rows padded by one float so neither access pattern has bank conflicts.
//
// Determinism: every sum has a fixed order (warp butterflies, keys and queries in index order,
// query heads of a group in index order); no atomics. dK and dV for grouped heads are summed by
// the one block that owns the key rows, looping over the group's query heads.

// The tile constants a launcher sizes grids with come from the launcher, as -D defines
// (runtime/src/cuda/mod.rs, KERNEL_DEFINES: NVRTC gets them from nvrtc::options, the CPU
// emulation harness from .ci/run), so there is no second copy to drift:
//   ATTN_MAX_D     largest head dimension
//   ATTN_THREADS   threads per block (a multiple of 32)
//   ATTN_FWD_ROWS  query rows per forward block (a multiple of the warps)
//   ATTN_DQ_ROWS   query rows per dq block
//   ATTN_DKV_ROWS  key rows per dk/dv block
#if !defined(ATTN_MAX_D) || !defined(ATTN_THREADS) || !defined(ATTN_FWD_ROWS) || \
    !defined(ATTN_DQ_ROWS) || !defined(ATTN_DKV_ROWS)
#error "compile with the -D defines of KERNEL_DEFINES in runtime/src/cuda/mod.rs"
#endif
#define ATTN_WARPS (ATTN_THREADS / 32)
#define ATTN_CHUNK 32                 // keys (forward, dq) or queries (dk/dv) per staged chunk
#define ATTN_DPL (ATTN_MAX_D / 32)    // accumulator slots per lane
static_assert(ATTN_FWD_ROWS % ATTN_WARPS == 0 && ATTN_DQ_ROWS % ATTN_WARPS == 0 &&
              ATTN_DKV_ROWS % ATTN_WARPS == 0 && ATTN_MAX_D % 32 == 0,
              "each warp owns whole rows and whole 32-lane slices of a head");

__device__ __forceinline__ void attn_check(int D) {
    if (D <= 0 || D > ATTN_MAX_D || blockDim.x != ATTN_THREADS) __trap();
}

/// The first key query t may attend.
__device__ __forceinline__ int attn_first_key(int t, int window) { return window > 0 ? max(0, t + 1 - window) : 0; }

/// Stages rows r0..r0+count of head `head` (zeros past T) into `dst` with row pitch `pitch`.
template <typename T>
__device__ __forceinline__ void attn_stage(float* dst, int pitch, const T* src, int b, int r0, int count, int head,
                                           int T_len, int D, int stride) {
    for (int e = threadIdx.x; e < count * D; e += blockDim.x) {
        const int j = e / D, d = e - j * D;
        const int r = r0 + j;
        dst[j * pitch + d] = r < T_len ? ld(src, ((i64)b * T_len + r) * stride + (i64)head * D + d) : 0.0f;
    }
}

template <typename T>
__device__ void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, int B, int T_len, int H,
                                  int KV, int D, int window, int q_stride, int kv_stride) {
    attn_check(D);
    constexpr int RPW = ATTN_FWD_ROWS / ATTN_WARPS;
    __shared__ float sq[ATTN_FWD_ROWS][ATTN_MAX_D];
    __shared__ float sk[ATTN_CHUNK][ATTN_MAX_D + 1];
    __shared__ float sv[ATTN_CHUNK][ATTN_MAX_D + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * ATTN_FWD_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KV);
    const float scale = 1.0f / sqrtf((float)D);

    attn_stage(&sq[0][0], ATTN_MAX_D, q, b, t0, ATTN_FWD_ROWS, h, T_len, D, q_stride);
    float o[RPW][ATTN_DPL], m[RPW], l[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        m[r] = -pt_inf();
        l[r] = 0.0f;
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) o[r][x] = 0.0f;
    }
    const int s_begin = attn_first_key(t0, window) / ATTN_CHUNK * ATTN_CHUNK;
    const int s_end = min(T_len, t0 + ATTN_FWD_ROWS);
    for (int s0 = s_begin; s0 < s_end; s0 += ATTN_CHUNK) {
        __syncthreads();
        attn_stage(&sk[0][0], ATTN_MAX_D + 1, k, b, s0, ATTN_CHUNK, kvh, T_len, D, kv_stride);
        attn_stage(&sv[0][0], ATTN_MAX_D + 1, v, b, s0, ATTN_CHUNK, kvh, T_len, D, kv_stride);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int i = warp * RPW + r, t = t0 + i;
            if (t >= T_len) continue; // warp-uniform
            const int s = s0 + lane;
            const bool visible = s <= t && s >= attn_first_key(t, window);
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += sq[i][d] * sk[lane][d];
            const float sc = visible ? dot * scale : -pt_inf();
            const float cmax = warp_max(sc);
            if (cmax == -pt_inf()) continue; // nothing visible in this chunk; warp-uniform
            const float m_new = fmaxf(m[r], cmax);
            const float corr = expf(m[r] - m_new); // 0 on the first visible chunk
            const float p = visible ? expf(sc - m_new) : 0.0f;
            l[r] = l[r] * corr + warp_sum(p);
            m[r] = m_new;
#pragma unroll
            for (int x = 0; x < ATTN_DPL; ++x) o[r][x] *= corr;
            for (int j = 0; j < ATTN_CHUNK; ++j) {
                const float pj = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                for (int x = 0; x < ATTN_DPL; ++x) {
                    const int d = lane + 32 * x;
                    if (d < D) o[r][x] += pj * sv[j][d];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = t0 + warp * RPW + r;
        if (t >= T_len) continue;
        const float inv = 1.0f / l[r];
        const i64 row = ((i64)b * T_len + t) * H * D + (i64)h * D;
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) {
            const int d = lane + 32 * x;
            if (d < D) st(out, row + d, o[r][x] * inv);
        }
        if (lane == 0) lse[((i64)b * H + h) * T_len + t] = m[r] + logf(l[r]);
    }
}

/// out = softmax(q k^T / sqrt(D) + causal/window mask) v, and lse [B, H, T] for the backward.
/// Launch: block ATTN_THREADS, grid (ceil(T / ATTN_FWD_ROWS), H, B).
extern "C" __global__ void attention_forward_f32(float* out, float* lse, const float* q, const float* k, const float* v, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_forward(out, lse, q, k, v, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_forward_bf16(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_forward(out, lse, q, k, v, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_forward_f16(f16* out, float* lse, const f16* q, const f16* k, const f16* v, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_forward(out, lse, q, k, v, B, T, H, KV, D, window, q_stride, kv_stride); }

template <typename T>
__device__ void attention_backward_delta(float* delta, const T* out, const T* dout, int B, int T_len, int H, int D) {
    const int lane = threadIdx.x & 31;
    const i64 rows = (i64)B * T_len * H;
    for (i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows;
         row += ((i64)gridDim.x * blockDim.x) >> 5) {
        // row = (b * T + t) * H + h, the order of out's rows and heads
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32) acc += ld(dout, row * D + d) * ld(out, row * D + d);
        acc = warp_sum(acc);
        if (lane == 0) {
            const i64 bt = row / H;
            const int h = (int)(row - bt * H);
            const i64 b = bt / T_len, t = bt - b * T_len;
            delta[(b * H + h) * T_len + t] = acc;
        }
    }
}

/// Step 1 of the backward: delta[b, h, t] = dout[b, t, h, :] . out[b, t, h, :] (f32
/// workspace [B, H, T]). Launch: one warp per row: 1-D blocks of a multiple of 32 threads, any
/// grid (warps stride over the B * T * H rows).
extern "C" __global__ void attention_backward_delta_f32(float* delta, const float* out, const float* dout, int B, int T, int H, int D) { attention_backward_delta(delta, out, dout, B, T, H, D); }
extern "C" __global__ void attention_backward_delta_bf16(float* delta, const bf16* out, const bf16* dout, int B, int T, int H, int D) { attention_backward_delta(delta, out, dout, B, T, H, D); }
extern "C" __global__ void attention_backward_delta_f16(float* delta, const f16* out, const f16* dout, int B, int T, int H, int D) { attention_backward_delta(delta, out, dout, B, T, H, D); }

template <typename T>
__device__ void attention_backward_dq(T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                      const float* delta, int B, int T_len, int H, int KV, int D, int window,
                                      int q_stride, int kv_stride) {
    attn_check(D);
    constexpr int RPW = ATTN_DQ_ROWS / ATTN_WARPS;
    __shared__ float sq[ATTN_DQ_ROWS][ATTN_MAX_D];
    __shared__ float sdo[ATTN_DQ_ROWS][ATTN_MAX_D];
    __shared__ float sk[ATTN_CHUNK][ATTN_MAX_D + 1];
    __shared__ float sv[ATTN_CHUNK][ATTN_MAX_D + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * ATTN_DQ_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KV);
    const float scale = 1.0f / sqrtf((float)D);

    attn_stage(&sq[0][0], ATTN_MAX_D, q, b, t0, ATTN_DQ_ROWS, h, T_len, D, q_stride);
    attn_stage(&sdo[0][0], ATTN_MAX_D, dout, b, t0, ATTN_DQ_ROWS, h, T_len, D, H * D);
    float acc[RPW][ATTN_DPL], lrow[RPW], drow[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = t0 + warp * RPW + r;
        const i64 at = ((i64)b * H + h) * T_len + t;
        lrow[r] = t < T_len ? lse[at] : 0.0f;
        drow[r] = t < T_len ? delta[at] : 0.0f;
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) acc[r][x] = 0.0f;
    }
    const int s_begin = attn_first_key(t0, window) / ATTN_CHUNK * ATTN_CHUNK;
    const int s_end = min(T_len, t0 + ATTN_DQ_ROWS);
    for (int s0 = s_begin; s0 < s_end; s0 += ATTN_CHUNK) {
        __syncthreads();
        attn_stage(&sk[0][0], ATTN_MAX_D + 1, k, b, s0, ATTN_CHUNK, kvh, T_len, D, kv_stride);
        attn_stage(&sv[0][0], ATTN_MAX_D + 1, v, b, s0, ATTN_CHUNK, kvh, T_len, D, kv_stride);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int i = warp * RPW + r, t = t0 + i;
            if (t >= T_len) continue;
            const int s = s0 + lane;
            const bool visible = s <= t && s >= attn_first_key(t, window);
            float qk = 0.0f, dp = 0.0f;
            for (int d = 0; d < D; ++d) {
                qk += sq[i][d] * sk[lane][d];
                dp += sdo[i][d] * sv[lane][d];
            }
            const float p = visible ? expf(qk * scale - lrow[r]) : 0.0f;
            const float ds = p * (dp - drow[r]) * scale;
            for (int j = 0; j < ATTN_CHUNK; ++j) {
                const float dsj = __shfl_sync(FULL_MASK, ds, j);
#pragma unroll
                for (int x = 0; x < ATTN_DPL; ++x) {
                    const int d = lane + 32 * x;
                    if (d < D) acc[r][x] += dsj * sk[j][d];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = t0 + warp * RPW + r;
        if (t >= T_len) continue;
        const i64 row = ((i64)b * T_len + t) * q_stride + (i64)h * D;
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) {
            const int d = lane + 32 * x;
            if (d < D) st(dq, row + d, acc[r][x]);
        }
    }
}

/// Step 2: dq_t = scale * sum_s ds_ts k_s with p = exp(q.k * scale - lse) and
/// ds = p (dout_t . v_s - delta_t); overwrites dq (stride q_stride). Launch: block
/// ATTN_THREADS, grid (ceil(T / ATTN_DQ_ROWS), H, B).
extern "C" __global__ void attention_backward_dq_f32(float* dq, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dq(dq, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_backward_dq_bf16(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dq(dq, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_backward_dq_f16(f16* dq, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dq(dq, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }

template <typename T>
__device__ void attention_backward_dkv(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                                       const float* lse, const float* delta, int B, int T_len, int H, int KV, int D,
                                       int window, int q_stride, int kv_stride) {
    attn_check(D);
    constexpr int RPW = ATTN_DKV_ROWS / ATTN_WARPS;
    __shared__ float sk[ATTN_DKV_ROWS][ATTN_MAX_D];
    __shared__ float sv[ATTN_DKV_ROWS][ATTN_MAX_D];
    __shared__ float sq[ATTN_CHUNK][ATTN_MAX_D + 1];
    __shared__ float sdo[ATTN_CHUNK][ATTN_MAX_D + 1];
    __shared__ float slse[ATTN_CHUNK], sdelta[ATTN_CHUNK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s0 = blockIdx.x * ATTN_DKV_ROWS, kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KV;
    const float scale = 1.0f / sqrtf((float)D);

    attn_stage(&sk[0][0], ATTN_MAX_D, k, b, s0, ATTN_DKV_ROWS, kvh, T_len, D, kv_stride);
    attn_stage(&sv[0][0], ATTN_MAX_D, v, b, s0, ATTN_DKV_ROWS, kvh, T_len, D, kv_stride);
    float gk[RPW][ATTN_DPL], gv[RPW][ATTN_DPL];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) gk[r][x] = gv[r][x] = 0.0f;
    // Queries that see any of keys s0..s0+ROWS: t >= s0, and t < s_last + W with a window.
    const int s_last = min(T_len, s0 + ATTN_DKV_ROWS) - 1;
    const int t_end = window > 0 ? min(T_len, s_last + window) : T_len;
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int t0 = s0; t0 < t_end; t0 += ATTN_CHUNK) {
            __syncthreads();
            attn_stage(&sq[0][0], ATTN_MAX_D + 1, q, b, t0, ATTN_CHUNK, h, T_len, D, q_stride);
            attn_stage(&sdo[0][0], ATTN_MAX_D + 1, dout, b, t0, ATTN_CHUNK, h, T_len, D, H * D);
            if (threadIdx.x < ATTN_CHUNK) {
                const int t = t0 + threadIdx.x;
                const i64 at = ((i64)b * H + h) * T_len + t;
                slse[threadIdx.x] = t < T_len ? lse[at] : 0.0f;
                sdelta[threadIdx.x] = t < T_len ? delta[at] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const int i = warp * RPW + r, s = s0 + i;
                if (s >= T_len) continue;
                const int t = t0 + lane;
                const bool visible = t < T_len && t >= s && (window <= 0 || t < s + window);
                float qk = 0.0f, dp = 0.0f;
                for (int d = 0; d < D; ++d) {
                    qk += sq[lane][d] * sk[i][d];
                    dp += sdo[lane][d] * sv[i][d];
                }
                const float p = visible ? expf(qk * scale - slse[lane]) : 0.0f;
                const float ds = p * (dp - sdelta[lane]) * scale;
                for (int j = 0; j < ATTN_CHUNK; ++j) {
                    const float pj = __shfl_sync(FULL_MASK, p, j);
                    const float dsj = __shfl_sync(FULL_MASK, ds, j);
#pragma unroll
                    for (int x = 0; x < ATTN_DPL; ++x) {
                        const int d = lane + 32 * x;
                        if (d < D) {
                            gv[r][x] += pj * sdo[j][d];
                            gk[r][x] += dsj * sq[j][d];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int s = s0 + warp * RPW + r;
        if (s >= T_len) continue;
        const i64 row = ((i64)b * T_len + s) * kv_stride + (i64)kvh * D;
#pragma unroll
        for (int x = 0; x < ATTN_DPL; ++x) {
            const int d = lane + 32 * x;
            if (d < D) {
                st(dk, row + d, gk[r][x]);
                st(dv, row + d, gv[r][x]);
            }
        }
    }
}

/// Step 3: dv_s = sum over the group's query heads h and queries t of p_ts dout_t, and
/// dk_s = scale * sum of ds_ts q_t, in that order; overwrites dk and dv (stride kv_stride).
/// Launch: block ATTN_THREADS, grid (ceil(T / ATTN_DKV_ROWS), KV, B).
extern "C" __global__ void attention_backward_dkv_f32(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dkv(dk, dv, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_backward_dkv_bf16(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dkv(dk, dv, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }
extern "C" __global__ void attention_backward_dkv_f16(f16* dk, f16* dv, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int B, int T, int H, int KV, int D, int window, int q_stride, int kv_stride) { attention_backward_dkv(dk, dv, dout, q, k, v, lse, delta, B, T, H, KV, D, window, q_stride, kv_stride); }

// ---------------------------------------------------------------------------------------------
// Attention as GEMMs (what the launcher plans for f32, and for head dimensions the flash
// kernels below are not built for; runtime/src/cuda/launch.rs). The matrix
// products are cuBLAS strided-batched GEMMs over a batch of KV heads (bf16 or f32 in, f32
// accumulate); the kernels below do what lies between them, one block per score row:
//
//   forward:  S = scale Q K^T (GEMM, f32) -> attention_softmax -> P (storage dtype, over S;
//             soft-capped scores when `cap > 0`)
//             -> O = P V (GEMM)
//   backward: S again (GEMM), dP = dO V^T (GEMM, f32) -> attention_backward_ds -> P over S,
//             dS = P (dP - delta) scale over dP -> dV += P^T dO, dQ = dS K, dK += dS^T Q (GEMMs)
//
// Scores of head i of the batch, row t: `scores + (i * T + t) * T` (f32, [heads, T, T] in the
// planned workspace). The probabilities (and score gradients) are written in place in the
// storage dtype: row t of head i starts at the same byte as its f32 row, so their leading
// dimension is T * 4 / sizeof(storage) elements (T for f32, 2 T for bf16). The write is done
// in block-wide chunks, each read before the block's barrier and written after it: a bf16
// write of element c lands on f32 element c / 2, which the chunk or an earlier one has read.
// Masked entries (keys after t, or before the window) are written as exact zeros, so the
// GEMMs may run over every key. `lse`, `delta` are [B, H, T] f32; the batch's first head's
// row starts at element `first`, with `head_stride` floats between the batch's heads.
// Launch: 1-D blocks of a multiple of 32 threads (at most 1024; 256 intended), grid (T, heads).

/// A score soft-capped to `cap * tanh(s / cap)` (Gemma 2); `cap == 0` leaves it.
__device__ __forceinline__ float attn_cap(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

/// Max over the whole block (as `block_sum`).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -pt_inf();
    return warp_max(v);
}

template <typename T>
__device__ void attention_softmax(float* scores, float* lse, i64 first, int T_len, int window, int head_stride, float cap) {
    __shared__ float red[32];
    const int t = blockIdx.x, i = blockIdx.y;
    float* s = scores + ((i64)i * T_len + t) * T_len;
    T* p = reinterpret_cast<T*>(s);
    const int lo = attn_first_key(t, window);
    float m = -pt_inf();
    for (int c = lo + threadIdx.x; c <= t; c += blockDim.x) m = fmaxf(m, attn_cap(s[c], cap));
    m = block_max(m, red);
    float l = 0.0f;
    for (int c = lo + threadIdx.x; c <= t; c += blockDim.x) l += expf(attn_cap(s[c], cap) - m);
    l = block_sum(l, red);
    for (int base = 0; base < T_len; base += blockDim.x) {
        const int c = base + threadIdx.x;
        const float v = c >= lo && c <= t ? expf(attn_cap(s[c], cap) - m) / l : 0.0f;
        __syncthreads();
        if (c < T_len) st(p, c, v);
    }
    if (threadIdx.x == 0) lse[first + (i64)i * head_stride + t] = m + logf(l);
}

/// Softmax of each causal (and windowed) score row in place: P (storage dtype) over the f32
/// scores, and the row's logsumexp. See the notes above for the layout and launch.
extern "C" __global__ void attention_softmax_f32(float* scores, float* lse, i64 first, int T, int window, int head_stride, float cap) { attention_softmax<float>(scores, lse, first, T, window, head_stride, cap); }
extern "C" __global__ void attention_softmax_bf16(float* scores, float* lse, i64 first, int T, int window, int head_stride, float cap) { attention_softmax<bf16>(scores, lse, first, T, window, head_stride, cap); }
extern "C" __global__ void attention_softmax_f16(float* scores, float* lse, i64 first, int T, int window, int head_stride, float cap) { attention_softmax<f16>(scores, lse, first, T, window, head_stride, cap); }

template <typename T>
__device__ void attention_backward_ds(float* scores, float* dprobs, const float* lse, const float* delta, i64 first,
                                      int T_len, int window, int head_stride, float scale, float cap) {
    const int t = blockIdx.x, i = blockIdx.y;
    const i64 row = ((i64)i * T_len + t) * T_len;
    float* s = scores + row;
    float* dp = dprobs + row;
    const i64 at = first + (i64)i * head_stride + t;
    const float L = lse[at], dl = delta[at];
    const int lo = attn_first_key(t, window);
    for (int base = 0; base < T_len; base += blockDim.x) {
        const int c = base + threadIdx.x;
        float pv = 0.0f, dsv = 0.0f;
        if (c >= lo && c <= t) {
            if (cap > 0.0f) {
                // Through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2.
                const float th = tanhf(s[c] / cap);
                pv = expf(cap * th - L);
                dsv = pv * (dp[c] - dl) * (1.0f - th * th) * scale;
            } else {
                pv = expf(s[c] - L);
                dsv = pv * (dp[c] - dl) * scale;
            }
        }
        __syncthreads();
        if (c < T_len) {
            st(reinterpret_cast<T*>(s), c, pv);
            st(reinterpret_cast<T*>(dp), c, dsv);
        }
    }
}

/// The backward's elementwise step over each score row, in place: P = exp(S - lse) (masked
/// to 0) over the scores and dS = P (dP - delta) scale over the probability gradients, both
/// in the storage dtype. See the notes above for the layout and launch.
extern "C" __global__ void attention_backward_ds_f32(float* scores, float* dprobs, const float* lse, const float* delta, i64 first, int T, int window, int head_stride, float scale, float cap) { attention_backward_ds<float>(scores, dprobs, lse, delta, first, T, window, head_stride, scale, cap); }
extern "C" __global__ void attention_backward_ds_bf16(float* scores, float* dprobs, const float* lse, const float* delta, i64 first, int T, int window, int head_stride, float scale, float cap) { attention_backward_ds<bf16>(scores, dprobs, lse, delta, first, T, window, head_stride, scale, cap); }
extern "C" __global__ void attention_backward_ds_f16(float* scores, float* dprobs, const float* lse, const float* delta, i64 first, int T, int window, int head_stride, float scale, float cap) { attention_backward_ds<f16>(scores, dprobs, lse, delta, first, T, window, head_stride, scale, cap); }

// ---------------------------------------------------------------------------------------------
// Flash attention on tensor cores (bf16 and f16 storage; what the launcher plans for them):
// `mma.sync.aligned.m16n8k16` with f32 accumulation (sm_80 and newer; built for an older
// architecture the kernels trap), FlashAttention-2's work split
// (arXiv 2307.08691). Nothing of size [T, T] exists: the forward keeps an online softmax per
// query row and saves the row logsumexp; the backward recomputes the probabilities from it.
//
// Same layouts, masks and GQA as the scalar kernels at the top of this file (q, k, v rows with
// `q_stride` / `kv_stride`, out and dout [B, T, H * D], lse and delta [B, H, T] f32, query head
// h reads kv head h / (H / KV)), with the op's own `scale` and soft-cap: score =
// cap tanh(scale q.k / cap) when cap > 0, scale q.k otherwise; lse is over those scores.
//
// Work split: 1-D blocks of ATTN_FLASH_THREADS (4 warps); each warp owns 16 rows (queries in the
// forward and dq, keys in dk/dv) as the A rows of its products; the block's 64 rows' partners
// (keys, or queries) are staged in shared memory in tiles of FlashTile<D>::ROWS rows (32
// queries in dk/dv), one thread per pair of 16-bit values (no cp.async pipelining, no
// ldmatrix: plain loads the emulation runs as they are), 16-bit values
// kept in pairs (u32) with rows padded by 8 values so that the fragment reads of a warp hit 32
// distinct banks. Tiles that no row of the block can see (after the diagonal, before the
// window) are not visited, and a warp skips the tiles none of its own rows see.
//
// Fragments follow the PTX ISA's m16n8k16 layout (see emu/intrinsics.h): a product's C
// fragment of P or dS becomes the A fragment of the next product without leaving registers;
// B fragments of K, Q, dO (as K^T, Q^T, dO^T) are 32-bit shared reads, those of V, dO, Q, K
// (as B with k along the rows) gather two 16-bit values of consecutive rows.
//
// Determinism: no atomics; every sum has one order for a given launch (keys, queries and the
// group's query heads in index order; quad butterflies for the row statistics). dQ has its own
// kernel (dq over the key tiles) and dK, dV theirs (over the group's query heads and query
// tiles), as the scalar kernels.
//
// Head dimensions: 64, 128 and 256 (an entry point each); others use the GEMM path.

// Tiles from the launcher's KERNEL_DEFINES, as those above: ATTN_FLASH_THREADS threads per
// block, ATTN_FLASH_ROWS rows (queries, or keys in dk/dv) per block, 16 per warp.
#if !defined(ATTN_FLASH_THREADS) || !defined(ATTN_FLASH_ROWS)
#error "compile with the -D defines of KERNEL_DEFINES in runtime/src/cuda/mod.rs"
#endif
static_assert(ATTN_FLASH_ROWS == 16 * (ATTN_FLASH_THREADS / 32), "each warp owns 16 rows, the m16 of its products");

/// Rows per staged tile of keys (forward, dq) or queries (dk/dv) for head dimension D: the
/// two staged tiles of a D = 256 kernel fit the 48 KiB of static shared memory with 32 rows.
template <int D> struct FlashTile {
    static constexpr int ROWS = D > 128 ? 32 : 64;
    static constexpr int PITCH = D / 2 + 4; // u32 per staged row: D values and 8 of padding
    static_assert(D % 64 == 0 && 2 * ROWS >= ATTN_FLASH_ROWS, "the Q tile is staged through both tiles");
};

/// One warp's tensor-core product d += a b (see emu/intrinsics.h for the fragments).
template <bool F16> __device__ __forceinline__ void flash_mma(float d[4], const u32 a[4], const u32 b[2]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap(); // the launcher plans these kernels on sm_80 and newer only
#endif
#else
    pt_emu_mma_m16n8k16<F16>(d, a, b);
#endif
}

/// Two f32s as a pair of 16-bit values (the first in the low half).
template <typename T> __device__ __forceinline__ u32 flash_pack(float lo, float hi) {
    return (u32)from_f32<T>(lo).bits | ((u32)from_f32<T>(hi).bits << 16);
}

/// The 16-bit value at (row, col) of a staged tile.
__device__ __forceinline__ u32 flash_half(const u32* s, int pitch, int row, int col) {
    return (s[row * pitch + (col >> 1)] >> ((col & 1) * 16)) & 0xffffu;
}

/// B fragment of M^T for a staged M (rows n0.. are B's columns, k0.. its rows): 32-bit reads.
__device__ __forceinline__ void flash_b_rows(u32 b[2], const u32* s, int pitch, int n0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, i = lane & 3;
    b[0] = s[(n0 + g) * pitch + (k0 >> 1) + i];
    b[1] = s[(n0 + g) * pitch + (k0 >> 1) + 4 + i];
}

/// `c = A M^T` for the A fragments `a` (16 rows, KT k steps) and a staged M (rows are M^T's
/// columns): NT tiles of 8 columns, each summed over k in order.
template <bool F16, int NT, int KT>
__device__ __forceinline__ void flash_product_t(float c[NT][4], const u32 a[KT][4], const u32* s, int pitch) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            u32 bf[2];
            flash_b_rows(bf, s, pitch, nt * 8, kt * 16);
            flash_mma<F16>(c[nt], a[kt], bf);
        }
    }
}

/// B fragment of a staged M itself (rows k0.. are B's rows, columns n0.. its columns).
__device__ __forceinline__ void flash_b_cols(u32 b[2], const u32* s, int pitch, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, i = lane & 3;
    b[0] = flash_half(s, pitch, k0 + 2 * i, n0 + g) | (flash_half(s, pitch, k0 + 2 * i + 1, n0 + g) << 16);
    b[1] = flash_half(s, pitch, k0 + 2 * i + 8, n0 + g) | (flash_half(s, pitch, k0 + 2 * i + 9, n0 + g) << 16);
}

/// A fragments of rows r0..r0+15 of a staged tile, all D / 16 k steps.
template <int D> __device__ __forceinline__ void flash_a_rows(u32 a[D / 16][4], const u32* s, int r0) {
    constexpr int P = FlashTile<D>::PITCH;
    const int lane = threadIdx.x & 31, g = lane >> 2, i = lane & 3;
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
        a[kt][0] = s[(r0 + g) * P + kt * 8 + i];
        a[kt][1] = s[(r0 + g + 8) * P + kt * 8 + i];
        a[kt][2] = s[(r0 + g) * P + kt * 8 + 4 + i];
        a[kt][3] = s[(r0 + g + 8) * P + kt * 8 + 4 + i];
    }
}

/// Stages rows r0..r0+count of head `head` (zeros past T) as 16-bit pairs.
template <typename T, int D>
__device__ __forceinline__ void flash_stage(u32* dst, const T* src, int b, int r0, int count, int head, int T_len,
                                            int stride) {
    constexpr int P = FlashTile<D>::PITCH, HALF = D / 2;
    for (int e = threadIdx.x; e < count * HALF; e += blockDim.x) {
        const int j = e / HALF, c = e - j * HALF, r = r0 + j;
        u32 v = 0;
        if (r < T_len) {
            const T* p = src + ((i64)b * T_len + r) * stride + (i64)head * D + 2 * c;
            v = (u32)p[0].bits | ((u32)p[1].bits << 16);
        }
        dst[j * P + c] = v;
    }
}

/// Whether query t sees key s.
__device__ __forceinline__ bool flash_visible(int t, int s, int T_len, int window) {
    return s <= t && t < T_len && (window <= 0 || s > t - window);
}

/// The scaled, soft-capped score of a raw dot product, and d(score)/d(dot) / scale.
__device__ __forceinline__ float flash_score(float dot, float scale, float cap, float* dcap) {
    const float x = dot * scale;
    if (cap > 0.0f) {
        const float th = tanhf(x / cap);
        *dcap = 1.0f - th * th;
        return cap * th;
    }
    *dcap = 1.0f;
    return x;
}

template <typename T, bool F16, int D>
__device__ void flash_forward(T* out, float* lse, const T* q, const T* k, const T* v, int T_len, int H, int KV,
                              int window, int q_stride, int kv_stride, float scale, float cap) {
    constexpr int BK = FlashTile<D>::ROWS, P = FlashTile<D>::PITCH, KT = D / 16, NT = BK / 8;
    __shared__ u32 smem[2 * BK * P];
    u32* sk = smem;
    u32* sv = smem + BK * P;
    if (blockDim.x != ATTN_FLASH_THREADS || H % KV != 0) __trap();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, i = lane & 3;
    const int q0 = blockIdx.x * ATTN_FLASH_ROWS, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int w0 = q0 + warp * 16; // the warp's first query
    const int t_row[2] = {w0 + g, w0 + g + 8};

    flash_stage<T, D>(smem, q, b, q0, ATTN_FLASH_ROWS, h, T_len, q_stride);
    __syncthreads();
    u32 qa[KT][4];
    flash_a_rows<D>(qa, smem, warp * 16);

    float o[D / 8][4], m[2] = {-pt_inf(), -pt_inf()}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    const int s_begin = attn_first_key(q0, window) / BK * BK;
    const int s_end = min(T_len, q0 + ATTN_FLASH_ROWS);
    for (int s0 = s_begin; s0 < s_end; s0 += BK) {
        __syncthreads();
        flash_stage<T, D>(sk, k, b, s0, BK, kvh, T_len, kv_stride);
        flash_stage<T, D>(sv, v, b, s0, BK, kvh, T_len, kv_stride);
        __syncthreads();
        // Warp-uniform: no row of this warp sees a key of this tile.
        if (w0 >= T_len || s0 > w0 + 15 || (window > 0 && s0 + BK - 1 <= w0 - window)) continue;
        float sc[NT][4];
        flash_product_t<F16, NT, KT>(sc, qa, sk, P);
        float mx[2] = {-pt_inf(), -pt_inf()};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, s = s0 + nt * 8 + 2 * i + (e & 1);
                float unused;
                const float x = flash_score(sc[nt][e], scale, cap, &unused);
                sc[nt][e] = flash_visible(t_row[r], s, T_len, window) ? x : -pt_inf();
                mx[r] = fmaxf(mx[r], sc[nt][e]);
            }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // The row's four lanes share their maxima.
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);
            base[r] = m_new == -pt_inf() ? 0.0f : m_new; // nothing seen yet: every p is 0
            const float corr = expf(m[r] - base[r]);
            m[r] = m_new;
            l[r] *= corr;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                o[dt][2 * r] *= corr;
                o[dt][2 * r + 1] *= corr;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sc[nt][e] = expf(sc[nt][e] - base[e >> 1]);
                l[e >> 1] += sc[nt][e];
            }
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const u32 pa[4] = {flash_pack<T>(sc[2 * kk][0], sc[2 * kk][1]), flash_pack<T>(sc[2 * kk][2], sc[2 * kk][3]),
                               flash_pack<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                               flash_pack<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                u32 bf[2];
                flash_b_cols(bf, sv, P, kk * 16, dt * 8);
                flash_mma<F16>(o[dt], pa, bf);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const int t = t_row[r];
        if (t >= T_len) continue;
        const float inv = 1.0f / sum;
        const i64 row = ((i64)b * T_len + t) * H * D + (i64)h * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            st(out, row + dt * 8 + 2 * i, o[dt][2 * r] * inv);
            st(out, row + dt * 8 + 2 * i + 1, o[dt][2 * r + 1] * inv);
        }
        if (i == 0) lse[((i64)b * H + h) * T_len + t] = m[r] + logf(sum);
    }
}

template <typename T, bool F16, int D>
__device__ void flash_backward_dq(T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                  const float* delta, int T_len, int H, int KV, int window, int q_stride,
                                  int kv_stride, float scale, float cap) {
    constexpr int BK = FlashTile<D>::ROWS, P = FlashTile<D>::PITCH, KT = D / 16, NT = BK / 8;
    __shared__ u32 smem[2 * BK * P];
    u32* sk = smem;
    u32* sv = smem + BK * P;
    if (blockDim.x != ATTN_FLASH_THREADS || H % KV != 0) __trap();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, i = lane & 3;
    const int q0 = blockIdx.x * ATTN_FLASH_ROWS, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int w0 = q0 + warp * 16;
    const int t_row[2] = {w0 + g, w0 + g + 8};

    u32 qa[KT][4], da[KT][4];
    flash_stage<T, D>(smem, q, b, q0, ATTN_FLASH_ROWS, h, T_len, q_stride);
    __syncthreads();
    flash_a_rows<D>(qa, smem, warp * 16);
    __syncthreads();
    flash_stage<T, D>(smem, dout, b, q0, ATTN_FLASH_ROWS, h, T_len, H * D);
    __syncthreads();
    flash_a_rows<D>(da, smem, warp * 16);
    float lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const i64 at = ((i64)b * H + h) * T_len + t_row[r];
        lr[r] = t_row[r] < T_len ? lse[at] : 0.0f;
        dr[r] = t_row[r] < T_len ? delta[at] : 0.0f;
    }
    float acc[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    const int s_begin = attn_first_key(q0, window) / BK * BK;
    const int s_end = min(T_len, q0 + ATTN_FLASH_ROWS);
    for (int s0 = s_begin; s0 < s_end; s0 += BK) {
        __syncthreads();
        flash_stage<T, D>(sk, k, b, s0, BK, kvh, T_len, kv_stride);
        flash_stage<T, D>(sv, v, b, s0, BK, kvh, T_len, kv_stride);
        __syncthreads();
        if (w0 >= T_len || s0 > w0 + 15 || (window > 0 && s0 + BK - 1 <= w0 - window)) continue;
        float sc[NT][4], dp[NT][4];
        flash_product_t<F16, NT, KT>(sc, qa, sk, P);
        flash_product_t<F16, NT, KT>(dp, da, sv, P);
        // dS = P (dP - delta) d(score)/d(dot), over sc.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, s = s0 + nt * 8 + 2 * i + (e & 1);
                float dcap;
                const float x = flash_score(sc[nt][e], scale, cap, &dcap);
                const float p = flash_visible(t_row[r], s, T_len, window) ? expf(x - lr[r]) : 0.0f;
                sc[nt][e] = p * (dp[nt][e] - dr[r]) * dcap * scale;
            }
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const u32 pa[4] = {flash_pack<T>(sc[2 * kk][0], sc[2 * kk][1]), flash_pack<T>(sc[2 * kk][2], sc[2 * kk][3]),
                               flash_pack<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                               flash_pack<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                u32 bf[2];
                flash_b_cols(bf, sk, P, kk * 16, dt * 8);
                flash_mma<F16>(acc[dt], pa, bf);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = t_row[r];
        if (t >= T_len) continue;
        const i64 row = ((i64)b * T_len + t) * q_stride + (i64)h * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            st(dq, row + dt * 8 + 2 * i, acc[dt][2 * r]);
            st(dq, row + dt * 8 + 2 * i + 1, acc[dt][2 * r + 1]);
        }
    }
}

template <typename T, bool F16, int D>
__device__ void flash_backward_dkv(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                   const float* delta, int T_len, int H, int KV, int window, int q_stride,
                                   int kv_stride, float scale, float cap) {
    constexpr int BQ = 32, P = FlashTile<D>::PITCH, KT = D / 16, NT = BQ / 8;
    // Q and dO tiles of BQ rows, and the 64 K (then V) rows staged through both.
    __shared__ u32 smem[2 * BQ * P];
    __shared__ float slse[BQ], sdelta[BQ];
    u32* sq = smem;
    u32* sdo = smem + BQ * P;
    if (blockDim.x != ATTN_FLASH_THREADS || H % KV != 0) __trap();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, i = lane & 3;
    const int s0 = blockIdx.x * ATTN_FLASH_ROWS, kvh = blockIdx.y, b = blockIdx.z, group = H / KV;
    const int w0 = s0 + warp * 16; // the warp's first key
    const int s_row[2] = {w0 + g, w0 + g + 8};

    u32 ka[KT][4], va[KT][4];
    flash_stage<T, D>(smem, k, b, s0, ATTN_FLASH_ROWS, kvh, T_len, kv_stride);
    __syncthreads();
    flash_a_rows<D>(ka, smem, warp * 16);
    __syncthreads();
    flash_stage<T, D>(smem, v, b, s0, ATTN_FLASH_ROWS, kvh, T_len, kv_stride);
    __syncthreads();
    flash_a_rows<D>(va, smem, warp * 16);
    float gk[D / 8][4], gv[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gk[dt][e] = gv[dt][e] = 0.0f;
    // Queries that see any of keys s0..s0+63: t >= s0, and t < s_last + W with a window.
    const int s_last = min(T_len, s0 + ATTN_FLASH_ROWS) - 1;
    const int t_end = window > 0 ? min(T_len, s_last + window) : T_len;
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int t0 = s0; t0 < t_end; t0 += BQ) {
            __syncthreads();
            flash_stage<T, D>(sq, q, b, t0, BQ, h, T_len, q_stride);
            flash_stage<T, D>(sdo, dout, b, t0, BQ, h, T_len, H * D);
            if (threadIdx.x < BQ) {
                const int t = t0 + threadIdx.x;
                const i64 at = ((i64)b * H + h) * T_len + t;
                slse[threadIdx.x] = t < T_len ? lse[at] : 0.0f;
                sdelta[threadIdx.x] = t < T_len ? delta[at] : 0.0f;
            }
            __syncthreads();
            // Warp-uniform: no key of this warp is seen by a query of this tile.
            if (w0 >= T_len || t0 + BQ - 1 < w0 || (window > 0 && t0 > w0 + 15 + window - 1)) continue;
            // S^T = K Q^T and dP^T = V dO^T: rows are keys, columns queries.
            float sc[NT][4], dp[NT][4];
            flash_product_t<F16, NT, KT>(sc, ka, sq, P);
            flash_product_t<F16, NT, KT>(dp, va, sdo, P);
            // P^T over sc, dS^T over dp.
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = nt * 8 + 2 * i + (e & 1), s = s_row[e >> 1];
                    float dcap;
                    const float x = flash_score(sc[nt][e], scale, cap, &dcap);
                    const float p = s < T_len && flash_visible(t0 + c, s, T_len, window) ? expf(x - slse[c]) : 0.0f;
                    sc[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - sdelta[c]) * dcap * scale;
                }
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk) {
                const u32 pa[4] = {flash_pack<T>(sc[2 * kk][0], sc[2 * kk][1]),
                                   flash_pack<T>(sc[2 * kk][2], sc[2 * kk][3]),
                                   flash_pack<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                   flash_pack<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
                const u32 sa[4] = {flash_pack<T>(dp[2 * kk][0], dp[2 * kk][1]),
                                   flash_pack<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                   flash_pack<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                   flash_pack<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    u32 bf[2];
                    flash_b_cols(bf, sdo, P, kk * 16, dt * 8);
                    flash_mma<F16>(gv[dt], pa, bf);
                    flash_b_cols(bf, sq, P, kk * 16, dt * 8);
                    flash_mma<F16>(gk[dt], sa, bf);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int s = s_row[r];
        if (s >= T_len) continue;
        const i64 row = ((i64)b * T_len + s) * kv_stride + (i64)kvh * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            st(dk, row + dt * 8 + 2 * i, gk[dt][2 * r]);
            st(dk, row + dt * 8 + 2 * i + 1, gk[dt][2 * r + 1]);
            st(dv, row + dt * 8 + 2 * i, gv[dt][2 * r]);
            st(dv, row + dt * 8 + 2 * i + 1, gv[dt][2 * r + 1]);
        }
    }
}

// Entry points, one per storage dtype and head dimension. Launch: block ATTN_FLASH_THREADS; grid
// (ceil(T / ATTN_FLASH_ROWS), H, B) for the forward and dq, (ceil(T / ATTN_FLASH_ROWS), KV, B) for dk/dv.
// The backward needs `delta` first (attention_backward_delta_*). dq overwrites dq (stride
// q_stride); dk/dv overwrite dk and dv (stride kv_stride).
extern "C" __global__ void flash_attention_forward_bf16_d64(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<bf16, false, 64>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_bf16_d64(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<bf16, false, 64>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_bf16_d64(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<bf16, false, 64>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_forward_bf16_d128(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<bf16, false, 128>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_bf16_d128(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<bf16, false, 128>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_bf16_d128(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<bf16, false, 128>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_forward_bf16_d256(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<bf16, false, 256>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_bf16_d256(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<bf16, false, 256>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_bf16_d256(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<bf16, false, 256>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_forward_f16_d64(f16* out, float* lse, const f16* q, const f16* k, const f16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<f16, true, 64>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_f16_d64(f16* dq, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<f16, true, 64>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_f16_d64(f16* dk, f16* dv, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<f16, true, 64>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_forward_f16_d128(f16* out, float* lse, const f16* q, const f16* k, const f16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<f16, true, 128>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_f16_d128(f16* dq, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<f16, true, 128>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_f16_d128(f16* dk, f16* dv, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<f16, true, 128>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_forward_f16_d256(f16* out, float* lse, const f16* q, const f16* k, const f16* v, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_forward<f16, true, 256>(out, lse, q, k, v, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dq_f16_d256(f16* dq, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dq<f16, true, 256>(dq, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
extern "C" __global__ void flash_attention_backward_dkv_f16_d256(f16* dk, f16* dv, const f16* dout, const f16* q, const f16* k, const f16* v, const float* lse, const float* delta, int T, int H, int KV, int window, int q_stride, int kv_stride, float scale, float cap) { flash_backward_dkv<f16, true, 256>(dk, dv, dout, q, k, v, lse, delta, T, H, KV, window, q_stride, kv_stride, scale, cap); }
