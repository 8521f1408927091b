// The simulator's own tests: each checks one rule the simulator enforces (a strictness a real
// GPU has or a fault it would hide), in a child process of its own, against the library the
// loader finds as libcuda.so (run it with target/cuda-sim/lib first on LD_LIBRARY_PATH;
// cuda-sim/test.sh does). Exits non-zero if any check fails; prints one line per check.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <algorithm>
#include <vector>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void* H;

static void* lib;

static int failures = 0;
static void check(bool ok, const char* what) {
    if (!ok) { printf("  FAIL: %s\n", what); failures++; }
}

struct Api {
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDeviceGetName)(char*, int, int);
    CUresult (*cuDevicePrimaryCtxRetain)(H*, int);
    CUresult (*cuCtxSetCurrent)(H);
    CUresult (*cuCtxSynchronize)();
    CUresult (*cuMemAlloc_v2)(CUdeviceptr*, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
    CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void*, size_t);
    CUresult (*cuMemcpyDtoH_v2)(void*, CUdeviceptr, size_t);
    CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void*, size_t, H);
    CUresult (*cuMemsetD8_v2)(CUdeviceptr, unsigned char, size_t);
    CUresult (*cuStreamCreate)(H*, unsigned);
    CUresult (*cuStreamSynchronize)(H);
    CUresult (*cuEventCreate)(H*, unsigned);
    CUresult (*cuEventRecord)(H, H);
    CUresult (*cuStreamWaitEvent)(H, H, unsigned);
    CUresult (*cuEventSynchronize)(H);
    CUresult (*cuModuleLoadData)(H*, const void*);
    CUresult (*cuModuleGetFunction)(H*, H, const char*);
    CUresult (*cuLaunchKernel)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void**, void**);
    CUresult (*cuGetProcAddress)(const char*, void**, int, uint64_t);
    int (*cublasCreate_v2)(H*);
    int (*cublasSetStream_v2)(H, H);
    int (*cublasGemmEx)(H, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int, const void*, void*,
                        int, int, int, int);
    int (*cublasLtCreate)(H*);
    int (*cublasLtMatmulDescCreate)(H*, int, int);
    int (*cublasLtMatmulDescSetAttribute)(H, int, const void*, size_t);
    int (*cublasLtMatrixLayoutCreate)(H*, int, uint64_t, uint64_t, int64_t);
    int (*cublasLtMatmulPreferenceCreate)(H*);
    int (*cublasLtMatmulPreferenceSetAttribute)(H, int, const void*, size_t);
    int (*cublasLtMatmulAlgoGetHeuristic)(H, H, H, H, H, H, H, int, void*, int*);
    int (*cublasLtMatmul)(H, H, const void*, const void*, H, const void*, H, const void*, const void*, H, void*, H, const void*,
                          void*, size_t, H);
};
static Api api;

static void load_api() {
#define L(n) api.n = (decltype(api.n))dlsym(lib, #n); if (!api.n) { fprintf(stderr, "missing %s\n", #n); exit(2); }
    L(cuInit) L(cuDeviceGetName) L(cuDevicePrimaryCtxRetain) L(cuCtxSetCurrent) L(cuCtxSynchronize) L(cuMemAlloc_v2)
    L(cuMemFree_v2) L(cuMemHostAlloc) L(cuMemcpyHtoD_v2) L(cuMemcpyDtoH_v2) L(cuMemcpyHtoDAsync_v2) L(cuMemsetD8_v2)
    L(cuStreamCreate) L(cuStreamSynchronize) L(cuEventCreate) L(cuEventRecord) L(cuStreamWaitEvent) L(cuEventSynchronize)
    L(cuModuleLoadData) L(cuModuleGetFunction) L(cuLaunchKernel) L(cuGetProcAddress) L(cublasCreate_v2) L(cublasSetStream_v2)
    L(cublasGemmEx) L(cublasLtCreate) L(cublasLtMatmulDescCreate) L(cublasLtMatmulDescSetAttribute)
    L(cublasLtMatrixLayoutCreate) L(cublasLtMatmulPreferenceCreate) L(cublasLtMatmulPreferenceSetAttribute)
    L(cublasLtMatmulAlgoGetHeuristic) L(cublasLtMatmul)
#undef L
}

