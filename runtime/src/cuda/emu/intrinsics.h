// The CUDA qualifiers and device intrinsics that a host build of protrain's kernels maps to
// plain C++ the same way wherever it runs them: the emulation harness (cuda_emu.h) and the
// CUDA simulator (cuda-sim/src/device.h). Each defines `__shared__`, `__trap` and the thread
// built-ins its own way.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __restrict__

inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __double2float_rn(double a) { return (float)a; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
using std::isfinite;
using std::max;
using std::min;
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

// ---------------------------------------------------------------------------------------------
// Tensor-core matrix products, emulated from the fragments the warp's lanes hold.
//
// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"): D (16 x 8, f32) += A (16 x 16) B (16 x 8). Lane
// `l` is in group g = l / 4 with index i = l % 4 in it, and holds
//   A: a[0] = A[g][2i, 2i+1], a[1] = A[g+8][2i, 2i+1], a[2] = A[g][2i+8, 2i+9],
//      a[3] = A[g+8][2i+8, 2i+9]                        (two 16-bit values, the first in the low half)
//   B: b[0] = B[2i, 2i+1][g], b[1] = B[2i+8, 2i+9][g]
//   C, D: d[0..1] = D[g][2i, 2i+1], d[2..3] = D[g+8][2i, 2i+1].
// The emulation gathers the rows of A and the columns of B each lane needs with warp shuffles
// (8 bytes each, 16 per product), so a kernel that puts a value in the wrong register of the
// wrong lane gets a wrong product here, as on the GPU. Products of 16-bit values are exact in
// f32; they are added to d in k order (the hardware's order is unspecified).

template <typename T> inline T __shfl_sync(unsigned mask, T v, int src);

/// A bf16's bits as f32 (exact).
inline float pt_emu_bf16_bits(unsigned b) { return __uint_as_float((b & 0xffffu) << 16); }

/// An IEEE binary16's bits as f32 (exact).
inline float pt_emu_f16_bits(unsigned h) {
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return __uint_as_float(sign | __float_as_uint((float)m * 5.9604644775390625e-8f));
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

/// d += a b for one warp's m16n8k16 fragments; `F16` picks f16 inputs over bf16. Every lane of
/// the (1-D) block's warp must call it, as `mma.sync`.
// A host build may define PT_EMU_MMA_CHECK() to refuse the product where the device it
// simulates has no `mma.sync` m16n8k16 (the CUDA simulator traps before compute capability
// 8.0, as the kernels built for such a GPU do).
#ifndef PT_EMU_MMA_CHECK
#define PT_EMU_MMA_CHECK()
#endif
template <bool F16> inline void pt_emu_mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2]) {
    PT_EMU_MMA_CHECK();
    const int lane = (int)(threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y) & 31;
    const int g = lane >> 2, i = lane & 3;
    auto cvt = [](unsigned bits) { return F16 ? pt_emu_f16_bits(bits & 0xffffu) : pt_emu_bf16_bits(bits); };
    const unsigned long long a01 = a[0] | (unsigned long long)a[1] << 32;
    const unsigned long long a23 = a[2] | (unsigned long long)a[3] << 32;
    const unsigned long long b01 = b[0] | (unsigned long long)b[1] << 32;
    float arow[2][16], bcol[2][16];
    for (int t = 0; t < 4; ++t) {
        // Lane (g, t) holds row g and g + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9.
        const unsigned long long x = __shfl_sync(0xffffffffu, a01, 4 * g + t);
        const unsigned long long y = __shfl_sync(0xffffffffu, a23, 4 * g + t);
        const unsigned r[4] = {(unsigned)x, (unsigned)(x >> 32), (unsigned)y, (unsigned)(y >> 32)};
        for (int half = 0; half < 2; ++half) {
            arow[0][2 * t + half] = cvt(r[0] >> (16 * half));
            arow[1][2 * t + half] = cvt(r[1] >> (16 * half));
            arow[0][2 * t + 8 + half] = cvt(r[2] >> (16 * half));
            arow[1][2 * t + 8 + half] = cvt(r[3] >> (16 * half));
        }
    }
    for (int j = 0; j < 2; ++j)
        for (int t = 0; t < 4; ++t) {
            // Lane (n, t) holds column n at rows 2t, 2t + 1, 2t + 8, 2t + 9.
            const unsigned long long x = __shfl_sync(0xffffffffu, b01, 4 * (2 * i + j) + t);
            const unsigned lo = (unsigned)x, hi = (unsigned)(x >> 32);
            bcol[j][2 * t] = cvt(lo);
            bcol[j][2 * t + 1] = cvt(lo >> 16);
            bcol[j][2 * t + 8] = cvt(hi);
            bcol[j][2 * t + 9] = cvt(hi >> 16);
        }
    for (int r = 0; r < 2; ++r)
        for (int j = 0; j < 2; ++j) {
            float acc = d[2 * r + j];
            for (int k = 0; k < 16; ++k) acc += arow[r][k] * bcol[j][k];
            d[2 * r + j] = acc;
        }
}
