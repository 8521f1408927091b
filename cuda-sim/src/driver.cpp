// The CUDA driver API as protrain's backend (through cudarc) calls it: device queries,
// primary contexts current per thread, strict device and pinned memory, streams (one worker
// thread each, the legacy default stream's implicit ordering), events, modules whose
// functions are the kernels compiled for the host, and launches.
#include "sim.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace sim {

// Never destroyed: stream workers may still wait on them while the process exits.
std::mutex& g_mu = *new std::mutex;
std::condition_variable& g_cv = *new std::condition_variable;
Counters g_counters;

static bool g_init = false;
static std::vector<Ctx*>& g_primary = *new std::vector<Ctx*>; // per device, made on first retain
static std::set<Event*>& g_events = *new std::set<Event*>;
// Every stream not yet destroyed, with its id: a wait that captured a stream outside the lock
// (a context synchronise, an event's record) stops waiting once the stream is gone rather than
// read a freed one, whose memory another context's new stream may be reusing.
static std::map<Stream*, uint64_t>& g_live = *new std::map<Stream*, uint64_t>;
static std::map<uint64_t, Alloc>& g_allocs = *new std::map<uint64_t, Alloc>; // by base address
static size_t g_device_used = 0;
static uint64_t g_next_stream = 1;
static thread_local Ctx* t_ctx = nullptr;

CUresult fail(CUresult code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-sim: %s\n", buf);
    return code;
}

static size_t env_size(const char* name, size_t dflt) {
    const char* v = getenv(name);
    if (!v || !*v) return dflt;
    return (size_t)strtoull(v, nullptr, 10);
}

/// Devices the driver reports (PROTRAIN_CUDA_SIM_DEVICES, default 8, as on an 8-GPU node), so
/// that the workers of `--gpus N` each find their LOCAL_RANK; each process simulates its own.
static int device_count() { return (int)std::max<size_t>(1, env_size("PROTRAIN_CUDA_SIM_DEVICES", 8)); }
/// Device memory of each simulated device (PROTRAIN_CUDA_SIM_MEMORY_MIB, default 4 GiB).
static size_t device_bytes() { return env_size("PROTRAIN_CUDA_SIM_MEMORY_MIB", 4096) << 20; }
/// Chaos mode's seed (PROTRAIN_CUDA_SIM_CHAOS), 0 when off.
static uint64_t chaos_seed() { return env_size("PROTRAIN_CUDA_SIM_CHAOS", 0); }
/// The longest delay chaos mode puts before an operation, in microseconds.
static uint64_t chaos_max_us() { return env_size("PROTRAIN_CUDA_SIM_CHAOS_MAX_US", 2000); }

int compute_capability() {
    static const int cc = [] {
        const char* v = getenv("PROTRAIN_CUDA_SIM_COMPUTE_CAPABILITY");
        if (!v || !*v) return 80;
        int major = 0, minor = 0, used = 0;
        if (sscanf(v, "%d.%d%n", &major, &minor, &used) != 2 || v[used] != '\0' || major < 1 || major > 99 ||
            minor < 0 || minor > 9)
            return -1;
        return major * 10 + minor;
    }();
    return cc;
}

Ctx* current() { return t_ctx; }

CUresult need_ctx(Ctx** out) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    Ctx* c = t_ctx;
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    std::lock_guard<std::mutex> l(g_mu);
    if (c->sticky != CUDA_SUCCESS) return c->sticky;
    *out = c;
    return CUDA_SUCCESS;
}

Stream* resolve_stream(Ctx* ctx, void* handle) {
    if (handle == nullptr || handle == (void*)0x1) return ctx->legacy;
    std::lock_guard<std::mutex> l(g_mu);
    Stream* s = (Stream*)handle;
    return ctx->streams.count(s) ? s : nullptr;
}