/// cuInit and the primary context of device 0, current on this thread.
static H setup() {
    H ctx;
    if (api.cuInit(0) || api.cuDevicePrimaryCtxRetain(&ctx, 0) || api.cuCtxSetCurrent(ctx)) { printf("  setup failed\n"); exit(3); }
    return ctx;
}

/// A module whose PTX names the test kernels (the simulator binds entry points by name).
static H kernel(const char* name) {
    H m, f;
    std::string ptx = std::string(".version 9.0\n.target sm_80\n.visible .entry ") + name + "(\n)\n{\n}\n";
    if (api.cuModuleLoadData(&m, ptx.c_str()) || api.cuModuleGetFunction(&f, m, name)) { printf("  no kernel %s\n", name); exit(3); }
    return f;
}

static void t_device_name() {
    setup();
    char name[256];
    check(api.cuDeviceGetName(name, sizeof name, 0) == 0 && strstr(name, "simulator") != nullptr, "the device name says simulator");
}

static void t_no_context() {
    api.cuInit(0);
    CUdeviceptr p;
    check(api.cuMemAlloc_v2(&p, 64) == 201, "cuMemAlloc with no current context is CUDA_ERROR_INVALID_CONTEXT");
    H s;
    check(api.cuStreamCreate(&s, 1) == 201, "cuStreamCreate with no current context is CUDA_ERROR_INVALID_CONTEXT");
    check(api.cuCtxSynchronize() == 201, "cuCtxSynchronize with no current context is CUDA_ERROR_INVALID_CONTEXT");
    // A context current on one thread is not current on another.
    setup();
    CUresult other = -1;
    std::thread([&] { other = api.cuMemAlloc_v2(&p, 64); }).join();
    check(other == 201, "the context is current per thread");
}

static void t_bounds() {
    setup();
    CUdeviceptr d;
    check(api.cuMemAlloc_v2(&d, 1000) == 0, "alloc");
    std::vector<char> host(2000, 1);
    check(api.cuMemcpyHtoD_v2(d, host.data(), 1000) == 0, "an in-bounds copy succeeds");
    check(api.cuMemcpyHtoD_v2(d, host.data(), 1001) == 1, "a copy one byte past the allocation is CUDA_ERROR_INVALID_VALUE");
    check(api.cuMemcpyDtoH_v2(host.data(), d + 8, 1000) == 1, "a read past the end is CUDA_ERROR_INVALID_VALUE");
    check(api.cuMemsetD8_v2(d + 999, 0, 2) == 1, "a memset past the end is CUDA_ERROR_INVALID_VALUE");
    check(api.cuMemcpyHtoD_v2((CUdeviceptr)host.data(), host.data(), 10) == 1, "a host pointer is not device memory");
    check(api.cuMemFree_v2(d) == 0, "free");
    check(api.cuMemcpyDtoH_v2(host.data(), d, 4) == 1, "a copy from freed memory is CUDA_ERROR_INVALID_VALUE");
    check(api.cuMemFree_v2(d) == 1, "a double free is CUDA_ERROR_INVALID_VALUE");
}

static void t_poison() {
    setup();
    CUdeviceptr d;
    api.cuMemAlloc_v2(&d, 16);
    float v[4];
    check(api.cuMemcpyDtoH_v2(v, d, 16) == 0, "read");
    check(std::isnan(v[0]) && std::isnan(v[3]), "fresh device memory reads as NaN (poisoned), not zeros");
}

