// Deterministic reductions shared by several ops: column sums over rows (bias gradients, and
// the finishing step of the norm weight gradients in norm.cu) and the gradient-norm partial
// sums of `clip_grad_norm_` (mirroring `grad_norm_sq` in runtime/src/kernels/adamw.rs).
//
// Column sums run in two launches so that every sum has one fixed order without atomics:
// `*_partial` gives each (32-column tile, chunk of `rows_per_chunk` rows) to one block, which
// writes one f32 partial per column to `partials` [n_chunks, cols]
// (n_chunks = ceil(rows / rows_per_chunk)); `column_sum_finish_*` then adds the chunks in order.
// The caller picks rows_per_chunk from the shape alone (so the bits depend on nothing else) and
// plans `partials` as the op's workspace.

#define COL_TILE 32
#define ROW_LANES 8

/// Adds the ROW_LANES per-thread sums of each column in order and writes partials[chunk, col].
/// Block (COL_TILE, ROW_LANES); `tile` is shared [ROW_LANES][COL_TILE + 1].
__device__ __forceinline__ void finish_tile(float* partials, float acc, float (*tile)[COL_TILE + 1], int cols) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * COL_TILE + tx;
    tile[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < cols) {
        float s = tile[0][tx];
        for (int k = 1; k < ROW_LANES; ++k) s += tile[k][tx];
        partials[(i64)blockIdx.y * cols + c] = s;
    }
}

template <typename T>
__device__ void column_sum_partial(float* partials, const T* x, int rows, int cols, int rows_per_chunk) {
    __shared__ float tile[ROW_LANES][COL_TILE + 1];
    const int c = blockIdx.x * COL_TILE + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    if (c < cols)
        for (int r = r0 + threadIdx.y; r < r1; r += ROW_LANES) acc += ld(x, (i64)r * cols + c);
    finish_tile(partials, acc, tile, cols);
}

/// partials[k, c] = sum over rows r of chunk k (in a fixed order) of x[r, c], for `x`
/// [rows, cols]. Launch: block (32, 8), grid (ceil(cols / 32), ceil(rows / rows_per_chunk)).
extern "C" __global__ void column_sum_partial_f32(float* partials, const float* x, int rows, int cols, int rows_per_chunk) { column_sum_partial(partials, x, rows, cols, rows_per_chunk); }
extern "C" __global__ void column_sum_partial_bf16(float* partials, const bf16* x, int rows, int cols, int rows_per_chunk) { column_sum_partial(partials, x, rows, cols, rows_per_chunk); }
extern "C" __global__ void column_sum_partial_f16(float* partials, const f16* x, int rows, int cols, int rows_per_chunk) { column_sum_partial(partials, x, rows, cols, rows_per_chunk); }

template <typename T>
__device__ void column_sum_finish(T* dst, const float* partials, int n_chunks, int cols, int accumulate) {
    GRID_STRIDE(c, cols) {
        float s = 0.0f;
        for (int k = 0; k < n_chunks; ++k) s += partials[(i64)k * cols + c];
        st(dst, c, accumulate ? ld(dst, c) + s : s);
    }
}

/// dst[c] (+)= sum over k in order of partials[k, c]: overwrites unless `accumulate`.
/// Grid-stride over cols.
extern "C" __global__ void column_sum_finish_f32(float* dst, const float* partials, int n_chunks, int cols, int accumulate) { column_sum_finish(dst, partials, n_chunks, cols, accumulate); }
extern "C" __global__ void column_sum_finish_bf16(bf16* dst, const float* partials, int n_chunks, int cols, int accumulate) { column_sum_finish(dst, partials, n_chunks, cols, accumulate); }
extern "C" __global__ void column_sum_finish_f16(f16* dst, const float* partials, int n_chunks, int cols, int accumulate) { column_sum_finish(dst, partials, n_chunks, cols, accumulate); }

template <typename T> __device__ void grad_norm_sq_partial(double* partials, const T* x, i64 n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)ld(x, i);
        acc += v * v; // exact in f64
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

/// partials[blockIdx.x] = this block's share of sum x^2, in f64. Launch: 1-D blocks of a
/// multiple of 32 threads; the grid size (from n alone) is the number of partials.
extern "C" __global__ void grad_norm_sq_partial_f32(double* partials, const float* x, i64 n) { grad_norm_sq_partial(partials, x, n); }
extern "C" __global__ void grad_norm_sq_partial_bf16(double* partials, const bf16* x, i64 n) { grad_norm_sq_partial(partials, x, n); }
extern "C" __global__ void grad_norm_sq_partial_f16(double* partials, const f16* x, i64 n) { grad_norm_sq_partial(partials, x, n); }

/// out[0] = f32(sum of the `count` partials), the squared L2 norm of one gradient tensor (the
/// GradNormSq op). Launch: exactly one block (a multiple of 32 threads, 256 intended).
extern "C" __global__ void grad_norm_sq_finish(float* out, const double* partials, int count) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int k = threadIdx.x; k < count; k += blockDim.x) acc += partials[k];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[0] = (float)acc;
}
