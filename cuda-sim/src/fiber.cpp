// The kernel runner: protrain's kernel sources compiled for the host (with the same
// KERNEL_DEFINES as NVRTC gets, passed by build.sh), each block's threads run as fibers on the
// calling worker thread. A fiber runs until it reaches a barrier or a warp exchange, then the
// next one runs; when no fiber can go on and some have not finished, the launch fails with a
// message naming the barrier, instead of hanging as a GPU would.
#include "device.h"
#include "sim.h"

#include <sys/mman.h>
#include <unistd.h>

#include <tuple>
#include <type_traits>
#include <utility>

// Saves the callee-saved registers and the stack pointer in *save, then resumes the fiber
// whose stack pointer is `next`. The SSE and x87 control words are not switched: no kernel
// changes the rounding mode, so every fiber runs with the worker thread's.
extern "C" void sim_switch(void** save, void* next);
asm(R"(
.text
.p2align 4
.type sim_switch,@function
sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size sim_switch, .-sim_switch
)");

namespace sim {

enum State { Ready, AtBlockBarrier, AtWarpExchange, Done };

struct Block;

struct Fiber {
    void* sp = nullptr;
    Block* block = nullptr;
    dim3 tid;
    int flat = 0;
    State state = Ready;
    uint64_t wait_gen = 0;
};

/// One warp's exchange: the lanes arrived so far, the mask they named, the generation (which
/// advances when every lane of the mask has arrived) and the published values, double
/// buffered by generation parity so a slow reader's values survive the next exchange.
struct Warp {
    unsigned arrived = 0;
    unsigned mask[2] = {0, 0};
    uint64_t gen = 0;
    uint64_t slots[2][32] = {};
    const char* what = "";
};

/// The block being run on this thread.
struct Block {
    const Kernel* k = nullptr;
    const char* args = nullptr;
    const size_t* offsets = nullptr;
    std::vector<Fiber> fibers;
    unsigned n = 0;
    unsigned block_arrived = 0;
    uint64_t block_gen = 0;
    Warp warps[32];
    void* sched_sp = nullptr;
    CUresult error = CUDA_SUCCESS;
    std::string message;
};

// Per worker thread. Not initial-exec TLS: the loader would then have to place the whole TLS
// block (with the kernels' `__shared__` arrays) in the small static TLS space, and dlopen fails.
thread_local Fiber* t_fiber = nullptr;
thread_local dim3 t_block_idx, t_block_dim, t_grid_dim;

/// Fiber stacks of this worker thread: 1024 (the most threads a block has) of STACK bytes,
/// each below a guard page, mapped on the thread's first launch and unmapped when it exits
/// (a destroyed stream's worker gives its stacks back).
static constexpr size_t STACK = 128 * 1024;
static constexpr int MAX_THREADS = 1024;

struct Stacks {
    char* base = nullptr;
    size_t bytes = 0;
    ~Stacks() {
        if (base) munmap(base, bytes);
    }
};
static thread_local Stacks t_stacks;

static char* stacks() {
    if (!t_stacks.base) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE), each = STACK + page;
        void* m = mmap(nullptr, each * MAX_THREADS, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return nullptr;
        for (int i = 0; i < MAX_THREADS; ++i) mprotect((char*)m + i * each, page, PROT_NONE);
        t_stacks.base = (char*)m;
        t_stacks.bytes = each * MAX_THREADS;
    }
    return t_stacks.base;
}

const dim3& thread_idx() { return t_fiber->tid; }
int lane() { return t_fiber->flat & 31; }

static bool runnable(const Block* b, const Fiber& f);

/// Leaves the calling fiber (which has set why it waits) for the next fiber that can run, in
/// thread order after it, or for the scheduler when none can (or the launch failed).
static void yield() {
    Fiber* me = t_fiber;
    Block* b = me->block;
    Fiber* next = nullptr;
    if (b->error == CUDA_SUCCESS)
        for (unsigned k = 1; k <= b->n; ++k) {
            Fiber& f = b->fibers[(me->flat + k) % b->n];
            if (runnable(b, f)) {
                next = &f;
                break;
            }
        }
    if (next) {
        next->state = Ready;
        t_fiber = next;
        sim_switch(&me->sp, next->sp);
    } else {
        sim_switch(&me->sp, b->sched_sp);
    }
}

void block_barrier() {
    Block* b = t_fiber->block;
    uint64_t g = b->block_gen;
    if (++b->block_arrived == b->n) {
        b->block_arrived = 0;
        b->block_gen++;
        return;
    }
    t_fiber->state = AtBlockBarrier;
    t_fiber->wait_gen = g;
    yield();
}