static void t_pageable_staged() {
    setup();
    H s;
    api.cuStreamCreate(&s, 1);
    CUdeviceptr d;
    api.cuMemAlloc_v2(&d, 4096);
    std::vector<float> src(1024, 7.0f);
    // Hold the stream back with a long kernel, then queue a copy from pageable memory and
    // overwrite the source at once: the driver staged it at the call.
    H fill = kernel("simtest_fill");
    CUdeviceptr big;
    api.cuMemAlloc_v2(&big, 64 << 20);
    float one = 1.0f;
    long long n = 16 << 20;
    void* args[] = {&big, &one, &n};
    api.cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, s, args, nullptr);
    check(api.cuMemcpyHtoDAsync_v2(d, src.data(), 4096, s) == 0, "async copy");
    std::fill(src.begin(), src.end(), -1.0f);
    api.cuStreamSynchronize(s);
    float back[1024];
    api.cuMemcpyDtoH_v2(back, d, 4096);
    check(back[0] == 7.0f && back[1023] == 7.0f, "a pageable source is copied as it was at the call");
}

static CUresult launch_and_sync(const char* name, unsigned threads) {
    setup();
    H f = kernel(name);
    CUdeviceptr d;
    api.cuMemAlloc_v2(&d, 4 * threads);
    void* args[] = {&d};
    if (CUresult r = api.cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, 0, nullptr, args, nullptr)) return r;
    return api.cuCtxSynchronize();
}

static void t_partial_barrier() {
    check(launch_and_sync("simtest_partial_barrier", 64) == 719,
          "a __syncthreads that half the block skips ends the launch with CUDA_ERROR_LAUNCH_FAILED, not a hang");
    CUdeviceptr p;
    check(api.cuMemAlloc_v2(&p, 4) == 719, "the error is sticky: later calls return it");
}

static void t_partial_shuffle() {
    check(launch_and_sync("simtest_partial_shuffle", 32) == 719,
          "a full-mask shuffle reached by 20 of 32 lanes ends the launch with an error, not a hang");
}

static void t_block_sum() {
    setup();
    H f = kernel("simtest_block_sum");
    const int blocks = 3, threads = 256;
    std::vector<float> in(blocks * threads);
    for (size_t i = 0; i < in.size(); ++i) in[i] = (float)(i % 17);
    CUdeviceptr din, dout;
    api.cuMemAlloc_v2(&din, in.size() * 4);
    api.cuMemAlloc_v2(&dout, blocks * 4);
    api.cuMemcpyHtoD_v2(din, in.data(), in.size() * 4);
    void* args[] = {&dout, &din};
    check(api.cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, nullptr, args, nullptr) == 0, "launch");
    float out[blocks];
    check(api.cuMemcpyDtoH_v2(out, dout, sizeof out) == 0, "read back");
    for (int b = 0; b < blocks; ++b) {
        float want = 0;
        for (int t = 0; t < threads; ++t) want += in[b * threads + t];
        check(out[b] == want, "shuffles and barriers sum a block");
    }
}

/// Stream A fills x with 1, and 2 ms later the host queues y = x + 1 on stream B; with `wait`,
/// B waits on an event recorded on A after the fill. Without chaos the small fill has long
/// finished when B starts, so a missing wait goes unseen; chaos mode delays operations by up
/// to 20 ms and exposes it. Returns how many of `rounds` rounds gave a y that is not 2
/// everywhere.
static int race_rounds(bool wait, int rounds) {
    setup();
    H a, b, ev;
    api.cuStreamCreate(&a, 1);
    api.cuStreamCreate(&b, 1);
    api.cuEventCreate(&ev, 2);
    H fill = kernel("simtest_fill"), add = kernel("simtest_add_one");
    long long n = 256;
    CUdeviceptr x, y;
    api.cuMemAlloc_v2(&x, n * 4);
    api.cuMemAlloc_v2(&y, n * 4);
    int wrong = 0;
    std::vector<float> out(n);
    for (int r = 0; r < rounds; ++r) {
        api.cuMemsetD8_v2(x, 0, n * 4);
        api.cuCtxSynchronize();
        float one = 1.0f;
        void* fa[] = {&x, &one, &n};
        api.cuLaunchKernel(fill, 1, 1, 1, 256, 1, 1, 0, a, fa, nullptr);
        api.cuEventRecord(ev, a);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        if (wait) api.cuStreamWaitEvent(b, ev, 0);
        void* aa[] = {&y, &x, &n};
        api.cuLaunchKernel(add, 1, 1, 1, 256, 1, 1, 0, b, aa, nullptr);
        api.cuStreamSynchronize(b);
        api.cuMemcpyDtoH_v2(out.data(), y, n * 4);
        api.cuCtxSynchronize();
        for (float v : out)
            if (v != 2.0f) { wrong++; break; }
    }
    return wrong;
}

