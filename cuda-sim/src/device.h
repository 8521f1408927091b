// CUDA device built-ins for the simulator's host build of protrain's kernels: each block's
// threads are fibers on the one worker thread of the stream that runs the kernel (fiber.cpp),
// so `__shared__` is a thread_local (one block at a time per worker), and `__syncthreads`,
// shuffles and ballots are barriers between fibers. A barrier or a warp exchange that not
// every participant reaches ends the launch with an error instead of hanging.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace sim {
/// One CUDA thread of the block being run.
struct Fiber;
/// The fiber running now on this worker thread (null outside a kernel).
extern thread_local Fiber* t_fiber;
extern thread_local dim3 t_block_idx, t_block_dim, t_grid_dim;
/// The fiber's thread index.
const dim3& thread_idx();
/// `__syncthreads`: waits until every thread of the block arrives.
void block_barrier();
/// A warp exchange: publishes `bits` (8 bytes) and returns lane `src`'s, once every lane of
/// `mask` has published. `what` names the built-in in errors.
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src, const char* what);
/// Publishes `p` and returns the warp's ballot over `mask`.
unsigned warp_ballot(unsigned mask, bool p);
/// The calling fiber's lane.
int lane();
/// `__trap`: ends the launch with CUDA_ERROR_ILLEGAL_INSTRUCTION.
[[noreturn]] void trap();
/// A tensor-core product (`mma.sync` m16n8k16): ends the launch as `__trap` does where the
/// simulated device is older than compute capability 8.0, as the kernels compiled for such a
/// GPU trap (attention.cu's `flash_mma`).
void mma_arch_check();
} // namespace sim
#define PT_EMU_MMA_CHECK() sim::mma_arch_check()

#define threadIdx (sim::thread_idx())
#define blockIdx (sim::t_block_idx)
#define blockDim (sim::t_block_dim)
#define gridDim (sim::t_grid_dim)

#include "../../runtime/src/cuda/emu/intrinsics.h"
#define __shared__ static thread_local
inline void __trap() { sim::trap(); }
inline void __syncthreads() { sim::block_barrier(); }

template <typename T> inline T sim_shfl(unsigned mask, T v, int src, const char* what) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = sim::warp_exchange(mask, bits, src & 31, what);
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int o) {
    return sim_shfl(mask, v, sim::lane() ^ o, "__shfl_xor_sync");
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src) {
    return sim_shfl(mask, v, src, "__shfl_sync");
}
inline unsigned __ballot_sync(unsigned mask, bool p) { return sim::warp_ballot(mask, p); }
inline int atomicMin(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int o = a.load();
    while (v < o && !a.compare_exchange_weak(o, v)) {}
    return o;
}
inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int o = a.load();
    while (v > o && !a.compare_exchange_weak(o, v)) {}
    return o;
}