static uint64_t xorshift(uint64_t& s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

/// A stream's worker: runs each queued operation once its prerequisites completed (after a
/// random delay in chaos mode); an operation that fails leaves the context's sticky error,
/// and every later operation of the context is skipped, as on a GPU after a fault.
static void worker(Stream* s) {
    std::unique_lock<std::mutex> l(g_mu);
    for (;;) {
        g_cv.wait(l, [&] {
            if (s->stop && s->queue.empty()) return true;
            if (s->queue.empty()) return false;
            for (auto& [p, seq] : s->queue.front().after)
                if (p->completed < seq) return false;
            return true;
        });
        if (s->queue.empty()) return;
        Op op = std::move(s->queue.front());
        bool skip = s->ctx->sticky != CUDA_SUCCESS;
        l.unlock();
        if (s->chaos && xorshift(s->chaos) % 2 == 0)
            std::this_thread::sleep_for(std::chrono::microseconds(xorshift(s->chaos) % (chaos_max_us() + 1)));
        CUresult r = skip ? CUDA_SUCCESS : op.run();
        l.lock();
        if (r != CUDA_SUCCESS && s->ctx->sticky == CUDA_SUCCESS) s->ctx->sticky = r;
        s->queue.pop_front();
        s->completed++;
        g_cv.notify_all();
    }
}

static Stream* new_stream(Ctx* ctx, bool legacy, bool nonblocking) {
    Stream* s = new Stream;
    s->ctx = ctx;
    s->legacy = legacy;
    s->nonblocking = nonblocking;
    {
        std::lock_guard<std::mutex> l(g_mu);
        s->id = g_next_stream++;
        if (uint64_t seed = chaos_seed()) s->chaos = ((seed * 0x9E3779B97F4A7C15ull) ^ (s->id * 0xD1B54A32D192ED03ull)) | 1;
        if (!legacy) ctx->streams.insert(s);
        g_live[s] = s->id;
    }
    s->worker = std::thread(worker, s);
    return s;
}

static void stop_stream(Stream* s) {
    {
        std::lock_guard<std::mutex> l(g_mu);
        s->stop = true;
        g_cv.notify_all();
    }
    s->worker.join();
    {
        // Every operation of `s` completed (its worker drained the queue), so what waits on it
        // is satisfied: drop those prerequisites and the events' records on it before the
        // memory goes, as a GPU treats a destroyed stream's finished work.
        std::lock_guard<std::mutex> l(g_mu);
        g_live.erase(s);
        for (auto& [other, id] : g_live)
            for (Op& op : other->queue)
                std::erase_if(op.after, [&](const std::pair<Stream*, uint64_t>& a) { return a.first == s; });
        for (Event* e : g_events)
            if (e->stream == s) e->stream = nullptr;
        g_cv.notify_all();
    }
    delete s;
}

uint64_t enqueue(Stream* s, Op op) {
    std::lock_guard<std::mutex> l(g_mu);
    Ctx* c = s->ctx;
    if (s->legacy) {
        // The legacy default stream waits for all work issued before on blocking streams.
        for (Stream* o : c->streams)
            if (!o->nonblocking && o->enqueued > o->completed) op.after.push_back({o, o->enqueued});
    } else if (!s->nonblocking && c->legacy->enqueued > c->legacy->completed) {
        // A blocking stream waits for the legacy default stream's earlier work.
        op.after.push_back({c->legacy, c->legacy->enqueued});
    }
    s->queue.push_back(std::move(op));
    uint64_t seq = ++s->enqueued;
    g_cv.notify_all();
    return seq;
}

void wait_for(Stream* s, uint64_t seq) {
    std::unique_lock<std::mutex> l(g_mu);
    g_counters.syncs++;
    g_cv.wait(l, [&] { return s->completed >= seq; });
}

/// Waits until stream `s` (with id `id`, both read under the lock) has completed `seq`
/// operations or has been destroyed meanwhile (its work then completed).
static void wait_live(Stream* s, uint64_t id, uint64_t seq) {
    std::unique_lock<std::mutex> l(g_mu);
    g_counters.syncs++;
    g_cv.wait(l, [&] {
        auto it = g_live.find(s);
        return it == g_live.end() || it->second != id || s->completed >= seq;
    });
}

static void sync_ctx(Ctx* c) {
    struct Pending { Stream* s; uint64_t id, seq; };
    std::vector<Pending> all;
    {
        std::lock_guard<std::mutex> l(g_mu);
        all.push_back({c->legacy, c->legacy->id, c->legacy->enqueued});
        for (Stream* s : c->streams) all.push_back({s, s->id, s->enqueued});
    }
    // The primary context is shared by every thread, so another thread may destroy one of
    // these streams while this one waits.
    for (auto [s, id, seq] : all) wait_live(s, id, seq);
}

static CUresult sticky_of(Ctx* c) {
    std::lock_guard<std::mutex> l(g_mu);
    return c->sticky;
}

/// The allocation holding address p (live or quarantined), or null. Caller holds g_mu.
static Alloc* find_alloc(uint64_t p) {
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    Alloc& a = it->second;
    // An address just past the end belongs to no allocation (it may start the next one).
    return p < a.base + std::max<size_t>(a.bytes, 1) ? &a : nullptr;
}

static const char* space_name(Space s) {
    return s == Space::Device ? "device" : s == Space::Pinned ? "pinned host" : "pageable host";
}

CUresult locate(uint64_t p, size_t n, const char* what, Space* space) {
    std::lock_guard<std::mutex> l(g_mu);
    Alloc* a = find_alloc(p);
    if (!a) {
        *space = Space::Pageable;
        return CUDA_SUCCESS;
    }
    if (!a->live)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx lies in a freed %s allocation of %zu bytes at %#llx",
                    what, (unsigned long long)p, space_name(a->space), a->bytes, (unsigned long long)a->base);
    if (p + n > a->base + a->bytes)
        return fail(CUDA_ERROR_INVALID_VALUE,
                    "%s: %zu bytes at %#llx run %llu bytes past the end of the %s allocation of %zu "
                    "bytes at %#llx",
                    what, n, (unsigned long long)p, (unsigned long long)(p + n - a->base - a->bytes),
                    space_name(a->space), a->bytes, (unsigned long long)a->base);
    *space = a->space;
    return CUDA_SUCCESS;
}

