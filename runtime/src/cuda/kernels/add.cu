// Elementwise addition (residuals, token + position embeddings), mirroring
// runtime/src/kernels/add.rs, plus the broadcast bias add of a linear layer whose matmul runs
// in cuBLAS without a bias epilogue (its backward is `column_sum_*` in reduce.cu).
//
// Grid-stride loops: any grid, any 1-D block (256 intended), 16-byte vector accesses where the
// pointers are 16-byte aligned (common.cuh's `vec_stride`, scalar tail). In-place use is allowed.

template <typename T> __device__ void add_forward(T* out, const T* a, const T* b, i64 n) {
    map2(out, a, b, n, [](float x, float y) { return x + y; });
}

template <typename T> __device__ void add_backward(T* da, T* db, const T* dout, i64 n) {
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        n, aligned16(da) && aligned16(db) && aligned16(dout),
        [&](i64 i) {
            const Vec<T, N> d = ldv<N>(dout, i);
            stv<N>(da, i, d);
            stv<N>(db, i, d);
        },
        [&](i64 i) {
            T d = dout[i];
            da[i] = d;
            db[i] = d;
        });
}

template <typename T> __device__ void bias_add(T* out, const T* x, const T* bias, i64 rows, int cols) {
    // A vector of N never straddles two rows when N divides the row width.
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        rows * cols, cols % N == 0 && aligned16(out) && aligned16(x) && aligned16(bias),
        [&](i64 i) {
            const Vec<T, N> a = ldv<N>(x, i), b = ldv<N>(bias, i % cols);
            Vec<T, N> o;
#pragma unroll
            for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(to_f32(a.v[k]) + to_f32(b.v[k]));
            stv<N>(out, i, o);
        },
        [&](i64 i) { st(out, i, ld(x, i) + ld(bias, i % cols)); });
}

/// out = a + b, `n` elements.
extern "C" __global__ void add_forward_f32(float* out, const float* a, const float* b, i64 n) { add_forward(out, a, b, n); }
extern "C" __global__ void add_forward_bf16(bf16* out, const bf16* a, const bf16* b, i64 n) { add_forward(out, a, b, n); }
extern "C" __global__ void add_forward_f16(f16* out, const f16* a, const f16* b, i64 n) { add_forward(out, a, b, n); }
/// da = dout, db = dout.
extern "C" __global__ void add_backward_f32(float* da, float* db, const float* dout, i64 n) { add_backward(da, db, dout, n); }
extern "C" __global__ void add_backward_bf16(bf16* da, bf16* db, const bf16* dout, i64 n) { add_backward(da, db, dout, n); }
extern "C" __global__ void add_backward_f16(f16* da, f16* db, const f16* dout, i64 n) { add_backward(da, db, dout, n); }
/// out[r, c] = x[r, c] + bias[c] for `x`, `out` [rows, cols] and `bias` [cols].
extern "C" __global__ void bias_add_f32(float* out, const float* x, const float* bias, i64 rows, int cols) { bias_add(out, x, bias, rows, cols); }
extern "C" __global__ void bias_add_bf16(bf16* out, const bf16* x, const bf16* bias, i64 rows, int cols) { bias_add(out, x, bias, rows, cols); }
extern "C" __global__ void bias_add_f16(f16* out, const f16* x, const f16* bias, i64 rows, int cols) { bias_add(out, x, bias, rows, cols); }
