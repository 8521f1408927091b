// cuBLAS as the backend calls it: handles bound to a stream, cublasGemmEx and
// cublasGemmStridedBatchedEx with cuBLAS's argument checks (the supported type combinations
// of CUBLAS_COMPUTE_32F, leading dimensions, operands inside their allocations), run on the
// handle's stream. Products are summed in f64 and rounded once to C's type; cuBLAS's own
// summation order and tensor-core rounding are not reproduced.
#include "sim.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstring>
#include <memory>

using namespace sim;

typedef int cublasStatus_t;
enum : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum : int { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_8I = 3, CUDA_R_32I = 10, CUDA_R_16BF = 14 };
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum : int { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_PEDANTIC = 69 };
enum : int { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 };

struct Handle {
    Ctx* ctx;
    void* stream = nullptr; // 0: the legacy default stream
};
typedef Handle* cublasHandle_t;
static std::set<Handle*>& g_handles = *new std::set<Handle*>;

static cublasStatus_t blas_fail(cublasStatus_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static cublasStatus_t blas_fail(cublasStatus_t code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-sim (cuBLAS): %s\n", buf);
    return code;
}

static bool live_handle(Handle* h) {
    std::lock_guard<std::mutex> l(g_mu);
    return g_handles.count(h) != 0;
}

SIM_API cublasStatus_t cublasCreate_v2(cublasHandle_t* out) {
    Ctx* c;
    if (CUresult r = need_ctx(&c))
        return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasCreate with no usable current context (CUresult %d)", r);
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    Handle* h = new Handle{c};
    std::lock_guard<std::mutex> l(g_mu);
    g_handles.insert(h);
    *out = h;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_handles.erase(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasDestroy of %p, not a live handle", (void*)h);
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasSetStream_v2(cublasHandle_t h, void* stream) {
    if (!live_handle(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasSetStream on %p, not a live handle", (void*)h);
    if (!resolve_stream(h->ctx, stream))
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasSetStream to %p, not a live stream of the handle's context", stream);
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasGetStream_v2(cublasHandle_t h, void** stream) {
    if (!live_handle(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

static size_t type_size(int t) {
    switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    default: return 0;
    }
}

static const char* type_name(int t) {
    switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_8I: return "CUDA_R_8I";
    default: return "an unsupported type";
    }
}

static float load(int t, const char* p) {
    if (t == CUDA_R_32F) { float v; memcpy(&v, p, 4); return v; }
    uint16_t h;
    memcpy(&h, p, 2);
    if (t == CUDA_R_16BF) { uint32_t u = (uint32_t)h << 16; float v; memcpy(&v, &u, 4); return v; }
    return (float)*(const _Float16*)p;
}

static void store(int t, char* p, float v) {
    if (t == CUDA_R_32F) { memcpy(p, &v, 4); return; }
    if (t == CUDA_R_16F) { _Float16 h = (_Float16)v; memcpy(p, &h, 2); return; }
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t h;
    if ((u & 0x7fffffffu) > 0x7f800000u) h = (uint16_t)((u >> 16) | 0x40u);
    else h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    memcpy(p, &h, 2);
}

/// One validated GEMM: C = alpha op(A) op(B) + beta C for `batch` strided instances.
struct Gemm {
    int ta, tb, m, n, k, lda, ldb, ldc, at, bt, ct, batch;
    long long sa, sb, sc;
    float alpha, beta;
    uint64_t a, b, c;
};

/// Bytes an operand stored as `rows x cols` column-major with leading dimension `ld` spans.
static size_t span(int rows, int cols, int ld, size_t elem) {
    if (rows == 0 || cols == 0) return 0;
    return ((size_t)(cols - 1) * ld + rows) * elem;
}

static cublasStatus_t check_operand(const char* api, const char* name, uint64_t p, int rows, int cols, int ld,
                                    long long stride, int batch, size_t elem) {
    size_t one = span(rows, cols, ld, elem);
    if (one == 0) return CUBLAS_STATUS_SUCCESS;
    if (stride < 0) return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: negative stride of %s", api, name);
    size_t total = (size_t)stride * elem * (size_t)(batch - 1) + one;
    char what[96];
    snprintf(what, sizeof what, "%s operand %s (%d x %d, ld %d, %d batch)", api, name, rows, cols, ld, batch);
    if (check_device(p, total, what) != CUDA_SUCCESS) return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

static void run_gemm(const Gemm& g) {
    size_t ea = type_size(g.at), eb = type_size(g.bt), ec = type_size(g.ct);
    std::vector<float> ra((size_t)g.k), cb((size_t)g.k * g.n);
    for (int i = 0; i < g.batch; ++i) {
        const char* A = (const char*)g.a + (size_t)i * g.sa * ea;
        const char* B = (const char*)g.b + (size_t)i * g.sb * eb;
        char* C = (char*)g.c + (size_t)i * g.sc * ec;
        // op(B) column j, contiguous over k.
        for (int j = 0; j < g.n; ++j)
            for (int p = 0; p < g.k; ++p) {
                size_t at = g.tb == CUBLAS_OP_N ? (size_t)j * g.ldb + p : (size_t)p * g.ldb + j;
                cb[(size_t)j * g.k + p] = load(g.bt, B + at * eb);
            }
        for (int r = 0; r < g.m; ++r) {
            for (int p = 0; p < g.k; ++p) {
                size_t at = g.ta == CUBLAS_OP_N ? (size_t)p * g.lda + r : (size_t)r * g.lda + p;
                ra[p] = load(g.at, A + at * ea);
            }
            for (int j = 0; j < g.n; ++j) {
                const float* col = &cb[(size_t)j * g.k];
                double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
                int p = 0;
                for (; p + 4 <= g.k; p += 4) {
                    s0 += (double)ra[p] * col[p];
                    s1 += (double)ra[p + 1] * col[p + 1];
                    s2 += (double)ra[p + 2] * col[p + 2];
                    s3 += (double)ra[p + 3] * col[p + 3];
                }
                for (; p < g.k; ++p) s0 += (double)ra[p] * col[p];
                double v = (double)g.alpha * ((s0 + s1) + (s2 + s3));
                char* out = C + ((size_t)j * g.ldc + r) * ec;
                // beta = 0: C is not read (it may hold NaNs), as cuBLAS specifies.
                if (g.beta != 0.0f) v += (double)g.beta * load(g.ct, out);
                store(g.ct, out, (float)v);
            }
        }
    }
}

static cublasStatus_t gemm(const char* api, cublasHandle_t h, int ta, int tb, int m, int n, int k, const void* alpha,
                           const void* A, int at, int lda, long long sa, const void* B, int bt, int ldb, long long sb,
                           const void* beta, void* C, int ct, int ldc, long long sc, int batch, int compute, int algo) {
    if (!live_handle(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s on %p, not a live handle", api, (void*)h);
    if (current() != h->ctx)
        return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: the handle's context is not current on this thread", api);
    if (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: transa %d", api, ta);
    if (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: transb %d", api, tb);
    if (m < 0 || n < 0 || k < 0 || batch < 0)
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: negative size m %d n %d k %d batch %d", api, m, n, k, batch);
    int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, a_rows)) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: lda %d < max(1, %d)", api, lda, a_rows);
    if (ldb < std::max(1, b_rows)) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: ldb %d < max(1, %d)", api, ldb, b_rows);
    if (ldc < std::max(1, m)) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: ldc %d < max(1, m = %d)", api, ldc, m);
    if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC)
        return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: compute type %d is not simulated (CUBLAS_COMPUTE_32F is)", api, compute);
    if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP)
        return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: algorithm %d is not simulated", api, algo);
    // cuBLAS's table for CUBLAS_COMPUTE_32F with real types: A and B alike, and C either the
    // same 16-bit type or f32.
    bool ok = at == bt && ((at == CUDA_R_32F && ct == CUDA_R_32F) || (at == CUDA_R_16F && (ct == CUDA_R_16F || ct == CUDA_R_32F)) ||
                           (at == CUDA_R_16BF && (ct == CUDA_R_16BF || ct == CUDA_R_32F)));
    if (!ok)
        return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: A %s, B %s, C %s is not a combination CUBLAS_COMPUTE_32F supports", api,
                         type_name(at), type_name(bt), type_name(ct));
    if (!alpha || !beta) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: null alpha or beta", api);
    Gemm g{ta, tb, m, n, k, lda, ldb, ldc, at, bt, ct, batch, sa, sb, sc, *(const float*)alpha, *(const float*)beta,
           (uint64_t)A, (uint64_t)B, (uint64_t)C};
    if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    if (cublasStatus_t r = check_operand(api, "A", g.a, a_rows, ta == CUBLAS_OP_N ? k : m, lda, sa, batch, type_size(at))) return r;
    if (cublasStatus_t r = check_operand(api, "B", g.b, b_rows, tb == CUBLAS_OP_N ? n : k, ldb, sb, batch, type_size(bt))) return r;
    if (cublasStatus_t r = check_operand(api, "C", g.c, m, n, ldc, sc, batch, type_size(ct))) return r;
    // The outputs of a batch must not share an element (cuBLAS leaves that undefined): each
    // C_i lies after the previous one, or they interleave as disjoint row bands of one matrix.
    long long c_span = (long long)ldc * (n - 1) + m;
    bool disjoint = batch == 1 || sc >= c_span || (sc >= m && (long long)(batch - 1) * sc + m <= ldc);
    if (!disjoint)
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: strideC %lld makes the %d outputs (%d x %d, ldc %d) share elements", api,
                         sc, batch, m, n, ldc);
    Stream* s = resolve_stream(h->ctx, h->stream);
    if (!s) return blas_fail(CUBLAS_STATUS_EXECUTION_FAILED, "%s: the handle's stream was destroyed", api);
    {
        std::lock_guard<std::mutex> l(g_mu);
        g_counters.gemms++;
    }
    enqueue(s, Op{[g] {
                      run_gemm(g);
                      return CUDA_SUCCESS;
                  },
                  {}});
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasGemmEx(cublasHandle_t h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A,
                                    int at, int lda, const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc,
                                    int compute, int algo) {
    return gemm("cublasGemmEx", h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1, compute, algo);
}

SIM_API cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, int ta, int tb, int m, int n, int k, const void* alpha,
                                                  const void* A, int at, int lda, long long sa, const void* B, int bt, int ldb,
                                                  long long sb, const void* beta, void* C, int ct, int ldc, long long sc,
                                                  int batch, int compute, int algo) {
    return gemm("cublasGemmStridedBatchedEx", h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc,
                batch, compute, algo);
}