CUresult check_device(uint64_t p, size_t n, const char* what) {
    Space sp;
    if (CUresult r = locate(p, n, what, &sp)) return r;
    if (sp != Space::Device)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx is not device memory (it is %s memory)", what,
                    (unsigned long long)p, space_name(sp));
    return CUDA_SUCCESS;
}

/// Maps `bytes` rounded up to pages between two inaccessible guard pages, filled with
/// `fill`; the allocation starts right after the leading guard (page aligned, so 256-byte
/// aligned as cuMemAlloc's are).
static CUresult map_guarded(size_t bytes, Space space, Ctx* ctx, int fill, uint64_t* out) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t body = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    size_t total = body + 2 * page;
    void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    mprotect(m, page, PROT_NONE);
    mprotect((char*)m + page + body, page, PROT_NONE);
    char* base = (char*)m + page;
    memset(base, fill, body);
    Alloc a;
    a.base = (uint64_t)base;
    a.bytes = bytes;
    a.space = space;
    a.ctx = ctx;
    a.map = m;
    a.map_bytes = total;
    std::lock_guard<std::mutex> l(g_mu);
    g_allocs[a.base] = a;
    *out = a.base;
    return CUDA_SUCCESS;
}

/// Frees the allocation at exactly `p` of `space`: its pages become inaccessible and stay
/// reserved (quarantined), so a later use faults or is reported rather than reading reused memory.
static CUresult unmap_guarded(uint64_t p, Space space, const char* what) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_allocs.find(p);
    if (it == g_allocs.end() || it->second.space != space)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s of %#llx, which is not the start of a %s allocation", what,
                    (unsigned long long)p, space_name(space));
    Alloc& a = it->second;
    if (!a.live)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s of %#llx, which was already freed", what, (unsigned long long)p);
    a.live = false;
    madvise(a.map, a.map_bytes, MADV_DONTNEED);
    mprotect(a.map, a.map_bytes, PROT_NONE);
    if (space == Space::Device) g_device_used -= a.bytes;
    return CUDA_SUCCESS;
}

} // namespace sim

using namespace sim;

typedef Ctx* CUcontext;
typedef Stream* CUstream;
typedef Event* CUevent;
struct Module {
    Ctx* ctx;
    std::vector<std::string> entries;
};
struct Function {
    Module* module;
    const Kernel* kernel;
    std::string name;
};
typedef Module* CUmodule;
typedef Function* CUfunction;
static std::set<Module*>& g_modules = *new std::set<Module*>;
static std::set<Function*>& g_functions = *new std::set<Function*>;

// ---- Initialisation, version, errors ----

SIM_API CUresult cuInit(unsigned flags) {
    if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuInit takes flags 0, got %u", flags);
    if (compute_capability() < 0)
        return fail(CUDA_ERROR_INVALID_VALUE, "PROTRAIN_CUDA_SIM_COMPUTE_CAPABILITY=%s: give MAJOR.MINOR, e.g. 7.5",
                    getenv("PROTRAIN_CUDA_SIM_COMPUTE_CAPABILITY"));
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_init) {
        g_init = true;
        g_primary.assign(device_count(), nullptr);
    }
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

static const char* err_name(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
    case CUDA_ERROR_ILLEGAL_INSTRUCTION: return "CUDA_ERROR_ILLEGAL_INSTRUCTION";
    case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return nullptr;
    }
}

SIM_API CUresult cuGetErrorName(CUresult e, const char** out) {
    const char* n = err_name(e);
    if (!n || !out) return CUDA_ERROR_INVALID_VALUE;
    *out = n;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuGetErrorString(CUresult e, const char** out) {
    const char* n = err_name(e);
    if (!n || !out) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
    case CUDA_ERROR_INVALID_CONTEXT: *out = "invalid device context (no context is current on this thread)"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument (the simulator printed why on stderr)"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *out = "unspecified launch failure (the simulator printed why on stderr)"; break;
    case CUDA_ERROR_ILLEGAL_INSTRUCTION: *out = "an illegal instruction was encountered (the simulator printed why on stderr)"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *out = "an illegal memory access was encountered (the simulator printed why on stderr)"; break;
    default: *out = n;
    }
    return CUDA_SUCCESS;
}

/// Refused, so that nothing reaches real driver entry points through the simulator.
SIM_API CUresult cuGetProcAddress(const char* sym, void**, int, uint64_t) {
    return fail(CUDA_ERROR_NOT_SUPPORTED, "cuGetProcAddress(%s) is refused: the simulator exports its entry points only by name",
                sym ? sym : "null");
}
SIM_API CUresult cuGetProcAddress_v2(const char* sym, void** p, int v, uint64_t f, void*) {
    return cuGetProcAddress(sym, p, v, f);
}