static void t_chaos_catches_missing_wait() {
    setenv("PROTRAIN_CUDA_SIM_CHAOS", "1", 1);
    setenv("PROTRAIN_CUDA_SIM_CHAOS_MAX_US", "20000", 1);
    int wrong = race_rounds(false, 40);
    printf("  without the wait: %d of 40 rounds wrong\n", wrong);
    check(wrong > 0, "chaos mode turns a missing cross-stream wait into a wrong result");
}

/// The same race without chaos mode: reported, not checked (a loaded machine may still
/// delay the fill past the gap), to show what chaos mode adds.
static void t_race_without_chaos() {
    printf("  without the wait and without chaos: %d of 20 rounds wrong\n", race_rounds(false, 20));
}

static void t_chaos_keeps_waits() {
    setenv("PROTRAIN_CUDA_SIM_CHAOS", "2", 1);
    setenv("PROTRAIN_CUDA_SIM_CHAOS_MAX_US", "20000", 1);
    check(race_rounds(true, 20) == 0, "with the wait every round is right under chaos");
}

static void t_never_recorded_event() {
    setup();
    H s, ev;
    api.cuStreamCreate(&s, 1);
    api.cuEventCreate(&ev, 2);
    check(api.cuStreamWaitEvent(s, ev, 0) == 0 && api.cuStreamSynchronize(s) == 0, "waiting on a never-recorded event waits for nothing");
    check(api.cuEventSynchronize(ev) == 0, "synchronizing a never-recorded event returns at once");
}

static void t_proc_address_refused() {
    setup();
    void* p = nullptr;
    check(api.cuGetProcAddress("cuMemAlloc", &p, 13000, 0) == 801, "cuGetProcAddress is refused (CUDA_ERROR_NOT_SUPPORTED)");
}

static void t_cublas() {
    setup();
    H h;
    check(api.cublasCreate_v2(&h) == 0, "cublasCreate");
    api.cublasSetStream_v2(h, nullptr);
    // C (2x2) = A (2x3) B (3x2), column-major; C starts as NaN (poisoned) and beta = 0.
    float A[6] = {1, 2, 3, 4, 5, 6}, B[6] = {1, 0, 2, 1, 1, 1}, C[4];
    CUdeviceptr da, db, dc;
    api.cuMemAlloc_v2(&da, 24);
    api.cuMemAlloc_v2(&db, 24);
    api.cuMemAlloc_v2(&dc, 16);
    api.cuMemcpyHtoD_v2(da, A, 24);
    api.cuMemcpyHtoD_v2(db, B, 24);
    float alpha = 1, beta = 0;
    check(api.cublasGemmEx(h, 0, 0, 2, 2, 3, &alpha, (void*)da, 0, 2, (void*)db, 0, 3, &beta, (void*)dc, 0, 2, 68, -1) == 0, "gemm");
    api.cuMemcpyDtoH_v2(C, dc, 16);
    // Column 0 of B is (1,0,2): A col0 + 2 A col2 = (1+10, 2+12); column 1 is (1,1,1): (9, 12).
    check(C[0] == 11 && C[1] == 14 && C[2] == 9 && C[3] == 12, "C = A B, and beta = 0 does not read the NaNs in C");
    check(api.cublasGemmEx(h, 0, 0, 2, 2, 3, &alpha, (void*)da, 0, 1, (void*)db, 0, 3, &beta, (void*)dc, 0, 2, 68, -1) == 7,
          "lda < m is CUBLAS_STATUS_INVALID_VALUE");
    check(api.cublasGemmEx(h, 0, 0, 2, 2, 3, &alpha, (void*)da, 14, 2, (void*)db, 0, 3, &beta, (void*)dc, 0, 2, 68, -1) == 15,
          "A bf16 with B f32 is CUBLAS_STATUS_NOT_SUPPORTED");
    check(api.cublasGemmEx(h, 0, 0, 2, 3, 3, &alpha, (void*)da, 0, 2, (void*)db, 0, 3, &beta, (void*)dc, 0, 2, 68, -1) == 7,
          "a B that runs past its allocation is CUBLAS_STATUS_INVALID_VALUE");
}

