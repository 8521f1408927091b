// NCCL as protrain's CUDA backend (through cudarc) calls it, between the real processes of one
// machine: ncclGetVersion, ncclGetUniqueId, ncclCommInitRank, ncclAllReduce, ncclAllGather,
// ncclReduceScatter, ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy and
// ncclGetErrorString.
//
// The ranks of a communicator meet in a POSIX shared-memory segment named from the unique id:
// a header with each rank's pid, state and progress, then one staging slot per rank. A
// collective is an operation queued on the stream it is issued on (stream-ordered like NCCL's
// kernels) and run in issue order per communicator; it moves its data in pieces that fit a
// slot: each rank copies its piece of the send buffer into its slot and says so, waits until
// every rank has, computes its result from every slot, and says it has read them before any
// slot is reused. Sums are in f32 in rank order from zero, each element rounded once to its
// type, like the host backend's collectives (real NCCL picks its own order); a world of one
// copies bit for bit, as NCCL does.
//
// While it waits, a rank checks that its peers are alive (by pid) and have not aborted or
// left. A dead peer makes the collective stall, as a real NCCL kernel does, with
// ncclRemoteError reported by ncclCommGetAsyncError; ncclCommAbort then ends it. A peer that
// stays alive but never arrives is NCCL's hang too: the caller's own timeout (protrain's
// PROTRAIN_NCCL_TIMEOUT) aborts it.
#include "sim.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