// ---- Devices ----

static CUresult check_device_ordinal(CUdevice d) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetCount(int* n) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = device_count();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (CUresult r = check_device_ordinal(ordinal)) return r;
    *d = ordinal;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (CUresult r = check_device_ordinal(d)) return r;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "protrain CUDA simulator on the CPU (not a GPU) #%d", d);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (CUresult r = check_device_ordinal(d)) return r;
    *bytes = device_bytes();
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    if (CUresult r = check_device_ordinal(d)) return r;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case 1: *v = 1024; break;        // MAX_THREADS_PER_BLOCK
    case 2: *v = 1024; break;        // MAX_BLOCK_DIM_X
    case 3: *v = 1024; break;        // MAX_BLOCK_DIM_Y
    case 4: *v = 64; break;          // MAX_BLOCK_DIM_Z
    case 5: *v = 2147483647; break;  // MAX_GRID_DIM_X
    case 6: *v = 65535; break;       // MAX_GRID_DIM_Y
    case 7: *v = 65535; break;       // MAX_GRID_DIM_Z
    case 8: *v = 48 * 1024; break;   // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: *v = 32; break;         // WARP_SIZE
    case 16: *v = 2; break;          // MULTIPROCESSOR_COUNT
    case 19: *v = 1; break;          // CAN_MAP_HOST_MEMORY
    case 41: *v = 1; break;          // UNIFIED_ADDRESSING
    case 75: *v = compute_capability() / 10; break; // COMPUTE_CAPABILITY_MAJOR
    case 76: *v = compute_capability() % 10; break; // COMPUTE_CAPABILITY_MINOR
    case 115: *v = 0; break;         // MEMORY_POOLS_SUPPORTED: no cuMemAllocAsync
    default:
        return fail(CUDA_ERROR_NOT_SUPPORTED, "cuDeviceGetAttribute(%d) is not simulated; add it to cuda-sim/src/driver.cpp", attr);
    }
    return CUDA_SUCCESS;
}

// ---- Contexts ----

SIM_API CUresult cuDevicePrimaryCtxRetain(CUcontext* out, CUdevice d) {
    if (CUresult r = check_device_ordinal(d)) return r;
    Ctx* c;
    {
        std::lock_guard<std::mutex> l(g_mu);
        c = g_primary[d];
    }
    if (!c) {
        c = new Ctx;
        c->device = d;
        c->legacy = new_stream(c, true, false);
        std::lock_guard<std::mutex> l(g_mu);
        if (g_primary[d]) {
            // Another thread made it meanwhile: keep theirs.
            stop_stream(c->legacy);
            delete c;
            c = g_primary[d];
        } else {
            g_primary[d] = c;
        }
    }
    std::lock_guard<std::mutex> l(g_mu);
    c->retains++;
    *out = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (CUresult r = check_device_ordinal(d)) return r;
    std::lock_guard<std::mutex> l(g_mu);
    Ctx* c = g_primary[d];
    if (!c || c->retains == 0) return fail(CUDA_ERROR_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease of device %d, never retained", d);
    // The primary context stays (its streams keep their threads) until the process ends:
    // a later retain gets the same one back.
    c->retains--;
    return CUDA_SUCCESS;
}

static bool live_ctx(Ctx* c) {
    std::lock_guard<std::mutex> l(g_mu);
    return std::find(g_primary.begin(), g_primary.end(), c) != g_primary.end();
}

SIM_API CUresult cuCtxSetCurrent(CUcontext c) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (c && !live_ctx(c)) return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent of an unknown context %p", (void*)c);
    t_ctx = c;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetCurrent(CUcontext* c) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = t_ctx;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetDevice(CUdevice* d) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    *d = c->device;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSetFlags(unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    c->flags = flags;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetFlags(unsigned* flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSynchronize() {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    Ctx* c = t_ctx;
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    sync_ctx(c);
    return sticky_of(c);
}

// ---- Memory ----

SIM_API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!p || bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of %zu bytes (the driver refuses 0)", bytes);
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (g_device_used + bytes > device_bytes())
            return fail(CUDA_ERROR_OUT_OF_MEMORY,
                        "cuMemAlloc of %zu bytes with %zu of the simulated device's %zu in use "
                        "(PROTRAIN_CUDA_SIM_MEMORY_MIB sets its size)",
                        bytes, g_device_used, device_bytes());
        g_device_used += bytes;
    }
    // Poisoned: every f32 (and bf16, f16) read before a write is a NaN.
    CUresult r = map_guarded(bytes, Space::Device, c, 0xff, p);
    if (r != CUDA_SUCCESS) {
        std::lock_guard<std::mutex> l(g_mu);
        g_device_used -= bytes;
    }
    return r;
}

SIM_API CUresult cuMemFree_v2(CUdeviceptr p) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (p == 0) return CUDA_SUCCESS;
    // cuMemFree waits for the device work issued before it.
    sync_ctx(c);
    return unmap_guarded(p, Space::Device, "cuMemFree");
}

