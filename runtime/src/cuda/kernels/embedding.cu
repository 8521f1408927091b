// Token and learned position embeddings and their backwards, mirroring
// runtime/src/kernels/embedding.rs (and dispatch.rs's padding row), plus the token range check.
//
// Token ids are i32. The forward does not fail on a bad id (it writes a zero row): run
// `check_tokens` (or check on the host) first, as the host kernel checks before writing.
//
// The token-embedding backward is deterministic without floating-point atomics and sums every
// row in increasing position order, exactly as the host kernel does, so its bits equal the
// host's: `embedding_backward_span` finds each vocabulary row's first and last position
// (integer atomicMin/atomicMax, whose result does not depend on order), then
// `embedding_backward_*` gives each row to one block that walks those positions in order.

#define EMB_NONE 0x7fffffff

/// first_bad[0] = the first position n in 0..n_tokens whose token is outside 0..vocab, or
/// n_tokens when there is none. Launch: exactly one block of 1024 threads.
extern "C" __global__ void check_tokens(int* first_bad, const int* tokens, int n_tokens, int vocab) {
    __shared__ int s[1024];
    int best = n_tokens;
    for (int n = threadIdx.x; n < n_tokens; n += blockDim.x) {
        int t = tokens[n];
        if ((t < 0 || t >= vocab) && n < best) best = n;
    }
    s[threadIdx.x] = best;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) s[threadIdx.x] = min(s[threadIdx.x], s[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) first_bad[0] = s[0];
}

template <typename T>
__device__ void embedding_forward(T* out, const int* tokens, const T* table, int n_tokens, int vocab, int channels) {
    // A vector of N never straddles two rows when N divides the row width.
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        (i64)n_tokens * channels, channels % N == 0 && aligned16(out) && aligned16(table),
        [&](i64 i) {
            const i64 n = i / channels;
            const int c = (int)(i - n * channels), t = tokens[n];
            Vec<T, N> o;
            if (t >= 0 && t < vocab) {
                o = ldv<N>(table, (i64)t * channels + c);
            } else {
#pragma unroll
                for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(0.0f);
            }
            stv<N>(out, i, o);
        },
        [&](i64 i) {
            const i64 n = i / channels;
            const int c = (int)(i - n * channels), t = tokens[n];
            out[i] = (t >= 0 && t < vocab) ? table[(i64)t * channels + c] : from_f32<T>(0.0f);
        });
}

/// out[n, :] = table[tokens[n], :]; `tokens` [n_tokens], `table` [vocab, channels], `out`
/// [n_tokens, channels]. An out-of-range id gives a zero row. Grid-stride over n_tokens*channels.
extern "C" __global__ void embedding_forward_f32(float* out, const int* tokens, const float* table, int n_tokens, int vocab, int channels) { embedding_forward(out, tokens, table, n_tokens, vocab, channels); }
extern "C" __global__ void embedding_forward_bf16(bf16* out, const int* tokens, const bf16* table, int n_tokens, int vocab, int channels) { embedding_forward(out, tokens, table, n_tokens, vocab, channels); }
extern "C" __global__ void embedding_forward_f16(f16* out, const int* tokens, const f16* table, int n_tokens, int vocab, int channels) { embedding_forward(out, tokens, table, n_tokens, vocab, channels); }

/// Step 1 of the token-embedding backward: span[2v] = first and span[2v+1] = last position of
/// token v, or (EMB_NONE, -1) when v does not occur. `span` is [vocab, 2] i32 of workspace.
/// Launch: grid-stride over max(vocab, n_tokens), two passes separated by a launch: call with
/// `phase` 0 (initialise every row), then with `phase` 1 (record positions).
extern "C" __global__ void embedding_backward_span(int* span, const int* tokens, int n_tokens, int vocab, int phase) {
    if (phase == 0) {
        GRID_STRIDE(v, vocab) {
            span[2 * v] = EMB_NONE;
            span[2 * v + 1] = -1;
        }
    } else {
        GRID_STRIDE(n, n_tokens) {
            int t = tokens[n];
            if (t >= 0 && t < vocab) {
                atomicMin(&span[2 * t], (int)n);
                atomicMax(&span[2 * t + 1], (int)n);
            }
        }
    }
}

