// cuBLAS as the backend calls it: handles bound to a stream with a workspace
// (cublasSetWorkspace), cublasGemmEx and cublasGemmStridedBatchedEx with cuBLAS's argument
// checks (the supported type combinations of CUBLAS_COMPUTE_32F, leading dimensions,
// operands inside their allocations), run on the handle's stream. Products are summed in f64
// and rounded once to C's type; cuBLAS's own summation order and tensor-core rounding are not
// reproduced.
//
// cuBLASLt as the backend calls it: handles, matmul descriptors (transposes, the epilogues
// DEFAULT, BIAS, GELU, GELU_BIAS, GELU_AUX, GELU_AUX_BIAS, bias and auxiliary pointers,
// types and leading dimension), matrix layouts, preferences (workspace, minimum alignments),
// the heuristic, and cublasLtMatmul: the product as cublasGemmEx computes it, rounded to f32
// with beta C added, then the bias added in f32, the GELU input kept (rounded to its type),
// the tanh GELU, and one rounding to D's type. A matmul whose operands are less aligned than
// the algorithm the heuristic chose assumes is refused, as cuBLASLt refuses it.
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
    uint64_t workspace = 0;  // cublasSetWorkspace's; 0: none set (cuBLAS would allocate its own)
    size_t workspace_bytes = 0;
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

