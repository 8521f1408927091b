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
using std::isfinite;
using std::max;
using std::min;
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