template <int W, typename T>
__device__ void embedding_backward_cols(T* dtable, const T* dout, const int* tokens, const int* span, int vocab,
                                        int channels, int accumulate, int padding_idx) {
    const int lane = threadIdx.x & 31;
    const int groups = channels / W;
    for (int v = blockIdx.x; v < vocab; v += gridDim.x) {
        const int first = span[2 * v], last = span[2 * v + 1];
        const i64 row = (i64)v * channels;
        // Column groups of W stride over the block's y index; every thread of a warp takes
        // part in each ballot, whether or not it has a group.
        for (int g0 = blockIdx.y * blockDim.x; g0 < groups; g0 += gridDim.y * blockDim.x) {
            const int g = g0 + threadIdx.x;
            const bool mine = g < groups;
            const i64 c = (i64)g * W;
            float acc[W];
            if (mine && accumulate) {
                const Vec<T, W> a = ldv<W>(dtable, row + c);
#pragma unroll
                for (int k = 0; k < W; ++k) acc[k] = to_f32(a.v[k]);
            } else {
#pragma unroll
                for (int k = 0; k < W; ++k) acc[k] = 0.0f;
            }
            // PyTorch's padding_idx: lookups of the pad row contribute no gradient.
            if (v != padding_idx && first <= last) {
                // Each warp walks the positions 32 at a time; a ballot finds the matches,
                // taken lowest first, so the sum runs in increasing position as on the host.
                for (int n0 = first; n0 <= last; n0 += 32) {
                    int n = n0 + lane;
                    unsigned hits = __ballot_sync(FULL_MASK, n <= last && tokens[n] == v);
                    while (hits) {
                        int j = __ffs(hits) - 1;
                        hits &= hits - 1;
                        if (mine) {
                            const Vec<T, W> d = ldv<W>(dout, (i64)(n0 + j) * channels + c);
#pragma unroll
                            for (int k = 0; k < W; ++k) acc[k] += to_f32(d.v[k]);
                        }
                    }
                }
            }
            if (mine) {
                Vec<T, W> o;
#pragma unroll
                for (int k = 0; k < W; ++k) o.v[k] = from_f32<T>(acc[k]);
                stv<W>(dtable, row + c, o);
            }
        }
    }
}

/// Columns in groups of 16 bytes (8 bf16 or f16, 4 f32), each loaded and stored as one vector
/// access, where the group divides the row and both pointers are 16-byte aligned; one column
/// per thread otherwise. Every element sums the same rows in the same order either way.
template <typename T>
__device__ void embedding_backward(T* dtable, const T* dout, const int* tokens, const int* span, int n_tokens,
                                   int vocab, int channels, int accumulate, int padding_idx) {
    constexpr int N = VecWidth<T>::N;
    if (channels % N == 0 && aligned16(dtable) && aligned16(dout))
        embedding_backward_cols<N>(dtable, dout, tokens, span, vocab, channels, accumulate, padding_idx);
    else
        embedding_backward_cols<1>(dtable, dout, tokens, span, vocab, channels, accumulate, padding_idx);
}

/// Step 2 of the token-embedding backward: dtable[v, :] (+)= sum over n with tokens[n] == v,
/// in increasing n, of dout[n, :]. Overwrites dtable (absent rows become zero) unless
/// `accumulate`; the `padding_idx` row (-1: none) gets no contribution (zero, or unchanged when
/// accumulating), as dispatch.rs clears it. `span` from `embedding_backward_span`.
/// Launch: 1-D blocks of a multiple of 32 threads (256 intended); grid.y any (column groups
/// stride over it; ceil(channels / (blockDim.x * 16 bytes of elements)) is ideal); grid.x any
/// (blocks stride over vocabulary rows; `vocab` is ideal).
extern "C" __global__ void embedding_backward_f32(float* dtable, const float* dout, const int* tokens, const int* span, int n_tokens, int vocab, int channels, int accumulate, int padding_idx) { embedding_backward(dtable, dout, tokens, span, n_tokens, vocab, channels, accumulate, padding_idx); }
extern "C" __global__ void embedding_backward_bf16(bf16* dtable, const bf16* dout, const int* tokens, const int* span, int n_tokens, int vocab, int channels, int accumulate, int padding_idx) { embedding_backward(dtable, dout, tokens, span, n_tokens, vocab, channels, accumulate, padding_idx); }
extern "C" __global__ void embedding_backward_f16(f16* dtable, const f16* dout, const int* tokens, const int* span, int n_tokens, int vocab, int channels, int accumulate, int padding_idx) { embedding_backward(dtable, dout, tokens, span, n_tokens, vocab, channels, accumulate, padding_idx); }