/// cuBLASLt: D (8x2) = A (8x3) B (3x2) + bias with GELU_AUX_BIAS keeps the biased product
/// as aux and stores its GELU; an aux leading dimension that is no multiple of 8 and an
/// operand less aligned than the preferences say are refused.
static void t_cublaslt() {
    setup();
    H h, desc, la, lb, ld8, pref;
    check(api.cublasLtCreate(&h) == 0, "cublasLtCreate");
    check(api.cublasLtMatmulDescCreate(&desc, 68, 0) == 0, "desc");
    api.cublasLtMatrixLayoutCreate(&la, 0, 8, 3, 8);
    api.cublasLtMatrixLayoutCreate(&lb, 0, 3, 2, 3);
    api.cublasLtMatrixLayoutCreate(&ld8, 0, 8, 2, 8);
    float A[24], B[6] = {1, 0, 0, 0, 1, 0}, bias[8], D[16], aux[16];
    for (int i = 0; i < 24; ++i) A[i] = (float)(i % 8) - 3.5f; // every column: -3.5 .. 3.5
    for (int i = 0; i < 8; ++i) bias[i] = 0.25f;
    CUdeviceptr da, db, dbias, dd, daux, ws;
    api.cuMemAlloc_v2(&da, sizeof A);
    api.cuMemAlloc_v2(&db, sizeof B);
    api.cuMemAlloc_v2(&dbias, sizeof bias);
    api.cuMemAlloc_v2(&dd, sizeof D);
    api.cuMemAlloc_v2(&daux, sizeof aux);
    api.cuMemAlloc_v2(&ws, 1 << 20);
    api.cuMemcpyHtoD_v2(da, A, sizeof A);
    api.cuMemcpyHtoD_v2(db, B, sizeof B);
    api.cuMemcpyHtoD_v2(dbias, bias, sizeof bias);
    int epilogue = 164; // GELU_AUX_BIAS
    int64_t aux_ld = 8;
    void *pb = (void*)dbias, *pa = (void*)daux;
    api.cublasLtMatmulDescSetAttribute(desc, 7, &epilogue, sizeof epilogue);
    api.cublasLtMatmulDescSetAttribute(desc, 8, &pb, sizeof pb);
    api.cublasLtMatmulDescSetAttribute(desc, 11, &pa, sizeof pa);
    api.cublasLtMatmulDescSetAttribute(desc, 12, &aux_ld, sizeof aux_ld);
    api.cublasLtMatmulPreferenceCreate(&pref);
    uint64_t wsb = 1 << 20;
    api.cublasLtMatmulPreferenceSetAttribute(pref, 1, &wsb, sizeof wsb);
    alignas(8) char heur[96];
    int count = 0;
    check(api.cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld8, ld8, pref, 1, heur, &count) == 0 && count == 1, "heuristic");
    float alpha = 1, beta = 0;
    check(api.cublasLtMatmul(h, desc, &alpha, (void*)da, la, (void*)db, lb, &beta, (void*)dd, ld8, (void*)dd, ld8, heur, (void*)ws,
                             wsb, nullptr) == 0,
          "matmul");
    api.cuMemcpyDtoH_v2(D, dd, sizeof D);
    api.cuMemcpyDtoH_v2(aux, daux, sizeof aux);
    bool ok = true;
    for (int j = 0; j < 2; ++j)
        for (int i = 0; i < 8; ++i) {
            float x = A[j * 8 + i] + 0.25f; // B picks column j of A
            float u = 0.7978846f * (x + 0.044715f * x * x * x);
            float g = x * (1.0f / (1.0f + expf(-2.0f * u)));
            ok = ok && aux[j * 8 + i] == x && fabsf(D[j * 8 + i] - g) <= 1e-6f;
        }
    check(ok, "aux = A B + bias, D = gelu(aux) (tanh form)");
    aux_ld = 12;
    api.cublasLtMatmulDescSetAttribute(desc, 12, &aux_ld, sizeof aux_ld);
    check(api.cublasLtMatmul(h, desc, &alpha, (void*)da, la, (void*)db, lb, &beta, (void*)dd, ld8, (void*)dd, ld8, heur, (void*)ws,
                             wsb, nullptr) == 15,
          "an aux leading dimension that is no multiple of 8 is CUBLAS_STATUS_NOT_SUPPORTED");
    aux_ld = 8;
    api.cublasLtMatmulDescSetAttribute(desc, 12, &aux_ld, sizeof aux_ld);
    // A 4 bytes past a 256-byte boundary, with the default preference (256): refused.
    H la7;
    api.cublasLtMatrixLayoutCreate(&la7, 0, 7, 3, 8);
    H l7;
    api.cublasLtMatrixLayoutCreate(&l7, 0, 7, 2, 8);
    check(api.cublasLtMatmul(h, desc, &alpha, (void*)(da + 4), la7, (void*)db, lb, &beta, (void*)dd, l7, (void*)dd, l7, heur,
                             (void*)ws, wsb, nullptr) == 15,
          "an A less aligned than the algorithm's preferences is CUBLAS_STATUS_NOT_SUPPORTED");
}