SIM_API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!p || bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc of %zu bytes", bytes);
    if (flags & ~0x7u) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc flags %#x", flags);
    uint64_t a;
    // Pinned memory from the driver is not zeroed: poisoned like device memory.
    if (CUresult r = map_guarded(bytes, Space::Pinned, c, 0xff, &a)) return r;
    *p = (void*)a;
    std::lock_guard<std::mutex> l(g_mu);
    g_counters.host_allocs++;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }

SIM_API CUresult cuMemFreeHost(void* p) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    sync_ctx(c);
    return unmap_guarded((uint64_t)p, Space::Pinned, "cuMemFreeHost");
}

SIM_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    Space sp;
    if (CUresult r = locate((uint64_t)p, 1, "cuMemHostGetDevicePointer", &sp)) return r;
    if (sp != Space::Pinned || flags != 0)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostGetDevicePointer of %p, not pinned memory", p);
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

/// A copy of n bytes from src to dst queued on s. A pageable source is staged now (the
/// driver copies it before returning); a pinned one is read when the copy runs. With
/// `host_waits` the call returns only once the copy has run (the driver's synchronous copies
/// and copies into pageable memory).
static CUresult queue_copy(Stream* s, uint64_t dst, uint64_t src, size_t n, Space ds, Space ss, bool host_waits) {
    if (n == 0) return CUDA_SUCCESS;
    std::shared_ptr<std::vector<char>> staged;
    if (ss == Space::Pageable) staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + n);
    if (ds != Space::Device && ss == Space::Device) {
        std::lock_guard<std::mutex> l(g_mu);
        g_counters.dtoh_bytes += n;
    } else if (ds == Space::Device && ss != Space::Device) {
        std::lock_guard<std::mutex> l(g_mu);
        g_counters.htod_bytes += n;
    }
    // A device or pinned operand still live when the copy runs (a free waits for queued work,
    // so this holds unless memory was freed by another context's thread).
    uint64_t seq = enqueue(s, Op{[=]() -> CUresult {
                                     memcpy((void*)dst, staged ? (const void*)staged->data() : (const void*)src, n);
                                     return CUDA_SUCCESS;
                                 },
                                 {}});
    if (host_waits) {
        wait_for(s, seq);
        return sticky_of(s->ctx);
    }
    return CUDA_SUCCESS;
}

static CUresult copy(const char* api, CUstream hs, uint64_t dst, uint64_t src, size_t n, int want_dst, int want_src, bool sync) {
    // want_*: 0 device, 1 host (pinned or pageable), -1 either.
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "%s on stream %p, not a live stream of the current context", api, (void*)hs);
    Space ds, ss;
    std::string dn = std::string(api) + " destination", sn = std::string(api) + " source";
    if (CUresult r = locate(dst, n, dn.c_str(), &ds)) return r;
    if (CUresult r = locate(src, n, sn.c_str(), &ss)) return r;
    if (want_dst == 0 && ds != Space::Device)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx is not device memory", dn.c_str(), (unsigned long long)dst);
    if (want_src == 0 && ss != Space::Device)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx is not device memory", sn.c_str(), (unsigned long long)src);
    if (want_dst == 1 && ds == Space::Device)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx is device memory, the call copies to the host", dn.c_str(), (unsigned long long)dst);
    if (want_src == 1 && ss == Space::Device)
        return fail(CUDA_ERROR_INVALID_VALUE, "%s %#llx is device memory, the call copies from the host", sn.c_str(), (unsigned long long)src);
    if (n && (!dst || !src)) return fail(CUDA_ERROR_INVALID_VALUE, "%s with a null pointer", api);
    bool host_waits = sync ? !(ss == Space::Pageable && ds == Space::Device) : ds == Space::Pageable;
    return queue_copy(s, dst, src, n, ds, ss, host_waits);
}

SIM_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy("cuMemcpyHtoD", nullptr, dst, (uint64_t)src, n, 0, 1, true);
}
SIM_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoH", nullptr, (uint64_t)dst, src, n, 1, 0, true);
}
SIM_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoD", nullptr, dst, src, n, 0, 0, false);
}
SIM_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    return copy("cuMemcpyHtoDAsync", s, dst, (uint64_t)src, n, 0, 1, false);
}
SIM_API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy("cuMemcpyDtoHAsync", s, (uint64_t)dst, src, n, 1, 0, false);
}
SIM_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy("cuMemcpyDtoDAsync", s, dst, src, n, 0, 0, false);
}
SIM_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy("cuMemcpyAsync", s, dst, src, n, -1, -1, false);
}
SIM_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpy", nullptr, dst, src, n, -1, -1, true);
}