template <typename T>
__device__ void position_embedding_forward(T* out, const T* table, int batch, int seq, int channels, int offset) {
    const i64 per_batch = (i64)seq * channels;
    const T* rows = table + (i64)offset * channels;
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        batch * per_batch, channels % N == 0 && aligned16(out) && aligned16(rows),
        [&](i64 i) { stv<N>(out, i, ldv<N>(rows, i % per_batch)); }, // t * channels + c
        [&](i64 i) { out[i] = rows[i % per_batch]; });
}

template <typename T>
__device__ void position_embedding_backward(T* dtable, const T* dout, int batch, int seq, int channels, int offset,
                                            int positions, int accumulate) {
    // Each element sums its batch rows in order on both paths, so the path changes no bit.
    constexpr int N = VecWidth<T>::N;
    auto part = [&](i64 i, bool vec) {
        const i64 p = i / channels;
        const int c = (int)(i - p * channels);
        const int n = vec ? N : 1;
        float acc[N];
        if (accumulate)
            ld_part<N>(acc, dtable, i, n, vec);
        else
            for (int k = 0; k < n; ++k) acc[k] = 0.0f;
        if (p >= offset && p < offset + seq) {
            const i64 t = p - offset;
            for (int b = 0; b < batch; ++b) {
                float d[N];
                ld_part<N>(d, dout, ((i64)b * seq + t) * channels + c, n, vec);
                for (int k = 0; k < n; ++k) acc[k] += d[k];
            }
        }
        st_part<N>(dtable, i, acc, n, vec);
    };
    vec_stride<N>(
        (i64)positions * channels, channels % N == 0 && aligned16(dtable) && aligned16(dout),
        [&](i64 i) { part(i, true); }, [&](i64 i) { part(i, false); });
}

/// out[b, t, :] = table[offset + t, :] for `table` [P, channels] (offset + seq <= P), `out`
/// [batch, seq, channels]. Grid-stride over batch*seq*channels.
extern "C" __global__ void position_embedding_forward_f32(float* out, const float* table, int batch, int seq, int channels, int offset) { position_embedding_forward(out, table, batch, seq, channels, offset); }
extern "C" __global__ void position_embedding_forward_bf16(bf16* out, const bf16* table, int batch, int seq, int channels, int offset) { position_embedding_forward(out, table, batch, seq, channels, offset); }
extern "C" __global__ void position_embedding_forward_f16(f16* out, const f16* table, int batch, int seq, int channels, int offset) { position_embedding_forward(out, table, batch, seq, channels, offset); }
/// dtable[offset + t, :] (+)= sum over b in order of dout[b, t, :] for `dtable` [positions,
/// channels]; rows outside offset..offset+seq become zero unless `accumulate`. Grid-stride
/// over positions*channels.
extern "C" __global__ void position_embedding_backward_f32(float* dtable, const float* dout, int batch, int seq, int channels, int offset, int positions, int accumulate) { position_embedding_backward(dtable, dout, batch, seq, channels, offset, positions, accumulate); }
extern "C" __global__ void position_embedding_backward_bf16(bf16* dtable, const bf16* dout, int batch, int seq, int channels, int offset, int positions, int accumulate) { position_embedding_backward(dtable, dout, batch, seq, channels, offset, positions, accumulate); }
extern "C" __global__ void position_embedding_backward_f16(f16* dtable, const f16* dout, int batch, int seq, int channels, int offset, int positions, int accumulate) { position_embedding_backward(dtable, dout, batch, seq, channels, offset, positions, accumulate); }