typedef int ncclResult_t;
enum : int {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum : int { ncclInt32 = 2, ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9 };
enum : int { ncclSum = 0 };

struct ncclUniqueId {
    char internal[128];
};

namespace {

/// What the unique id starts with; the segment's name follows it.
const char kIdMagic[] = "protrain-cuda-sim-nccl ";
const uint64_t kMagic = 0x6e63636c2d73696dull; // "nccl-sim"
const int kMaxRanks = 64;
/// Bytes of one rank's staging slot.
const size_t kSlot = 4u << 20;
/// The header's size, a multiple of the page size.
const size_t kHeader = 64u << 10;

enum RankState : int32_t { kAbsent = 0, kJoined = 1, kLeft = 2, kAborted = 3 };
enum OpKind : int32_t { kAllReduce = 1, kAllGather = 2, kReduceScatter = 3 };

/// One rank's part of the header; every field is accessed with __atomic builtins.
struct RankSlot {
    int32_t pid;
    int32_t state;
    uint64_t posted;   // the last piece whose data this rank has put in its slot
    uint64_t consumed; // the last piece this rank has read every slot of
    int32_t op, dtype;
    uint64_t count;
    char pad[24];
};

struct Header {
    uint64_t magic;
    int32_t nranks;
    int32_t pad;
    RankSlot ranks[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeader, "header fits");

template <class T> T load(const T& x) { return __atomic_load_n(&x, __ATOMIC_SEQ_CST); }
template <class T> void store(T& x, T v) { __atomic_store_n(&x, v, __ATOMIC_SEQ_CST); }

} // namespace

/// A communicator of this process. Never freed: a stream worker may still run one of its
/// collectives when it is aborted or destroyed.
struct ncclComm {
    int rank = 0, nranks = 1;
    sim::Ctx* ctx = nullptr;
    Header* h = nullptr;
    char* slots = nullptr;
    std::string name;
    std::atomic<int> async{ncclSuccess};
    std::atomic<bool> aborted{false};
    std::atomic<bool> destroyed{false};
    // Collectives run in issue order: the n-th issued waits until n - 1 have finished.
    std::mutex mu;
    std::condition_variable cv;
    uint64_t issued = 0, finished = 0;
    uint64_t piece = 0; // pieces moved so far (touched only by the running collective)
    // The collective a stream worker is running (its ticket, 0 before the first) and the
    // last piece it needs every peer to post: a peer that has posted it and then left owes
    // this rank nothing more for it.
    std::atomic<uint64_t> running{0};
    std::atomic<uint64_t> needs{0};
};
typedef ncclComm* ncclComm_t;

namespace {

ncclResult_t nfail(ncclResult_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t nfail(ncclResult_t code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-sim nccl: %s\n", buf);
    return code;
}

size_t type_size(int dtype) {
    switch (dtype) {
    case ncclInt32:
    case ncclFloat32: return 4;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    default: return 0;
    }
}

float to_f32(const char* p, int dtype) {
    if (dtype == ncclFloat32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    if (dtype == ncclFloat16) {
        _Float16 h;
        memcpy(&h, p, 2);
        return (float)h;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/// `f` rounded to nearest even in `dtype` at `p`.
void from_f32(float f, char* p, int dtype) {
    if (dtype == ncclFloat32) {
        memcpy(p, &f, 4);
    } else if (dtype == ncclFloat16) {
        _Float16 h = (_Float16)f;
        memcpy(p, &h, 2);
    } else {
        uint32_t x;
        memcpy(&x, &f, 4);
        uint16_t out = (x & 0x7fffffff) > 0x7f800000 ? (uint16_t)((x >> 16) | 0x40)
                                                     : (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
        memcpy(p, &out, 2);
    }
}

bool alive(int pid) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    // A dead child not yet reaped is a zombie: dead all the same.
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE* f = fopen(path, "r");
    if (!f) return true;
    char buf[512];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char* close = strrchr(buf, ')');
    return !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

/// Why a peer cannot take part any more (empty while it can).
std::string peer_problem(ncclComm* c, int r) {
    RankSlot& s = c->h->ranks[r];
    int state = load(s.state);
    char buf[160];
    if (state == kAborted) snprintf(buf, sizeof buf, "rank %d aborted its communicator", r);
    else if (state == kLeft) snprintf(buf, sizeof buf, "rank %d destroyed its communicator", r);
    else if (state == kJoined && !alive(load(s.pid))) snprintf(buf, sizeof buf, "rank %d (pid %d) died", r, load(s.pid));
    else return "";
    return buf;
}

/// Waits until `ready()` holds for every peer. On a failed peer: records the asynchronous
/// error and stalls (as a real NCCL kernel waiting for data) until the communicator is
/// aborted. Returns false when the wait ended by an abort.
template <class F> bool wait_all(ncclComm* c, F ready, const char* what) {
    auto last_check = std::chrono::steady_clock::now();
    int spins = 0;
    for (;;) {
        if (c->aborted.load()) return false;
        bool all = true;
        for (int r = 0; r < c->nranks && all; ++r) all = ready(r);
        if (all) return true;
        auto now = std::chrono::steady_clock::now();
        if (now - last_check > std::chrono::milliseconds(5) && c->async.load() == ncclSuccess) {
            last_check = now;
            for (int r = 0; r < c->nranks; ++r) {
                if (r == c->rank) continue;
                std::string p = peer_problem(c, r);
                if (!p.empty()) {
                    // A peer that posted (or read) what this wait needs and then left is no
                    // failure: its state is stored after its progress, so reading the
                    // progress again now sees everything it did before it left.
                    bool now_all = true;
                    for (int q = 0; q < c->nranks && now_all; ++q) now_all = ready(q);
                    if (now_all) return true;
                    int expected = ncclSuccess;
                    if (c->async.compare_exchange_strong(expected, ncclRemoteError))
                        nfail(ncclRemoteError, "rank %d: %s while %s: ncclRemoteError until the communicator is aborted",
                              c->rank, p.c_str(), what);
                    break;
                }
            }
        }
        if (++spins < 64) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

/// How long this rank lingers after the last piece of every collective before the stream
/// sees it finished, in milliseconds: PROTRAIN_CUDA_SIM_NCCL_SLOW_RANK="RANK:MS" (none
/// when unset). It widens the window in which a faster peer has finished the same
/// collective, and even destroyed its communicator, while this one still waits on it.
uint64_t linger_ms(int rank) {
    const char* v = getenv("PROTRAIN_CUDA_SIM_NCCL_SLOW_RANK");
    if (!v || !*v) return 0;
    char* end = nullptr;
    long r = strtol(v, &end, 10);
    if (end == v || *end != ':' || r != rank) return 0;
    return strtoull(end + 1, nullptr, 10);
}

struct Call {
    int op, dtype;
    size_t count; // NCCL's count argument
    uint64_t send, recv;
};

/// Runs one collective (on a stream worker): piece by piece through the slots.
void run_collective(ncclComm* c, const Call& k, uint64_t ticket) {
    const int W = c->nranks, me = c->rank;
    const size_t size = type_size(k.dtype);
    // Elements per piece, per rank-slice for a reduce-scatter (which posts all W slices).
    size_t per = kSlot / size / (k.op == kReduceScatter ? W : 1);
    RankSlot& mine = c->h->ranks[me];
    const char* what = k.op == kAllReduce ? "in ncclAllReduce" : k.op == kAllGather ? "in ncclAllGather" : "in ncclReduceScatter";
    c->needs.store(c->piece + (k.count + per - 1) / per);
    c->running.store(ticket);
    if (k.count == 0) return;
    // This rank's fields name the collective its pieces belong to, and every rank compares
    // them once a piece is posted. They change only after every rank has read (and so
    // checked) the last piece of the collective before: a slower rank still checking that
    // piece would otherwise see this collective's fields and report a mismatch that is not one.
    const uint64_t last = c->piece;
    if (!wait_all(c, [&](int r) { return load(c->h->ranks[r].consumed) >= last; }, what)) return;
    store(mine.op, (int32_t)k.op);
    store(mine.dtype, (int32_t)k.dtype);
    store(mine.count, (uint64_t)k.count);
    std::vector<float> acc;
    for (size_t at = 0; at < k.count || (k.count == 0 && at == 0); at += per) {
        if (k.count == 0) break;
        size_t n = std::min(per, k.count - at);
        uint64_t piece = ++c->piece;
        // Every slot must have been read (the previous piece) before it is overwritten.
        if (!wait_all(c, [&](int r) { return load(c->h->ranks[r].consumed) >= piece - 1; }, what)) return;
        char* slot = c->slots + (size_t)me * kSlot;
        if (k.op == kReduceScatter) {
            for (int d = 0; d < W; ++d)
                memcpy(slot + (size_t)d * n * size, (const char*)k.send + ((size_t)d * k.count + at) * size, n * size);
        } else {
            memcpy(slot, (const char*)k.send + at * size, n * size);
        }
        store(mine.posted, piece);
        if (!wait_all(c, [&](int r) { return load(c->h->ranks[r].posted) >= piece; }, what)) return;
        // Every rank must be running the same collective.
        for (int r = 0; r < W; ++r) {
            RankSlot& s = c->h->ranks[r];
            if (load(s.op) != k.op || load(s.dtype) != k.dtype || load(s.count) != (uint64_t)k.count) {
                int expected = ncclSuccess;
                if (c->async.compare_exchange_strong(expected, ncclInvalidUsage))
                    nfail(ncclInvalidUsage, "rank %d runs op %d of %zu elements of type %d, rank %d op %d of %llu of type %d: "
                          "every rank must issue the same collectives in the same order", me, k.op, k.count, k.dtype, r,
                          load(s.op), (unsigned long long)load(s.count), load(s.dtype));
                while (!c->aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                return;
            }
        }
        if (W == 1) {
            // One rank: every collective is a copy, bit for bit (NaN payloads, signed zeros).
            memcpy((char*)k.recv + at * size, c->slots, n * size);
        } else if (k.op == kAllGather) {
            for (int r = 0; r < W; ++r)
                memcpy((char*)k.recv + ((size_t)r * k.count + at) * size, c->slots + (size_t)r * kSlot, n * size);
        } else {
            // The sum in rank order from zero; a reduce-scatter sums this rank's slice.
            size_t off = k.op == kReduceScatter ? (size_t)me * n * size : 0;
            acc.assign(n, 0.0f);
            for (int r = 0; r < W; ++r) {
                const char* src = c->slots + (size_t)r * kSlot + off;
                for (size_t i = 0; i < n; ++i) acc[i] += to_f32(src + i * size, k.dtype);
            }
            char* dst = (char*)k.recv + at * size;
            for (size_t i = 0; i < n; ++i) from_f32(acc[i], dst + i * size, k.dtype);
        }
        store(mine.consumed, piece);
    }
    if (uint64_t ms = linger_ms(me)) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

} // namespace

SIM_API ncclResult_t ncclGetVersion(int* version) {
    if (!version) return ncclInvalidArgument;
    *version = 22703;
    return ncclSuccess;
}

SIM_API const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

SIM_API const char* ncclGetLastError(ncclComm_t) { return ""; }

SIM_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return nfail(ncclInvalidArgument, "ncclGetUniqueId with a null id");
    unsigned char rnd[16];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) return nfail(ncclSystemError, "ncclGetUniqueId: getrandom failed");
    memset(id->internal, 0, sizeof id->internal);
    int n = snprintf(id->internal, sizeof id->internal, "%s/protrain-nccl-%d-", kIdMagic, (int)getpid());
    for (unsigned char b : rnd) n += snprintf(id->internal + n, sizeof id->internal - n, "%02x", b);
    return ncclSuccess;
}

SIM_API ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
    if (!out) return nfail(ncclInvalidArgument, "ncclCommInitRank with a null communicator pointer");
    if (nranks < 1 || nranks > kMaxRanks)
        return nfail(ncclInvalidArgument, "ncclCommInitRank of %d ranks (the simulator takes 1 to %d)", nranks, kMaxRanks);
    if (rank < 0 || rank >= nranks) return nfail(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d", rank, nranks);
    if (strncmp(id.internal, kIdMagic, strlen(kIdMagic)) != 0 || !memchr(id.internal, 0, sizeof id.internal))
        return nfail(ncclInvalidArgument, "ncclCommInitRank with an id that ncclGetUniqueId of the simulator did not make");
    sim::Ctx* ctx = sim::current();
    if (!ctx) return nfail(ncclInvalidUsage, "ncclCommInitRank with no CUDA context current on the calling thread");
    std::string name = id.internal + strlen(kIdMagic);
    int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0) return nfail(ncclSystemError, "ncclCommInitRank: shm_open(%s): %s", name.c_str(), strerror(errno));
    size_t bytes = kHeader + (size_t)nranks * kSlot;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        return nfail(ncclSystemError, "ncclCommInitRank: sizing %s: %s", name.c_str(), strerror(errno));
    }
    void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return nfail(ncclSystemError, "ncclCommInitRank: mapping %s: %s", name.c_str(), strerror(errno));
    Header* h = (Header*)map;
    // The first rank to arrive writes the shape; the others check it.
    uint64_t zero = 0;
    if (__atomic_compare_exchange_n(&h->magic, &zero, kMagic, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) store(h->nranks, (int32_t)nranks);
    else
        while (load(h->nranks) == 0) std::this_thread::yield();
    if (load(h->nranks) != nranks)
        return nfail(ncclInvalidUsage, "ncclCommInitRank: rank %d says %d ranks, another rank said %d", rank, nranks, load(h->nranks));
    RankSlot& mine = h->ranks[rank];
    int32_t absent = kAbsent;
    store(mine.pid, (int32_t)getpid());
    if (!__atomic_compare_exchange_n(&mine.state, &absent, (int32_t)kJoined, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return nfail(ncclInvalidUsage, "ncclCommInitRank: rank %d joined twice", rank);
    ncclComm* c = new ncclComm;
    c->rank = rank;
    c->nranks = nranks;
    c->ctx = ctx;
    c->h = h;
    c->slots = (char*)map + kHeader;
    c->name = name;
    // Like NCCL, initialisation waits for every rank; a rank that died while others wait
    // fails it, one that never comes leaves it to the caller's own timeout.
    for (;;) {
        bool all = true;
        for (int r = 0; r < nranks; ++r) {
            int state = load(h->ranks[r].state);
            if (state == kJoined && r != rank && !alive(load(h->ranks[r].pid))) {
                return nfail(ncclRemoteError, "ncclCommInitRank: rank %d (pid %d) died before every rank joined", r,
                             load(h->ranks[r].pid));
            }
            if (state == kAborted || state == kLeft) return nfail(ncclRemoteError, "ncclCommInitRank: rank %d left during initialisation", r);
            all = all && state == kJoined;
        }
        if (all) break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    // Everyone has the segment open: its name is no longer needed.
    if (rank == 0) shm_unlink(name.c_str());
    *out = c;
    return ncclSuccess;
}

static ncclResult_t enqueue_collective(const char* api, Call k, ncclComm_t c, void* stream) {
    if (!c) return nfail(ncclInvalidArgument, "%s with a null communicator", api);
    if (c->aborted.load() || c->destroyed.load()) return nfail(ncclInvalidUsage, "%s on a communicator that was aborted or destroyed", api);
    size_t size = type_size(k.dtype);
    if (!size) return nfail(ncclInvalidArgument, "%s of data type %d, which the simulator does not take", api, k.dtype);
    sim::Stream* s = sim::resolve_stream(c->ctx, stream);
    if (!s) return nfail(ncclInvalidArgument, "%s on stream %p, not a live stream of the communicator's context", api, stream);
    size_t W = c->nranks;
    size_t send_elems = k.op == kReduceScatter ? k.count * W : k.count;
    size_t recv_elems = k.op == kAllGather ? k.count * W : k.count;
    std::string sw = std::string(api) + " send buffer", rw = std::string(api) + " receive buffer";
    if (sim::check_device(k.send, send_elems * size, sw.c_str()) || sim::check_device(k.recv, recv_elems * size, rw.c_str()))
        return ncclInvalidArgument;
    // In place only as NCCL allows: the same address for an all-reduce, the rank's slice of
    // the receive buffer for an all-gather, of the send buffer for a reduce-scatter.
    uint64_t slice = k.count * size;
    bool overlap = k.send < k.recv + recv_elems * size && k.recv < k.send + send_elems * size;
    bool allowed = (k.op == kAllReduce && k.send == k.recv) || (k.op == kAllGather && k.send == k.recv + c->rank * slice) ||
                   (k.op == kReduceScatter && k.recv == k.send + c->rank * slice);
    if (overlap && !allowed)
        return nfail(ncclInvalidArgument, "%s: send and receive buffers overlap other than in place (rank %d)", api, c->rank);
    uint64_t ticket;
    {
        std::lock_guard<std::mutex> l(c->mu);
        ticket = ++c->issued;
    }
    sim::enqueue(s, sim::Op{[c, k, ticket]() -> CUresult {
                                {
                                    std::unique_lock<std::mutex> l(c->mu);
                                    c->cv.wait(l, [&] { return c->finished + 1 == ticket || c->aborted.load(); });
                                }
                                if (!c->aborted.load()) run_collective(c, k, ticket);
                                std::lock_guard<std::mutex> l(c->mu);
                                if (c->finished < ticket) c->finished = ticket;
                                c->cv.notify_all();
                                return CUDA_SUCCESS;
                            },
                            {}});
    return ncclSuccess;
}

SIM_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, ncclComm_t c, void* stream) {
    if (dtype == ncclInt32) return nfail(ncclInvalidArgument, "ncclAllReduce of int32; the simulator sums f32, bf16 and f16");
    if (op != ncclSum) return nfail(ncclInvalidArgument, "ncclAllReduce with reduction %d; the simulator sums only", op);
    return enqueue_collective("ncclAllReduce", Call{kAllReduce, dtype, count, (uint64_t)send, (uint64_t)recv}, c, stream);
}

SIM_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, int dtype, ncclComm_t c, void* stream) {
    return enqueue_collective("ncclAllGather", Call{kAllGather, dtype, count, (uint64_t)send, (uint64_t)recv}, c, stream);
}

SIM_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, int dtype, int op, ncclComm_t c,
                                       void* stream) {
    if (dtype == ncclInt32) return nfail(ncclInvalidArgument, "ncclReduceScatter of int32; the simulator sums f32, bf16 and f16");
    if (op != ncclSum) return nfail(ncclInvalidArgument, "ncclReduceScatter with reduction %d; the simulator sums only", op);
    return enqueue_collective("ncclReduceScatter", Call{kReduceScatter, dtype, count, (uint64_t)send, (uint64_t)recv}, c, stream);
}

SIM_API ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* out) {
    if (!c || !out) return ncclInvalidArgument;
    if (c->aborted.load() || c->destroyed.load()) return nfail(ncclInvalidUsage, "ncclCommGetAsyncError on an aborted or destroyed communicator");
    *out = c->async.load();
    // A peer that died, aborted or left while this rank still needs it is seen here too, as
    // NCCL's proxy thread sees a closed connection, even before a collective waits on it. A
    // peer that posted every piece of this rank's one outstanding collective before it went
    // owes nothing (the last rank to finish a run's last collective sees the others go).
    if (*out == ncclSuccess)
        for (int r = 0; r < c->nranks; ++r)
            if (r != c->rank && !peer_problem(c, r).empty()) {
                std::lock_guard<std::mutex> l(c->mu);
                bool owed = c->issued > c->finished;
                if (owed && c->issued == c->finished + 1 && c->running.load() == c->issued)
                    owed = load(c->h->ranks[r].posted) < c->needs.load();
                if (owed) {
                    int expected = ncclSuccess;
                    c->async.compare_exchange_strong(expected, ncclRemoteError);
                    *out = c->async.load();
                }
                break;
            }
    return ncclSuccess;
}

SIM_API ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclInvalidArgument;
    if (!c->aborted.exchange(true)) {
        store(c->h->ranks[c->rank].state, (int32_t)kAborted);
        std::lock_guard<std::mutex> l(c->mu);
        c->cv.notify_all();
    }
    return ncclSuccess;
}

SIM_API ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (!c) return ncclInvalidArgument;
    if (c->aborted.load() || c->destroyed.exchange(true)) return ncclSuccess;
    // Outstanding collectives finish first, as NCCL's destroy waits for them.
    {
        std::unique_lock<std::mutex> l(c->mu);
        c->cv.wait(l, [&] { return c->finished >= c->issued || c->aborted.load(); });
    }
    store(c->h->ranks[c->rank].state, (int32_t)kLeft);
    return ncclSuccess;
}

SIM_API ncclResult_t ncclCommCount(const ncclComm_t c, int* count) {
    if (!c || !count) return ncclInvalidArgument;
    *count = c->nranks;
    return ncclSuccess;
}

SIM_API ncclResult_t ncclCommUserRank(const ncclComm_t c, int* rank) {
    if (!c || !rank) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
}