static CUresult memset_elems(const char* api, CUstream hs, uint64_t dst, uint64_t value, size_t elem, size_t count) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "%s on stream %p, not a live stream of the current context", api, (void*)hs);
    if (dst % elem) return fail(CUDA_ERROR_INVALID_VALUE, "%s at %#llx, not aligned to %zu bytes", api, (unsigned long long)dst, elem);
    std::string what = std::string(api) + " destination";
    if (CUresult r = check_device(dst, elem * count, what.c_str())) return r;
    if (count == 0) return CUDA_SUCCESS;
    enqueue(s, Op{[=]() -> CUresult {
                      char* p = (char*)dst;
                      for (size_t i = 0; i < count; ++i) memcpy(p + i * elem, &value, elem);
                      return CUDA_SUCCESS;
                  },
                  {}});
    return CUDA_SUCCESS;
}

SIM_API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return memset_elems("cuMemsetD8", nullptr, d, v, 1, n); }
SIM_API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return memset_elems("cuMemsetD8Async", s, d, v, 1, n); }
SIM_API CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return memset_elems("cuMemsetD32", nullptr, d, v, 4, n); }
SIM_API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) { return memset_elems("cuMemsetD32Async", s, d, v, 4, n); }

// ---- Streams ----

SIM_API CUresult cuStreamCreate(CUstream* out, unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!out || flags > 1) return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate flags %u", flags);
    *out = new_stream(c, false, flags == 1);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamCreateWithPriority(CUstream* out, unsigned flags, int) { return cuStreamCreate(out, flags); }

SIM_API CUresult cuStreamDestroy_v2(CUstream hs) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (!hs || !c->streams.count(hs)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy of %p, not a stream of the current context", (void*)hs);
        c->streams.erase(hs);
    }
    // Work already queued completes first, as the driver lets it.
    stop_stream(hs);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamSynchronize(CUstream hs) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamSynchronize of %p, not a live stream of the current context", (void*)hs);
    uint64_t seq;
    {
        std::lock_guard<std::mutex> l(g_mu);
        seq = s->enqueued;
    }
    wait_for(s, seq);
    return sticky_of(c);
}

SIM_API CUresult cuStreamQuery(CUstream hs) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    Stream* s = resolve_stream(c, hs);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> l(g_mu);
    if (c->sticky) return c->sticky;
    return s->completed >= s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

// ---- Events ----

SIM_API CUresult cuEventCreate(CUevent* out, unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!out || flags > 0xf) return fail(CUDA_ERROR_INVALID_VALUE, "cuEventCreate flags %#x", flags);
    Event* e = new Event;
    e->ctx = c;
    e->flags = flags;
    std::lock_guard<std::mutex> l(g_mu);
    g_events.insert(e);
    *out = e;
    return CUDA_SUCCESS;
}

static bool live_event(Event* e, Ctx* c) {
    std::lock_guard<std::mutex> l(g_mu);
    return g_events.count(e) && e->ctx == c;
}

SIM_API CUresult cuEventDestroy_v2(CUevent e) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_events.erase(e)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy of %p, not a live event", (void*)e);
    // The driver lets a destroyed event's pending record finish: nothing queued points at it.
    delete e;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecord(CUevent e, CUstream hs) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!live_event(e, c)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord of %p, not an event of the current context", (void*)e);
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord on %p, not a live stream of the current context", (void*)hs);
    // A marker: the event completes when the work queued on `s` before it has, and notes the
    // host clock then (what cuEventElapsedTime reads).
    auto at = std::make_shared<std::atomic<double>>(-1.0);
    uint64_t seq = enqueue(s, Op{[at] {
                                     using namespace std::chrono;
                                     at->store(duration<double>(steady_clock::now().time_since_epoch()).count());
                                     return CUDA_SUCCESS;
                                 },
                                 {}});
    std::lock_guard<std::mutex> l(g_mu);
    e->stream = s;
    e->seq = seq;
    e->at = at;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned flags) {
    if (flags != 0) return fail(CUDA_ERROR_NOT_SUPPORTED, "cuEventRecordWithFlags flags %u", flags);
    return cuEventRecord(e, s);
}

SIM_API CUresult cuStreamWaitEvent(CUstream hs, CUevent e, unsigned flags) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamWaitEvent flags %u", flags);
    if (!live_event(e, c)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent on %p, not an event of the current context", (void*)e);
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent on stream %p, not a live stream of the current context", (void*)hs);
    Op op{[] { return CUDA_SUCCESS; }, {}};
    {
        // The wait captures the event's last record as of now; a never-recorded event waits
        // for nothing.
        std::lock_guard<std::mutex> l(g_mu);
        if (e->stream) op.after.push_back({e->stream, e->seq});
    }
    enqueue(s, std::move(op));
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventSynchronize(CUevent e) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!live_event(e, c)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventSynchronize of %p, not an event of the current context", (void*)e);
    Stream* s;
    uint64_t id = 0, seq;
    {
        std::lock_guard<std::mutex> l(g_mu);
        s = e->stream;
        seq = e->seq;
        if (s) id = s->id;
    }
    if (s) wait_live(s, id, seq);
    return sticky_of(c);
}

