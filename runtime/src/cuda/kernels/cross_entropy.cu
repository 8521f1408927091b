// Mean cross-entropy over all positions (`F.cross_entropy(logits, targets)`, no ignore index),
// mirroring runtime/src/kernels/cross_entropy.rs, and its fused backward from the saved
// logsumexp. Targets are i32 and must have passed embedding.cu's `check_tokens`.
//
// The forward is two launches: `cross_entropy_forward_*` writes each row's logsumexp and
// loss term (f32), `cross_entropy_loss` adds the terms in f64 with a fixed tree.

/// Merges two (max, sum of exp(x - max)) pairs. Products and sums are written with explicit
/// rounding so no multiply-add is contracted: both butterfly partners get the same bits.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    const float a = (m == -pt_inf()) ? 0.0f : __fmul_rn(s, expf(m - mx));
    const float b = (m2 == -pt_inf()) ? 0.0f : __fmul_rn(s2, expf(m2 - mx));
    m = mx;
    s = __fadd_rn(a, b);
}

template <typename T>
__device__ void cross_entropy_forward(float* lse, float* row_loss, const T* logits, const int* targets, int rows,
                                      int vocab, int pitch) {
    __shared__ float sm[32], ss[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = (i64)r * pitch;
        float m = -pt_inf(), s = 0.0f;
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float x = ld(logits, base + c);
            if (x > m) {
                s = s * expf(m - x) + 1.0f;
                m = x;
            } else if (x != -pt_inf()) {
                s += expf(x - m);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
            lse_merge(m, s, m2, s2);
        }
        __syncthreads();
        if (lane == 0) {
            sm[warp] = m;
            ss[warp] = s;
        }
        __syncthreads();
        m = lane < warps ? sm[lane] : -pt_inf();
        s = lane < warps ? ss[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
            lse_merge(m, s, m2, s2);
        }
        if (threadIdx.x == 0) {
            const float l = m + logf(s);
            lse[r] = l;
            row_loss[r] = l - ld(logits, base + targets[r]);
        }
    }
}

/// lse[r] = logsumexp(logits[r, :]) and row_loss[r] = lse[r] - logits[r, targets[r]] for
/// `logits` [rows, vocab] in rows `pitch >= vocab` elements apart (the padding is not read). Launch: 1-D blocks of a multiple of 32 threads (256 intended), grid
/// any (blocks stride over rows).
extern "C" __global__ void cross_entropy_forward_f32(float* lse, float* row_loss, const float* logits, const int* targets, int rows, int vocab, int pitch) { cross_entropy_forward(lse, row_loss, logits, targets, rows, vocab, pitch); }
extern "C" __global__ void cross_entropy_forward_bf16(float* lse, float* row_loss, const bf16* logits, const int* targets, int rows, int vocab, int pitch) { cross_entropy_forward(lse, row_loss, logits, targets, rows, vocab, pitch); }
extern "C" __global__ void cross_entropy_forward_f16(float* lse, float* row_loss, const f16* logits, const int* targets, int rows, int vocab, int pitch) { cross_entropy_forward(lse, row_loss, logits, targets, rows, vocab, pitch); }

/// loss[0] = f32(sum of row_loss in f64 / rows). Launch: exactly one block (a multiple of 32
/// threads, 1024 intended).
extern "C" __global__ void cross_entropy_loss(float* loss, const float* row_loss, int rows) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += (double)row_loss[r];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) loss[0] = (float)(acc / (double)(rows > 0 ? rows : 1));
}

template <typename T>
__device__ void cross_entropy_backward(T* dlogits, const T* logits, const float* lse, const int* targets, int rows,
                                       int vocab, int pitch, float dloss) {
    const float g = dloss / (float)(rows > 0 ? rows : 1);
    GRID_STRIDE(i, (i64)rows * vocab) {
        const i64 r = i / vocab;
        const int c = (int)(i - r * vocab);
        const i64 at = r * pitch + c;
        const float p = expf(ld(logits, at) - lse[r]);
        st(dlogits, at, c == targets[r] ? (p - 1.0f) * g : p * g);
    }
}

/// dlogits[r] = (softmax(logits[r]) - onehot(targets[r])) * dloss / rows, from the saved lse;
/// overwrites dlogits [rows, vocab]; both in rows `pitch >= vocab` elements apart (the padding
/// is neither read nor written). Grid-stride over rows * vocab.
extern "C" __global__ void cross_entropy_backward_f32(float* dlogits, const float* logits, const float* lse, const int* targets, int rows, int vocab, int pitch, float dloss) { cross_entropy_backward(dlogits, logits, lse, targets, rows, vocab, pitch, dloss); }
extern "C" __global__ void cross_entropy_backward_bf16(bf16* dlogits, const bf16* logits, const float* lse, const int* targets, int rows, int vocab, int pitch, float dloss) { cross_entropy_backward(dlogits, logits, lse, targets, rows, vocab, pitch, dloss); }
extern "C" __global__ void cross_entropy_backward_f16(f16* dlogits, const f16* logits, const float* lse, const int* targets, int rows, int vocab, int pitch, float dloss) { cross_entropy_backward(dlogits, logits, lse, targets, rows, vocab, pitch, dloss); }