/// The workspace every later GEMM of the handle uses; cuBLAS requires 256-byte alignment.
SIM_API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void* workspace, size_t bytes) {
    if (!live_handle(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasSetWorkspace on %p, not a live handle", (void*)h);
    if (bytes > 0) {
        if ((uint64_t)workspace % 256 != 0)
            return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasSetWorkspace: %p is not 256-byte aligned", workspace);
        if (check_device((uint64_t)workspace, bytes, "cublasSetWorkspace's workspace") != CUDA_SUCCESS)
            return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->workspace = bytes > 0 ? (uint64_t)workspace : 0;
    h->workspace_bytes = bytes;
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
        if (h->workspace == 0) g_counters.unplanned_workspaces++;
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

// ---- cuBLASLt ----

typedef int cublasLtEpilogue;
enum : int {
    LT_EPILOGUE_DEFAULT = 1,
    LT_EPILOGUE_BIAS = 4,
    LT_EPILOGUE_GELU = 32,
    LT_EPILOGUE_GELU_BIAS = 36,
    LT_EPILOGUE_GELU_AUX = 160,
    LT_EPILOGUE_GELU_AUX_BIAS = 164,
};
// cublasLtMatmulDescAttributes_t and cublasLtMatmulPreferenceAttributes_t (CUDA 13).
enum : int {
    DESC_COMPUTE_TYPE = 0, DESC_SCALE_TYPE = 1, DESC_POINTER_MODE = 2, DESC_TRANSA = 3, DESC_TRANSB = 4,
    DESC_TRANSC = 5, DESC_EPILOGUE = 7, DESC_BIAS_POINTER = 8, DESC_AUX_POINTER = 11, DESC_AUX_LD = 12,
    DESC_AUX_DATA_TYPE = 22, DESC_BIAS_DATA_TYPE = 26,
};
enum : int { PREF_MAX_WORKSPACE_BYTES = 1, PREF_MIN_ALIGNMENT_A = 5, PREF_MIN_ALIGNMENT_D = 8 };

struct LtHandle {
    Ctx* ctx;
};
struct LtDesc {
    int compute, scale;
    int ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    int epilogue = LT_EPILOGUE_DEFAULT;
    uint64_t bias = 0, aux = 0;
    int64_t aux_ld = 0;
    int bias_type = -1, aux_type = -1; // -1: D's type
};
struct LtLayout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};
struct LtPref {
    uint64_t max_workspace = 0;
    uint32_t align[4] = {256, 256, 256, 256}; // A, B, C, D: cuBLASLt's default
};
/// cublasLtMatmulAlgo_t (64 bytes): a tag and the alignments the heuristic assumed.
struct LtAlgo {
    uint64_t tag;
    uint32_t align[4];
    uint64_t rest[5];
};
static_assert(sizeof(LtAlgo) == 64, "cublasLtMatmulAlgo_t is 64 bytes");
static const uint64_t LT_ALGO_TAG = 0x70726f747261696eull; // "protrain"
/// cublasLtMatmulHeuristicResult_t.
struct LtHeuristic {
    LtAlgo algo;
    size_t workspace_size;
    int state;
    float waves;
    int reserved[4];
};

static std::set<LtHandle*>& g_lt_handles = *new std::set<LtHandle*>;

static bool live_lt(LtHandle* h) {
    std::lock_guard<std::mutex> l(g_mu);
    return g_lt_handles.count(h) != 0;
}

SIM_API cublasStatus_t cublasLtCreate(LtHandle** out) {
    Ctx* c;
    if (CUresult r = need_ctx(&c))
        return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtCreate with no usable current context (CUresult %d)", r);
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    LtHandle* h = new LtHandle{c};
    std::lock_guard<std::mutex> l(g_mu);
    g_lt_handles.insert(h);
    *out = h;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtDestroy(LtHandle* h) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_lt_handles.erase(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtDestroy of %p, not a live handle", (void*)h);
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulDescCreate(LtDesc** out, int compute, int scale) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    *out = new LtDesc{compute, scale};
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulDescDestroy(LtDesc* d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}

template <typename T> static cublasStatus_t take(const void* buf, size_t size, T* out, const char* name) {
    if (!buf || size != sizeof(T))
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLt attribute %s: %zu bytes, not %zu", name, size, sizeof(T));
    memcpy(out, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulDescSetAttribute(LtDesc* d, int attr, const void* buf, size_t size) {
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case DESC_COMPUTE_TYPE: return take(buf, size, &d->compute, "COMPUTE_TYPE");
    case DESC_SCALE_TYPE: return take(buf, size, &d->scale, "SCALE_TYPE");
    case DESC_TRANSA: return take(buf, size, &d->ta, "TRANSA");
    case DESC_TRANSB: return take(buf, size, &d->tb, "TRANSB");
    case DESC_EPILOGUE: return take(buf, size, &d->epilogue, "EPILOGUE");
    case DESC_BIAS_POINTER: return take(buf, size, &d->bias, "BIAS_POINTER");
    case DESC_AUX_POINTER: return take(buf, size, &d->aux, "EPILOGUE_AUX_POINTER");
    case DESC_AUX_LD: return take(buf, size, &d->aux_ld, "EPILOGUE_AUX_LD");
    case DESC_AUX_DATA_TYPE: return take(buf, size, &d->aux_type, "EPILOGUE_AUX_DATA_TYPE");
    case DESC_BIAS_DATA_TYPE: return take(buf, size, &d->bias_type, "BIAS_DATA_TYPE");
    default: return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescSetAttribute(%d) is not simulated", attr);
    }
}

SIM_API cublasStatus_t cublasLtMatrixLayoutCreate(LtLayout** out, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    if (type_size(type) == 0) return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatrixLayoutCreate: type %d is not simulated", type);
    if (ld < (int64_t)std::max<uint64_t>(1, rows))
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutCreate: ld %lld < rows %llu", (long long)ld,
                         (unsigned long long)rows);
    *out = new LtLayout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatrixLayoutDestroy(LtLayout* l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulPreferenceCreate(LtPref** out) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    *out = new LtPref{};
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulPreferenceDestroy(LtPref* p) {
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulPreferenceSetAttribute(LtPref* p, int attr, const void* buf, size_t size) {
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    if (attr == PREF_MAX_WORKSPACE_BYTES) return take(buf, size, &p->max_workspace, "MAX_WORKSPACE_BYTES");
    if (attr >= PREF_MIN_ALIGNMENT_A && attr <= PREF_MIN_ALIGNMENT_D) {
        uint32_t a = 0;
        if (cublasStatus_t r = take(buf, size, &a, "MIN_ALIGNMENT")) return r;
        if (a == 0 || (a & (a - 1)) != 0) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLt: alignment %u is no power of two", a);
        p->align[attr - PREF_MIN_ALIGNMENT_A] = a;
        return CUBLAS_STATUS_SUCCESS;
    }
    return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulPreferenceSetAttribute(%d) is not simulated", attr);
}

static bool epilogue_known(int e) {
    return e == LT_EPILOGUE_DEFAULT || e == LT_EPILOGUE_BIAS || e == LT_EPILOGUE_GELU || e == LT_EPILOGUE_GELU_BIAS ||
           e == LT_EPILOGUE_GELU_AUX || e == LT_EPILOGUE_GELU_AUX_BIAS;
}
static bool has_bias(int e) { return e == LT_EPILOGUE_BIAS || e == LT_EPILOGUE_GELU_BIAS || e == LT_EPILOGUE_GELU_AUX_BIAS; }
static bool has_gelu(int e) { return e == LT_EPILOGUE_GELU || e == LT_EPILOGUE_GELU_BIAS || e == LT_EPILOGUE_GELU_AUX || e == LT_EPILOGUE_GELU_AUX_BIAS; }
static bool has_aux(int e) { return e == LT_EPILOGUE_GELU_AUX || e == LT_EPILOGUE_GELU_AUX_BIAS; }

/// What the descriptor and layouts ask, checked as cuBLASLt checks it (without pointers).
static cublasStatus_t lt_check_shapes(const char* api, const LtDesc* d, const LtLayout* A, const LtLayout* B, const LtLayout* C,
                                      const LtLayout* D) {
    if (!d || !A || !B || !C || !D) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: a null descriptor", api);
    if (d->compute != CUBLAS_COMPUTE_32F && d->compute != CUBLAS_COMPUTE_32F_PEDANTIC)
        return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: compute type %d is not simulated (CUBLAS_COMPUTE_32F is)", api, d->compute);
    if (d->scale != CUDA_R_32F) return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: scale type %d with f32 compute", api, d->scale);
    if ((d->ta != CUBLAS_OP_N && d->ta != CUBLAS_OP_T) || (d->tb != CUBLAS_OP_N && d->tb != CUBLAS_OP_T))
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: transa %d transb %d", api, d->ta, d->tb);
    if (!epilogue_known(d->epilogue)) return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: epilogue %d is not simulated", api, d->epilogue);
    uint64_t m = D->rows, n = D->cols;
    uint64_t k = d->ta == CUBLAS_OP_N ? A->cols : A->rows;
    uint64_t a_m = d->ta == CUBLAS_OP_N ? A->rows : A->cols;
    uint64_t b_k = d->tb == CUBLAS_OP_N ? B->rows : B->cols, b_n = d->tb == CUBLAS_OP_N ? B->cols : B->rows;
    if (a_m != m || b_k != k || b_n != n || C->rows != m || C->cols != n)
        return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: op(A) %llu x %llu, op(B) %llu x %llu, C %llu x %llu, D %llu x %llu do not chain",
                         api, (unsigned long long)a_m, (unsigned long long)k, (unsigned long long)b_k, (unsigned long long)b_n,
                         (unsigned long long)C->rows, (unsigned long long)C->cols, (unsigned long long)m, (unsigned long long)n);
    int at = A->type, bt = B->type, ct = C->type, dt = D->type;
    bool ok = at == bt && ct == dt &&
              ((at == CUDA_R_32F && ct == CUDA_R_32F) || (at == CUDA_R_16F && (ct == CUDA_R_16F || ct == CUDA_R_32F)) ||
               (at == CUDA_R_16BF && (ct == CUDA_R_16BF || ct == CUDA_R_32F)));
    if (!ok)
        return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: A %s, B %s, C %s, D %s is not a combination CUBLAS_COMPUTE_32F supports", api,
                         type_name(at), type_name(bt), type_name(ct), type_name(dt));
    if (has_bias(d->epilogue)) {
        int t = d->bias_type < 0 ? dt : d->bias_type;
        if (t != dt && t != CUDA_R_32F)
            return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: bias of %s with D of %s", api, type_name(t), type_name(dt));
    }
    if (has_aux(d->epilogue)) {
        int t = d->aux_type < 0 ? dt : d->aux_type;
        if (t != dt) return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: GELU input of %s with D of %s", api, type_name(t), type_name(dt));
        // cuBLASLt: EPILOGUE_AUX_LD at least D's rows and divisible by 8.
        if (d->aux_ld < (int64_t)m || d->aux_ld % 8 != 0)
            return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: EPILOGUE_AUX_LD %lld is below m = %llu or not a multiple of 8", api,
                             (long long)d->aux_ld, (unsigned long long)m);
    }
    return CUBLAS_STATUS_SUCCESS;
}

SIM_API cublasStatus_t cublasLtMatmulAlgoGetHeuristic(LtHandle* h, LtDesc* d, LtLayout* A, LtLayout* B, LtLayout* C, LtLayout* D,
                                                      LtPref* pref, int requested, LtHeuristic* results, int* count) {
    const char* api = "cublasLtMatmulAlgoGetHeuristic";
    if (!live_lt(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s on %p, not a live handle", api, (void*)h);
    if (!pref || !results || !count || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    if (cublasStatus_t r = lt_check_shapes(api, d, A, B, C, D)) return r;
    LtHeuristic& res = results[0];
    memset(&res, 0, sizeof res);
    res.algo.tag = LT_ALGO_TAG;
    memcpy(res.algo.align, pref->align, sizeof pref->align);
    res.workspace_size = 0;
    res.state = CUBLAS_STATUS_SUCCESS;
    res.waves = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

static float gelu_tanh(float x) {
    // The kernels' form: x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), which is
    // 0.5 x (1 + tanh(u)).
    float u = 0.7978846f * (x + 0.044715f * (x * x * x));
    return x * (1.0f / (1.0f + expf(-2.0f * u)));
}

struct LtRun {
    Gemm g;      // the product; C is D, beta 0 (the residual is `c_in`)
    uint64_t c_in;
    int64_t ldc_in;
    float beta;
    int epilogue;
    uint64_t bias, aux;
    int bias_type;
    int64_t aux_ld;
};

static void run_lt(const LtRun& r) {
    const Gemm& g = r.g;
    size_t ea = type_size(g.at), eb = type_size(g.bt), ec = type_size(g.ct), ebias = type_size(r.bias_type);
    std::vector<float> ra((size_t)g.k), cb((size_t)g.k * g.n);
    const char* A = (const char*)g.a;
    const char* B = (const char*)g.b;
    for (int j = 0; j < g.n; ++j)
        for (int p = 0; p < g.k; ++p) {
            size_t at = g.tb == CUBLAS_OP_N ? (size_t)j * g.ldb + p : (size_t)p * g.ldb + j;
            cb[(size_t)j * g.k + p] = load(g.bt, B + at * eb);
        }
    // Every element of C is read before D is written: in place (C = D) stays exact.
    std::vector<float> out((size_t)g.m * g.n), pre(has_aux(r.epilogue) ? (size_t)g.m * g.n : 0);
    for (int row = 0; row < g.m; ++row) {
        for (int p = 0; p < g.k; ++p) {
            size_t at = g.ta == CUBLAS_OP_N ? (size_t)p * g.lda + row : (size_t)row * g.lda + p;
            ra[p] = load(g.at, A + at * ea);
        }
        float bias = has_bias(r.epilogue) ? load(r.bias_type, (const char*)r.bias + (size_t)row * ebias) : 0.0f;
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
            // beta = 0: C is not read (it may hold NaNs), as cuBLASLt specifies.
            if (r.beta != 0.0f) v += (double)r.beta * load(g.ct, (const char*)r.c_in + ((size_t)j * r.ldc_in + row) * ec);
            float x = (float)v;
            if (has_bias(r.epilogue)) x += bias;
            if (has_aux(r.epilogue)) pre[(size_t)j * g.m + row] = x;
            if (has_gelu(r.epilogue)) x = gelu_tanh(x);
            out[(size_t)j * g.m + row] = x;
        }
    }
    for (int j = 0; j < g.n; ++j)
        for (int row = 0; row < g.m; ++row) {
            store(g.ct, (char*)g.c + ((size_t)j * g.ldc + row) * ec, out[(size_t)j * g.m + row]);
            if (has_aux(r.epilogue))
                store(g.ct, (char*)r.aux + ((size_t)j * r.aux_ld + row) * ec, pre[(size_t)j * g.m + row]);
        }
}

SIM_API cublasStatus_t cublasLtMatmul(LtHandle* h, LtDesc* d, const void* alpha, const void* A, LtLayout* Ad, const void* B,
                                      LtLayout* Bd, const void* beta, const void* C, LtLayout* Cd, void* D, LtLayout* Dd,
                                      const LtAlgo* algo, void* workspace, size_t workspace_bytes, void* stream) {
    const char* api = "cublasLtMatmul";
    if (!live_lt(h)) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s on %p, not a live handle", api, (void*)h);
    if (current() != h->ctx)
        return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: the handle's context is not current on this thread", api);
    if (cublasStatus_t r = lt_check_shapes(api, d, Ad, Bd, Cd, Dd)) return r;
    if (!alpha || !beta) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: null alpha or beta", api);
    // With no algorithm cuBLASLt runs its heuristic with the default preferences: 256-byte
    // alignment of every matrix and no workspace.
    LtAlgo fallback{LT_ALGO_TAG, {256, 256, 256, 256}, {}};
    if (!algo) algo = &fallback;
    if (algo->tag != LT_ALGO_TAG) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: the algorithm is not one the heuristic returned", api);
    const char* names[4] = {"A", "B", "C", "D"};
    const void* ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; ++i)
        if ((uint64_t)ptrs[i] % algo->align[i] != 0)
            return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED,
                             "%s: %s at %p is not %u-byte aligned, as the algorithm chosen for the preferences' alignment needs "
                             "(set CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%s_BYTES to the operand's alignment)",
                             api, names[i], ptrs[i], algo->align[i], names[i]);
    LtRun r{};
    int m = (int)Dd->rows, n = (int)Dd->cols, k = (int)(d->ta == CUBLAS_OP_N ? Ad->cols : Ad->rows);
    r.g = Gemm{d->ta, d->tb, m, n, k, (int)Ad->ld, (int)Bd->ld, (int)Dd->ld, Ad->type, Bd->type, Dd->type, 1, 0, 0, 0,
               *(const float*)alpha, 0.0f, (uint64_t)A, (uint64_t)B, (uint64_t)D};
    r.c_in = (uint64_t)C;
    r.ldc_in = Cd->ld;
    r.beta = *(const float*)beta;
    r.epilogue = d->epilogue;
    r.bias = d->bias;
    r.bias_type = d->bias_type < 0 ? Dd->type : d->bias_type;
    r.aux = d->aux;
    r.aux_ld = d->aux_ld;
    if (Dd->ld != Cd->ld && C == D) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: C is D with another leading dimension", api);
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    int a_rows = (int)Ad->rows, b_rows = (int)Bd->rows;
    if (cublasStatus_t e = check_operand(api, "A", r.g.a, a_rows, (int)Ad->cols, (int)Ad->ld, 0, 1, type_size(Ad->type))) return e;
    if (cublasStatus_t e = check_operand(api, "B", r.g.b, b_rows, (int)Bd->cols, (int)Bd->ld, 0, 1, type_size(Bd->type))) return e;
    if (r.beta != 0.0f)
        if (cublasStatus_t e = check_operand(api, "C", r.c_in, m, n, (int)Cd->ld, 0, 1, type_size(Cd->type))) return e;
    if (cublasStatus_t e = check_operand(api, "D", r.g.c, m, n, (int)Dd->ld, 0, 1, type_size(Dd->type))) return e;
    if (has_bias(r.epilogue)) {
        if (!r.bias) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: a bias epilogue with no BIAS_POINTER", api);
        if (cublasStatus_t e = check_operand(api, "bias", r.bias, m, 1, m, 0, 1, type_size(r.bias_type))) return e;
    }
    if (has_aux(r.epilogue)) {
        if (!r.aux) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: a GELU_AUX epilogue with no EPILOGUE_AUX_POINTER", api);
        if (cublasStatus_t e = check_operand(api, "aux", r.aux, m, n, (int)r.aux_ld, 0, 1, type_size(Dd->type))) return e;
    }
    if (workspace_bytes > 0 && check_device((uint64_t)workspace, workspace_bytes, "cublasLtMatmul's workspace") != CUDA_SUCCESS)
        return CUBLAS_STATUS_INVALID_VALUE;
    Stream* s = resolve_stream(h->ctx, stream);
    if (!s) return blas_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %p is not a live stream of the handle's context", api, stream);
    {
        std::lock_guard<std::mutex> l(g_mu);
        g_counters.lt_matmuls++;
        if (!workspace || workspace_bytes == 0) g_counters.unplanned_workspaces++;
    }
    enqueue(s, Op{[r] {
                      run_lt(r);
                      return CUDA_SUCCESS;
                  },
                  {}});
    return CUBLAS_STATUS_SUCCESS;
}