SIM_API CUresult cuEventQuery(CUevent e) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!live_event(e, c)) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> l(g_mu);
    if (c->sticky) return c->sticky;
    return !e->stream || e->stream->completed >= e->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/// Milliseconds of the host clock between the markers of two recorded events: as the driver,
/// CUDA_ERROR_INVALID_HANDLE for an event made with CU_EVENT_DISABLE_TIMING (2) or never recorded,
/// CUDA_ERROR_NOT_READY while either record is pending.
SIM_API CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!ms) return fail(CUDA_ERROR_INVALID_VALUE, "cuEventElapsedTime with a null result");
    if (!live_event(start, c) || !live_event(end, c))
        return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime of %p and %p, not both events of the current context",
                    (void*)start, (void*)end);
    std::lock_guard<std::mutex> l(g_mu);
    for (Event* e : {start, end}) {
        if ((e->flags & 2) || !e->stream)
            return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime of %p, %s", (void*)e,
                        (e->flags & 2) ? "made with CU_EVENT_DISABLE_TIMING" : "never recorded");
        if (e->stream->completed < e->seq || e->at->load() < 0) return CUDA_ERROR_NOT_READY;
    }
    if (c->sticky) return c->sticky;
    *ms = (float)((end->at->load() - start->at->load()) * 1e3);
    return CUDA_SUCCESS;
}

SIM_API CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) { return cuEventElapsedTime_v2(ms, start, end); }

// ---- Modules and launches ----

/// The entry points of a module image: `.entry NAME` of PTX text, or the `.text.NAME`
/// sections of a CUBIN (ELF).
static std::vector<std::string> entries_of(const void* image) {
    std::vector<std::string> out;
    const char* p = (const char*)image;
    auto ident = [](char ch) { return isalnum((unsigned char)ch) || ch == '_' || ch == '$'; };
    if (memcmp(p, "\x7f" "ELF", 4) == 0) {
        // ELF64: the section header table and its string table give the section names.
        uint64_t shoff;
        uint16_t shentsize, shnum, shstrndx;
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&shentsize, p + 0x3a, 2);
        memcpy(&shnum, p + 0x3c, 2);
        memcpy(&shstrndx, p + 0x3e, 2);
        if (shstrndx >= shnum) return out;
        uint64_t stroff;
        memcpy(&stroff, p + shoff + (uint64_t)shstrndx * shentsize + 0x18, 8);
        for (uint16_t i = 0; i < shnum; ++i) {
            uint32_t name;
            memcpy(&name, p + shoff + (uint64_t)i * shentsize, 4);
            const char* n = p + stroff + name;
            if (strncmp(n, ".text.", 6) == 0) out.push_back(n + 6);
        }
        return out;
    }
    std::string text(p);
    for (size_t at = text.find(".entry"); at != std::string::npos; at = text.find(".entry", at + 6)) {
        size_t b = at + 6;
        while (b < text.size() && isspace((unsigned char)text[b])) b++;
        size_t e = b;
        while (e < text.size() && ident(text[e])) e++;
        if (e > b) out.push_back(text.substr(b, e - b));
    }
    return out;
}

SIM_API CUresult cuModuleLoadData(CUmodule* out, const void* image) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    auto entries = entries_of(image);
    if (entries.empty())
        return fail(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData: the image is neither PTX with .entry points nor a CUBIN with kernels");
    Module* m = new Module{c, entries};
    std::lock_guard<std::mutex> l(g_mu);
    g_modules.insert(m);
    *out = m;
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleUnload(CUmodule m) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_modules.erase(m)) return fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleUnload of %p, not a loaded module", (void*)m);
    for (auto it = g_functions.begin(); it != g_functions.end();)
        if ((*it)->module == m) it = g_functions.erase(it);
        else ++it;
    // The functions' memory stays: a launch queued before the unload may still name them.
    return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleGetFunction(CUfunction* out, CUmodule m, const char* name) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (!g_modules.count(m) || m->ctx != c) return fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleGetFunction in %p, not a module of the current context", (void*)m);
    }
    if (std::find(m->entries.begin(), m->entries.end(), name) == m->entries.end())
        return CUDA_ERROR_NOT_FOUND;
    const Kernel* k = find_kernel(name);
    if (!k)
        return fail(CUDA_ERROR_NOT_FOUND,
                    "kernel %s is in the module but the simulator has no host build of it: rebuild "
                    "the simulator (bash scripts/cuda-sim-env.sh) after adding a kernel source",
                    name);
    Function* f = new Function{m, k, name};
    std::lock_guard<std::mutex> l(g_mu);
    g_functions.insert(f);
    *out = f;
    return CUDA_SUCCESS;
}