[[noreturn]] static void abort_launch(CUresult code, std::string message) {
    Block* b = t_fiber->block;
    if (b->error == CUDA_SUCCESS) {
        b->error = code;
        b->message = std::move(message);
    }
    t_fiber->state = Done;
    yield();
    __builtin_unreachable();
}

/// Publishes `bits` for lane l of the caller's warp and waits for the rest of `mask`; returns
/// the parity whose slots hold the exchange.
static int warp_arrive(unsigned mask, uint64_t bits, const char* what) {
    Block* b = t_fiber->block;
    int flat = t_fiber->flat, l = flat & 31;
    Warp& w = b->warps[flat >> 5];
    if (!((mask >> l) & 1))
        abort_launch(CUDA_ERROR_ILLEGAL_INSTRUCTION,
                     std::string(what) + " called by lane " + std::to_string(l) +
                         ", which its own mask leaves out");
    int p = (int)(w.gen & 1);
    if (w.arrived == 0) {
        w.mask[p] = mask;
        w.what = what;
    } else if (w.mask[p] != mask) {
        char m[160];
        snprintf(m, sizeof m, "lanes of warp %d call %s with mask %#x while others wait in %s with %#x",
                 flat >> 5, what, mask, w.what, w.mask[p]);
        abort_launch(CUDA_ERROR_ILLEGAL_INSTRUCTION, m);
    }
    w.slots[p][l] = bits;
    w.arrived |= 1u << l;
    uint64_t g = w.gen;
    if (w.arrived == mask) {
        w.arrived = 0;
        w.gen++;
    } else {
        t_fiber->state = AtWarpExchange;
        t_fiber->wait_gen = g;
        yield();
    }
    return p;
}

uint64_t warp_exchange(unsigned mask, uint64_t bits, int src, const char* what) {
    int p = warp_arrive(mask, bits, what);
    Warp& w = t_fiber->block->warps[t_fiber->flat >> 5];
    if (!((mask >> src) & 1))
        abort_launch(CUDA_ERROR_ILLEGAL_INSTRUCTION,
                     std::string(what) + " reads lane " + std::to_string(src) +
                         ", which is not in the mask (undefined on a GPU)");
    return w.slots[p][src];
}

unsigned warp_ballot(unsigned mask, bool pred) {
    int p = warp_arrive(mask, pred ? 1 : 0, "__ballot_sync");
    Warp& w = t_fiber->block->warps[t_fiber->flat >> 5];
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (((mask >> i) & 1) && w.slots[p][i]) r |= 1u << i;
    return r;
}

void trap() { abort_launch(CUDA_ERROR_ILLEGAL_INSTRUCTION, "the kernel executed __trap()"); }

void mma_arch_check() {
    const int cc = compute_capability();
    if (cc < 80) {
        char why[160];
        snprintf(why, sizeof why,
                 "the kernel executed __trap(): mma.sync m16n8k16 needs compute capability 8.0 and the "
                 "simulated device is %d.%d (PROTRAIN_CUDA_SIM_COMPUTE_CAPABILITY)",
                 cc / 10, cc % 10);
        abort_launch(CUDA_ERROR_ILLEGAL_INSTRUCTION, why);
    }
}

/// The first code of every fiber: runs the kernel for the fiber's thread, then returns to the
/// scheduler for good.
static void fiber_main() {
    Block* b = t_fiber->block;
    b->k->call(b->k->fn, b->args, b->offsets);
    t_fiber->state = Done;
    yield();
    __builtin_unreachable();
}

/// A fresh stack for `sim_switch` to resume into fiber_main: the callee-saved registers, then
/// fiber_main as the return address, with the stack aligned as at a function's entry.
static void* initial_frame(char* top) {
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                       // alignment slot: rsp % 16 == 8 at fiber_main's entry
    *--sp = (uint64_t)&fiber_main;   // return address of sim_switch's `ret`
    for (int i = 0; i < 6; ++i) *--sp = 0; // rbp rbx r12 r13 r14 r15
    return sp;
}

static bool runnable(const Block* b, const Fiber& f) {
    switch (f.state) {
    case Ready: return true;
    case AtBlockBarrier: return b->block_gen != f.wait_gen;
    case AtWarpExchange: return b->warps[f.flat >> 5].gen != f.wait_gen;
    default: return false;
    }
}

