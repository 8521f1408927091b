// The simulator's shared state: the CUDA types it hands out, its contexts, streams, events and
// memory registry, and the helpers the driver API (driver.cpp), cuBLAS (cublas.cpp) and the
// kernel runner (fiber.cpp) share. Everything here is internal: only the `extern "C"` entry
// points marked SIM_API are exported.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define SIM_API extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

namespace sim {

struct Ctx;
struct Stream;

/// Says what went wrong on stderr, prefixed so that a test log shows it came from the
/// simulator, and returns `code` (for `return fail(...)`).
CUresult fail(CUresult code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

/// One queued operation: runs on its stream's worker once every (stream, sequence) in `after`
/// has completed. `run` returns CUDA_SUCCESS or the sticky error the operation raises.
struct Op {
    std::function<CUresult()> run;
    std::vector<std::pair<Stream*, uint64_t>> after;
};

/// A stream: a worker thread running its queue in order. `completed` counts finished
/// operations, `enqueued` issued ones; the n-th operation has sequence number n.
struct Stream {
    Ctx* ctx = nullptr;
    bool legacy = false;
    bool nonblocking = false;
    uint64_t id = 0;
    std::deque<Op> queue;
    uint64_t enqueued = 0, completed = 0;
    bool stop = false;
    uint64_t chaos = 0; // xorshift state of chaos mode, 0 when off
    std::thread worker;
};

/// A context: its device, the legacy default stream, every stream created in it, and the
/// sticky error a failed asynchronous operation leaves (which every later call returns).
struct Ctx {
    CUdevice device = 0;
    unsigned flags = 0;
    int retains = 0;
    Stream* legacy = nullptr;
    std::set<Stream*> streams;
    CUresult sticky = CUDA_SUCCESS;
};

/// One event: the stream and sequence number of its last record (none before the first), and
/// the host clock's seconds when that record's marker ran (for cuEventElapsedTime; negative until
/// it has run), shared with the marker, which may run after the event is destroyed.
struct Event {
    Ctx* ctx = nullptr;
    Stream* stream = nullptr;
    uint64_t seq = 0;
    unsigned flags = 0;
    std::shared_ptr<std::atomic<double>> at;
};

/// What an address range lies in.
enum class Space { Device, Pinned, Pageable };

/// One allocation the simulator made (device or pinned), kept after it is freed (quarantined:
/// its pages are inaccessible and its addresses never reused) so a late use names it.
struct Alloc {
    uint64_t base = 0;
    size_t bytes = 0;
    Space space = Space::Device;
    bool live = true;
    Ctx* ctx = nullptr;
    void* map = nullptr; // the mapping with its guard pages
    size_t map_bytes = 0;
};

/// The one lock over every structure above; `g_cv` is notified whenever an operation
/// completes or is queued.
extern std::mutex& g_mu;
extern std::condition_variable& g_cv;

/// The simulated devices' compute capability as major * 10 + minor
/// (PROTRAIN_CUDA_SIM_COMPUTE_CAPABILITY=MAJOR.MINOR, default 8.0, read once), or -1 when the
/// variable is not of that form (cuInit then fails, naming it).
int compute_capability();
/// The context current on this thread (null when none is bound).
Ctx* current();
/// The current context, or the error a call that needs one returns: INVALID_CONTEXT when none
/// is bound, the context's sticky error after an asynchronous failure.
CUresult need_ctx(Ctx** out);
/// The stream a CUstream handle names in `ctx` (0 and CU_STREAM_LEGACY: the legacy default
/// stream); null when the handle is not a live stream of `ctx`.
Stream* resolve_stream(Ctx* ctx, void* handle);
/// Queues `op` on `s` with the legacy default stream's implicit ordering; returns its
/// sequence number. Takes g_mu.
uint64_t enqueue(Stream* s, Op op);
/// Blocks until `s` has completed operation `seq`. Takes g_mu.
void wait_for(Stream* s, uint64_t seq);

/// Where [p, p + n) lies: in one live allocation of the space returned (Device or Pinned), or
/// outside every allocation (Pageable). An error (with its message printed) when the range
/// starts in an allocation but runs past its end, or lies in a freed one. `what` names the
/// operand in errors.
CUresult locate(uint64_t p, size_t n, const char* what, Space* space);
/// Checks that [p, p + n) lies inside one live device allocation.
CUresult check_device(uint64_t p, size_t n, const char* what);

/// Counters per process, for tests that compare them with a schedule's plan.
struct Counters {
    uint64_t launches = 0, syncs = 0, htod_bytes = 0, dtoh_bytes = 0, gemms = 0, host_allocs = 0;
    /// cublasLtMatmul calls, and GEMMs issued with no workspace of the caller's (a cuBLAS
    /// handle without cublasSetWorkspace, a cublasLtMatmul without one): the real libraries
    /// then allocate their own or choose kernels that need none.
    uint64_t lt_matmuls = 0, unplanned_workspaces = 0;
};
extern Counters g_counters;

// The kernel runner (fiber.cpp).

/// One kernel compiled for the host: its parameter sizes and whether each is a pointer, and
/// the function that unpacks an argument buffer into a call.
struct Kernel {
    const char* name;
    std::vector<size_t> sizes;
    std::vector<bool> is_ptr;
    void* fn;
    void (*call)(void* fn, const char* args, const size_t* offsets);
};
/// The host build of the kernel named `name`, or null.
const Kernel* find_kernel(const std::string& name);
/// Runs a grid of `k` with packed arguments on this thread; CUDA_SUCCESS or the error that
/// ended it, with `error` saying why.
CUresult run_grid(const Kernel* k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                  unsigned bz, const char* args, const size_t* offsets, std::string& error);

} // namespace sim