/// The live allocation (device or pinned) that [p, p] lies in or ends at, for a kernel's
/// pointer argument; false when it lies in none.
static bool pointer_ok(uint64_t p) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return false;
    --it;
    const Alloc& a = it->second;
    return a.live && p <= a.base + a.bytes;
}

SIM_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared, CUstream hs, void** params, void** extra) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (!g_functions.count(f) || f->module->ctx != c)
            return fail(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel of %p, not a function of a module loaded in the current context", (void*)f);
    }
    Stream* s = resolve_stream(c, hs);
    if (!s) return fail(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel of %s on %p, not a live stream of the current context", f->name.c_str(), (void*)hs);
    const Kernel* k = f->kernel;
    uint64_t threads = (uint64_t)bx * by * bz;
    if (!gx || !gy || !gz || !bx || !by || !bz || threads > 1024 || bz > 64 || gy > 65535 || gz > 65535)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel of %s with grid (%u,%u,%u) and block (%u,%u,%u): out of the device's limits",
                    f->name.c_str(), gx, gy, gz, bx, by, bz);
    if (shared != 0)
        return fail(CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernel of %s with %u bytes of dynamic shared memory: the kernels declare theirs statically", f->name.c_str(), shared);
    if (extra || (!params && !k->sizes.empty()))
        return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel of %s: arguments must come as kernelParams", f->name.c_str());
    // The arguments are copied now: the caller may reuse its argument storage once this returns.
    auto args = std::make_shared<std::vector<char>>();
    auto offsets = std::make_shared<std::vector<size_t>>();
    for (size_t i = 0; i < k->sizes.size(); ++i) {
        size_t at = (args->size() + 7) / 8 * 8;
        args->resize(at + k->sizes[i]);
        memcpy(args->data() + at, params[i], k->sizes[i]);
        offsets->push_back(at);
    }
    std::string name = f->name;
    {
        std::lock_guard<std::mutex> l(g_mu);
        g_counters.launches++;
    }
    enqueue(s, Op{[=]() -> CUresult {
                      for (size_t i = 0; i < k->sizes.size(); ++i) {
                          if (!k->is_ptr[i]) continue;
                          uint64_t p;
                          memcpy(&p, args->data() + (*offsets)[i], 8);
                          if (p && !pointer_ok(p))
                              return fail(CUDA_ERROR_ILLEGAL_ADDRESS,
                                          "kernel %s: argument %zu (%#llx) points into no live device or pinned allocation",
                                          name.c_str(), i, (unsigned long long)p);
                      }
                      std::string why;
                      CUresult r = run_grid(k, gx, gy, gz, bx, by, bz, args->data(), offsets->data(), why);
                      if (r != CUDA_SUCCESS) fail(r, "kernel %s failed: %s", name.c_str(), why.c_str());
                      return r;
                  },
                  {}});
    return CUDA_SUCCESS;
}

SIM_API CUresult cuFuncGetAttribute(int* v, int attr, CUfunction f) {
    if (!v || !f) return CUDA_ERROR_INVALID_VALUE;
    if (attr == 0) { *v = 1024; return CUDA_SUCCESS; } // MAX_THREADS_PER_BLOCK
    return fail(CUDA_ERROR_NOT_SUPPORTED, "cuFuncGetAttribute(%d) is not simulated", attr);
}

// ---- Counters, for tests (not a CUDA entry point) ----

/// Copies the process's counters: kernel launches, host synchronisations (every wait of the
/// host for device work: stream and event synchronisations, synchronous copies, frees), bytes
/// copied host to device and device to host, cuBLAS GEMMs, pinned host allocations,
/// cublasLtMatmul calls, and GEMMs or matmuls issued without a workspace of the caller's.
SIM_API void protrain_cuda_sim_counters(uint64_t out[8]) {
    std::lock_guard<std::mutex> l(g_mu);
    out[0] = g_counters.launches;
    out[1] = g_counters.syncs;
    out[2] = g_counters.htod_bytes;
    out[3] = g_counters.dtoh_bytes;
    out[4] = g_counters.gemms;
    out[5] = g_counters.host_allocs;
    out[6] = g_counters.lt_matmuls;
    out[7] = g_counters.unplanned_workspaces;
}

/// Refused: the driver's private export tables are what NVRTC and the CUDA runtime probe for
/// (NVRTC opens libcuda.so.1 when it builds a CUBIN); without them they use their own code.
SIM_API CUresult cuGetExportTable(const void** table, const void*) {
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    Ctx* c;
    if (CUresult r = need_ctx(&c)) return r;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> l(g_mu);
    *total = device_bytes();
    *free_bytes = device_bytes() - g_device_used;
    return CUDA_SUCCESS;
}