static std::string describe_stall(Block* b) {
    unsigned done = 0, at_bar = 0, at_warp = 0;
    int warp = -1;
    for (auto& f : b->fibers) {
        if (f.state == Done) done++;
        else if (f.state == AtBlockBarrier) at_bar++;
        else if (f.state == AtWarpExchange) { at_warp++; if (warp < 0) warp = f.flat >> 5; }
    }
    char m[320];
    if (at_bar)
        snprintf(m, sizeof m,
                 "__syncthreads reached by %u of the block's %u threads (%u exited, %u wait in a "
                 "warp exchange): a barrier that not every thread reaches hangs or corrupts a GPU",
                 at_bar, b->n, done, at_warp);
    else
        snprintf(m, sizeof m,
                 "%s in warp %d reached by only part of its mask (%u threads wait, %u exited): "
                 "undefined on a GPU",
                 b->warps[warp].what, warp, at_warp, done);
    return m;
}

CUresult run_grid(const Kernel* k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                  unsigned bz, const char* args, const size_t* offsets, std::string& error) {
    char* st = stacks();
    if (!st) {
        error = "cannot map fiber stacks";
        return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE), each = STACK + page;
    Block b;
    b.k = k;
    b.args = args;
    b.offsets = offsets;
    b.n = bx * by * bz;
    b.fibers.resize(b.n);
    t_block_dim = dim3(bx, by, bz);
    t_grid_dim = dim3(gx, gy, gz);
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                t_block_idx = dim3(x, y, z);
                b.block_arrived = 0;
                for (unsigned w = 0; w < (b.n + 31) / 32; ++w) b.warps[w] = Warp();
                for (unsigned i = 0; i < b.n; ++i) {
                    Fiber& f = b.fibers[i];
                    f = Fiber();
                    f.flat = (int)i;
                    f.block = &b;
                    f.tid = dim3(i % bx, (i / bx) % by, i / (bx * by));
                    f.sp = initial_frame(st + i * each + each);
                }
                // Fibers hand over to each other (yield); control comes back here only when
                // none can run: all finished, the launch failed, or the rest wait forever.
                b.fibers[0].state = Ready;
                t_fiber = &b.fibers[0];
                sim_switch(&b.sched_sp, b.fibers[0].sp);
                t_fiber = nullptr;
                if (b.error == CUDA_SUCCESS) {
                    unsigned done = 0;
                    for (auto& f : b.fibers) done += f.state == Done;
                    if (done < b.n) {
                        b.error = CUDA_ERROR_LAUNCH_FAILED;
                        b.message = describe_stall(&b);
                    }
                }
                if (b.error != CUDA_SUCCESS) {
                    char where[96];
                    snprintf(where, sizeof where, "block (%u,%u,%u): ", x, y, z);
                    error = where + b.message;
                    return b.error;
                }
            }
    return CUDA_SUCCESS;
}

// The kernels, compiled for the host.
#include "../../runtime/src/cuda/kernels/common.cuh"
#include "../../runtime/src/cuda/kernels/activation.cu"
#include "../../runtime/src/cuda/kernels/add.cu"
#include "../../runtime/src/cuda/kernels/cast.cu"
#include "../../runtime/src/cuda/kernels/embedding.cu"
#include "../../runtime/src/cuda/kernels/norm.cu"
#include "../../runtime/src/cuda/kernels/reduce.cu"
#include "../../runtime/src/cuda/kernels/rope.cu"
#include "../../runtime/src/cuda/kernels/attention.cu"
#include "../../runtime/src/cuda/kernels/cross_entropy.cu"
#include "../../runtime/src/cuda/kernels/adamw.cu"
#include "../../runtime/src/cuda/kernels/moe.cu"
#include "../tests/test_kernels.cuh"

template <typename T> static T load_arg(const char* p) {
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}

template <typename... A> struct Caller {
    template <size_t... I>
    static void call(void* fn, const char* args, const size_t* offsets, std::index_sequence<I...>) {
        ((void (*)(A...))fn)(load_arg<A>(args + offsets[I])...);
    }
    static void run(void* fn, const char* args, const size_t* offsets) {
        call(fn, args, offsets, std::index_sequence_for<A...>{});
    }
};

template <typename... A> static Kernel entry(const char* name, void (*fn)(A...)) {
    return Kernel{name, {sizeof(A)...}, {std::is_pointer_v<A>...}, (void*)fn, &Caller<A...>::run};
}

/// Every kernel, by name. Never destroyed: a stream worker may still run one while the
/// process exits.
static const std::vector<Kernel>& table() {
#define K(name) entry(#name, &name),
    static const std::vector<Kernel>& t = *new std::vector<Kernel>{
#include "kernels.inc"
    };
#undef K
    return t;
}

const Kernel* find_kernel(const std::string& name) {
    for (auto& k : table())
        if (name == k.name) return &k;
    return nullptr;
}

} // namespace sim
