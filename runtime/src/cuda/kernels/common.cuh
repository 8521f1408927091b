// Shared prelude of protrain's CUDA kernels. `runtime/src/cuda/mod.rs` prepends it to every
// kernel source, so each source compiles on its own with NVRTC and no include path: nothing
// here (or in the sources) includes a header. bf16 and f16 are stored as raw bits and converted by
// hand (the same code runs in the CPU emulation, emu/cuda_emu.h).
//
// Conventions of every kernel:
// - compute in f32 (f64 for the loss and the gradient norm), storage f32, bf16 or f16 (`_f32` /
//   `_bf16` / `_f16` entry points); per-row statistics, logsumexps and partial sums are always f32;
// - element counts are 64-bit (`i64`); row and column counts are `int`;
// - reductions have one fixed order for a given launch shape (warp butterflies, fixed block
//   trees, rows in index order), so results are the same bits run after run. No atomic takes
//   part in a floating-point sum; the only atomics are integer min/max (order-independent);
// - outputs are overwritten unless an `accumulate` argument says otherwise.

typedef long long i64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

/// A bfloat16 value as its raw bits (the upper half of an IEEE f32).
struct __align__(2) bf16 {
    unsigned short bits;
};

/// An IEEE binary16 value as its raw bits (cuBLAS's `CUDA_R_16F`, the `half` crate's `f16`).
struct __align__(2) f16 {
    unsigned short bits;
};

__device__ __forceinline__ float pt_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }

/// Exact: every f16 is an f32 (subnormals are m * 2^-24, a normal f32).
__device__ __forceinline__ float to_f32(f16 x) {
    const u32 h = x.bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return __uint_as_float(sign | __float_as_uint((float)m * 5.9604644775390625e-8f));
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
/// Round to nearest even, as `__float2bfloat16_rn` and torch's `round_to_nearest_even`; a NaN
/// stays a (quiet) NaN of the same sign.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    u32 u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}

/// Round to nearest even, as `__float2half_rn` and the `half` crate: magnitudes from 65520 up
/// become infinity (65504 is the largest finite f16), subnormals round at 2^-24, a NaN stays a
/// quiet NaN of the same sign with its payload's top bits (as `half::f16::from_f32`).
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    const u32 u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    f16 r;
    if (a > 0x7f800000u) {
        r.bits = (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    } else if (a >= 0x477ff000u) {
        r.bits = (unsigned short)(sign | 0x7c00u);
    } else if (a >= 0x38800000u) {
        // Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
        // carry out of the mantissa correctly bumps the exponent.
        r.bits = (unsigned short)(sign | ((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13));
    } else {
        // Subnormal or zero: |x| * 2^24 is exact, `rintf` rounds it half to even (1024 is the
        // smallest normal's bits).
        r.bits = (unsigned short)(sign | (u32)rintf(__uint_as_float(a) * 16777216.0f));
    }
    return r;
}

template <typename T> __device__ __forceinline__ float ld(const T* p, i64 i) { return to_f32(p[i]); }
template <typename T> __device__ __forceinline__ void st(T* p, i64 i, float v) { p[i] = from_f32<T>(v); }

/// Butterfly sum over a full warp. Every lane ends with the same bits: at each step the two
/// partners add the same two values, and addition is commutative.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

/// Butterfly max over a full warp (NaN ignored, as `fmaxf`).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

/// Sum over the whole block (blockDim.x a multiple of 32, at most 1024; 1-D blocks), returned
/// to every thread. `scratch` is 32 shared slots; the leading barrier makes back-to-back calls
/// with the same scratch safe.
template <typename F> __device__ __forceinline__ F block_sum(F v, F* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : (F)0;
    return warp_sum(v);
}

/// Elements of the wider of `A` and `B` in 16 bytes: how many elements one vector access of an
/// elementwise kernel over operands of those types covers.
template <typename A, typename B = A> struct VecWidth {
    static constexpr int N = 16 / (sizeof(A) > sizeof(B) ? sizeof(A) : sizeof(B));
};

/// `N` consecutive elements of `T`, loaded or stored as one access (16 bytes for the widest
/// operand, so `ld.global.v4` / `st.global.v4`).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

/// Whether `p` is 16-byte aligned, which a vector access at element multiples of `N` needs.
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// The CPU emulation (emu/harness.cpp) defines PT_COUNT_VECTOR_ACCESSES and counts the wide
// accesses of `ldv` / `stv`, so its checks can tell which path a launch took; elsewhere (NVRTC,
// the simulator) the hook is empty.
#ifdef PT_COUNT_VECTOR_ACCESSES
#define PT_VECTOR_ACCESS(n) pt_vector_access(n)
#else
#define PT_VECTOR_ACCESS(n)
#endif

template <int N, typename T> __device__ __forceinline__ Vec<T, N> ldv(const T* p, i64 i) {
    PT_VECTOR_ACCESS(N);
    return *reinterpret_cast<const Vec<T, N>*>(p + i);
}
template <int N, typename T> __device__ __forceinline__ void stv(T* p, i64 i, const Vec<T, N>& v) {
    PT_VECTOR_ACCESS(N);
    *reinterpret_cast<Vec<T, N>*>(p + i) = v;
}

/// `n` (at most `N`) consecutive elements of `p` from `i`, as f32, into `v[0..n]`: one 16-byte
/// load when `vec` and the part is whole (`n == N`; `p + i` must then be 16-byte aligned),
/// else `n` scalar loads. The values are the same either way.
template <int N, typename T>
__device__ __forceinline__ void ld_part(float (&v)[N], const T* p, i64 i, int n, bool vec) {
    if (vec && n == N) {
        const Vec<T, N> a = ldv<N>(p, i);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = to_f32(a.v[k]);
    } else {
        for (int k = 0; k < n; ++k) v[k] = ld(p, i + k);
    }
}

/// Stores `v[0..n]` at `p + i` in `T`, as [`ld_part`] loads (one 16-byte store when `vec` and
/// `n == N`).
template <int N, typename T>
__device__ __forceinline__ void st_part(T* p, i64 i, const float (&v)[N], int n, bool vec) {
    if (vec && n == N) {
        Vec<T, N> o;
#pragma unroll
        for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(v[k]);
        stv<N>(p, i, o);
    } else {
        for (int k = 0; k < n; ++k) st(p, i + k, v[k]);
    }
}

/// The parts of a row of `cols` elements that this thread of a row kernel's block owns:
/// `f(c, n)` for the parts of `N` elements at c = N * (threadIdx.x + k * blockDim.x), k = 0, 1,
/// ..., the last part of the row shorter (n = cols - c) when N does not divide `cols`. Which
/// elements a thread sums, and in what order, depends only on `cols`, `N` and the block, not on
/// whether the parts are loaded as vectors, so a reduction over them has the same bits on the
/// vector path and on the scalar one.
template <int N, typename F> __device__ __forceinline__ void row_parts(int cols, F f) {
    for (i64 c = (i64)threadIdx.x * N; c < cols; c += (i64)blockDim.x * N) {
        const int at = (int)c;
        f(at, min(N, cols - at));
    }
}

/// Grid-stride over `0..n` in vectors of `N`: `vec(i)` for each whole vector (elements `i..i+N`)
/// when `aligned`, then `one(i)` for each element after the last whole vector (every element
/// when not aligned). Each element is computed by `vec` or `one` with the same arithmetic, so
/// which path runs changes no bit of the result; only the memory accesses are wider.
template <int N, typename V, typename S>
__device__ __forceinline__ void vec_stride(i64 n, bool aligned, V vec, S one) {
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)blockDim.x * gridDim.x;
    const i64 whole = aligned ? n / N : 0;
    for (i64 v = first; v < whole; v += stride) vec(v * N);
    for (i64 i = whole * N + first; i < n; i += stride) one(i);
}

/// out[i] = f(x[i]) over `n` elements, f on f32, 16-byte accesses where the pointers allow.
template <typename To, typename Ti, typename F>
__device__ __forceinline__ void map1(To* out, const Ti* x, i64 n, F f) {
    constexpr int N = VecWidth<To, Ti>::N;
    vec_stride<N>(
        n, aligned16(out) && aligned16(x),
        [&](i64 i) {
            const Vec<Ti, N> a = ldv<N>(x, i);
            Vec<To, N> o;
#pragma unroll
            for (int k = 0; k < N; ++k) o.v[k] = from_f32<To>(f(to_f32(a.v[k])));
            stv<N>(out, i, o);
        },
        [&](i64 i) { st(out, i, f(ld(x, i))); });
}

/// out[i] = f(a[i], b[i]) over `n` elements, as [`map1`].
template <typename T, typename F> __device__ __forceinline__ void map2(T* out, const T* a, const T* b, i64 n, F f) {
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        n, aligned16(out) && aligned16(a) && aligned16(b),
        [&](i64 i) {
            const Vec<T, N> x = ldv<N>(a, i), y = ldv<N>(b, i);
            Vec<T, N> o;
#pragma unroll
            for (int k = 0; k < N; ++k) o.v[k] = from_f32<T>(f(to_f32(x.v[k]), to_f32(y.v[k])));
            stv<N>(out, i, o);
        },
        [&](i64 i) { st(out, i, f(ld(a, i), ld(b, i))); });
}

