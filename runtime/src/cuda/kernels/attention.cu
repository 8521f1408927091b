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
// The plan runs attention on tensor cores with the GEMM path at the end of this file; these
// fused scalar kernels are kept as the reference the CPU emulation checks both against.
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
// Attention on tensor cores (what the launcher plans; runtime/src/cuda/launch.rs). The matrix
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
