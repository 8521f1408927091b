// Minimal CPU emulation of the CUDA built-ins protrain's kernels use, for harness.cpp: one
// std::thread per CUDA thread, blocks one after another (so `__shared__` can be `static`),
// std::barrier for __syncthreads and per-warp exchanges for shuffles and ballots.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>
#include <memory>

struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* g_block_bar = nullptr;
inline std::barrier<>* g_warp_bar[32];
inline double g_slots[32][32];

#include "intrinsics.h"
#define __shared__ static
inline void __trap() { fprintf(stderr, "__trap\n"); abort(); }
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int flat_tid() { return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y; }
template <typename T> inline T exch(T v, int src_lane) {
    int t = flat_tid(), w = t >> 5, l = t & 31;
    memcpy(&g_slots[w][l], &v, sizeof(T));
    g_warp_bar[w]->arrive_and_wait();
    T r; memcpy(&r, &g_slots[w][src_lane], sizeof(T));
    g_warp_bar[w]->arrive_and_wait();
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) { return exch(v, (flat_tid() & 31) ^ o); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return exch(v, src); }
inline unsigned __ballot_sync(unsigned, bool p) {
    int t = flat_tid(), w = t >> 5, l = t & 31;
    g_slots[w][l] = p ? 1.0 : 0.0;
    g_warp_bar[w]->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i) if (g_slots[w][i] != 0.0) m |= 1u << i;
    g_warp_bar[w]->arrive_and_wait();
    return m;
}
inline int atomicMin(int* p, int v) { std::atomic_ref<int> a(*p); int o = a.load(); while (v < o && !a.compare_exchange_weak(o, v)) {} return o; }
inline int atomicMax(int* p, int v) { std::atomic_ref<int> a(*p); int o = a.load(); while (v > o && !a.compare_exchange_weak(o, v)) {} return o; }

template <typename F> void launch(dim3 grid, dim3 block, F&& body) {
    gridDim = grid; blockDim = block;
    int n = block.x * block.y * block.z;
    if (n % 32) { fprintf(stderr, "block not a multiple of 32\n"); abort(); }
    for (unsigned bz = 0; bz < grid.z; ++bz) for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bb(n);
        g_block_bar = &bb;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < n / 32; ++w) { wb.emplace_back(new std::barrier<>(32)); g_warp_bar[w] = wb.back().get(); }
        std::vector<std::thread> ts;
        for (int t = 0; t < n; ++t)
            ts.emplace_back([&, t] {
                threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                blockIdx = dim3(bx, by, bz);
                body();
            });
        for (auto& th : ts) th.join();
    }
}