/// f(a[i], b[i], c[i], o1, o2) then out1[i] = o1, out2[i] = o2 over `n` elements, as [`map1`]
/// (every input of a vector is read before its outputs are written).
template <typename T, typename F>
__device__ __forceinline__ void map3x2(T* out1, T* out2, const T* a, const T* b, const T* c, i64 n, F f) {
    constexpr int N = VecWidth<T>::N;
    vec_stride<N>(
        n, aligned16(out1) && aligned16(out2) && aligned16(a) && aligned16(b) && aligned16(c),
        [&](i64 i) {
            const Vec<T, N> x = ldv<N>(a, i), y = ldv<N>(b, i), z = ldv<N>(c, i);
            Vec<T, N> o1, o2;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                float r1, r2;
                f(to_f32(x.v[k]), to_f32(y.v[k]), to_f32(z.v[k]), r1, r2);
                o1.v[k] = from_f32<T>(r1);
                o2.v[k] = from_f32<T>(r2);
            }
            stv<N>(out1, i, o1);
            stv<N>(out2, i, o2);
        },
        [&](i64 i) {
            float r1, r2;
            f(ld(a, i), ld(b, i), ld(c, i), r1, r2);
            st(out1, i, r1);
            st(out2, i, r2);
        });
}

/// Grid-stride loop over `0..n` with a 64-bit index.
#define GRID_STRIDE(i, n)                                                                      \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);                     \
         i += (i64)blockDim.x * gridDim.x)
