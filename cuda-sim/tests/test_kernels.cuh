// Kernels that only the simulator's own tests launch (cuda-sim/tests/strict.cpp), compiled
// into the simulator beside protrain's: each breaks one rule a GPU leaves undefined, or does
// simple arithmetic whose result shows whether streams were ordered.

/// Only the first half of the block reaches the barrier.
extern "C" __global__ void simtest_partial_barrier(int* out) {
    if (threadIdx.x < blockDim.x / 2) __syncthreads();
    out[threadIdx.x] = 1;
}

/// Only lanes 0..19 of the warp reach a full-mask shuffle.
extern "C" __global__ void simtest_partial_shuffle(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 20) v = __shfl_xor_sync(FULL_MASK, v, 1);
    out[threadIdx.x] = v;
}

/// out[i] = value for i < n.
extern "C" __global__ void simtest_fill(float* out, float value, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = value;
}

/// out[i] = in[i] + 1 for i < n.
extern "C" __global__ void simtest_add_one(float* out, const float* in, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = in[i] + 1.0f;
}

/// out[blockIdx.x] = the sum of in[blockIdx.x * blockDim.x ..][..blockDim.x], by warp
/// butterflies and a shared-memory tree: exercises shuffles and barriers together.
extern "C" __global__ void simtest_block_sum(float* out, const float* in) {
    __shared__ float partial[32];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
        out[blockIdx.x] = s;
    }
}