int main(int argc, char** argv) {
    lib = dlopen("libcuda.so", RTLD_NOW);
    if (!lib) { fprintf(stderr, "cannot load libcuda.so: %s\n", dlerror()); return 2; }
    load_api();
    struct T { const char* name; void (*run)(); };
    T tests[] = {
        {"device_name", t_device_name},
        {"no_context", t_no_context},
        {"bounds", t_bounds},
        {"poison", t_poison},
        {"pageable_staged", t_pageable_staged},
        {"partial_barrier", t_partial_barrier},
        {"partial_shuffle", t_partial_shuffle},
        {"block_sum", t_block_sum},
        {"chaos_catches_missing_wait", t_chaos_catches_missing_wait},
        {"race_without_chaos", t_race_without_chaos},
        {"chaos_keeps_waits", t_chaos_keeps_waits},
        {"never_recorded_event", t_never_recorded_event},
        {"proc_address_refused", t_proc_address_refused},
        {"cublas", t_cublas},
        {"cublaslt", t_cublaslt},
    };
    int failed = 0;
    for (auto& t : tests) {
        if (argc > 1 && strcmp(argv[1], t.name) != 0) continue;
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(60); // a hang is a failure, not a stuck CI job
            t.run();
            fflush(stdout);
            _exit(failures ? 1 : 0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        printf("%s %s\n", ok ? "ok  " : "FAIL", t.name);
        if (!ok) failed++;
    }
    printf("%d failed\n", failed);
    return failed ? 1 : 0;
}
