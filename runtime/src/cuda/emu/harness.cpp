// CPU check of the CUDA kernels' arithmetic and indexing, for machines without a GPU: the
// sources run under cuda_emu.h (one std::thread per CUDA thread, real barriers and warp
// exchanges) against naive f64 references written from runtime/src/kernels/. It validates
// semantics, not the GPU memory model or speed. From the repository root:
//
//   g++ -std=c++20 -O1 -pthread -Wno-unknown-pragmas -o /tmp/cuda_emu \
//       runtime/src/cuda/emu/harness.cpp && /tmp/cuda_emu
//
// (about a minute on two cores; prints one line per check and exits non-zero on a failure).
#include "cuda_emu.h"
#include <random>
#include <string>
// The 16-byte accesses of common.cuh's `ldv` / `stv` (its PT_VECTOR_ACCESS hook), so a check
// can tell which path a launch took; one-element `Vec`s are scalar accesses and not counted.
static std::atomic<long long> vector_accesses{0};
void pt_vector_access(int n) {
    if (n > 1) vector_accesses.fetch_add(1, std::memory_order_relaxed);
}
#define PT_COUNT_VECTOR_ACCESSES
#include "../kernels/common.cuh"
#include "../kernels/activation.cu"
#include "../kernels/add.cu"
#include "../kernels/cast.cu"
#include "../kernels/embedding.cu"
#include "../kernels/norm.cu"
#include "../kernels/reduce.cu"
#include "../kernels/rope.cu"
#include "../kernels/attention.cu"
#include "../kernels/cross_entropy.cu"
#include "../kernels/adamw.cu"
#include "../kernels/moe.cu"

static int failures = 0;
static std::mt19937 rng(42);
std::vector<float> rnd(size_t n, float s = 1.0f) { std::uniform_real_distribution<float> d(-s, s); std::vector<float> v(n); for (auto& x : v) x = d(rng); return v; }
void close(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    double worst = 0; size_t at = 0;
    if (got.size() != want.size()) { printf("FAIL %s: size %zu vs %zu\n", what, got.size(), want.size()); failures++; return; }
    for (size_t i = 0; i < got.size(); ++i) {
        double e = std::fabs(got[i] - want[i]) / (1.0 + std::fabs(want[i]));
        if (!(e <= worst)) { worst = e; at = i; }
    }
    bool ok = worst <= tol;
    if (!ok) failures++;
    printf("%s %s: max rel err %.3g at %zu (got %.9g want %.9g)\n", ok ? "ok  " : "FAIL", what, worst, at, got.empty() ? 0.0 : got[at], want.empty() ? 0.0 : want[at]);
}
std::vector<double> dbl(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
dim3 G(unsigned x, unsigned y = 1, unsigned z = 1) { return dim3(x, y, z); }
std::vector<bf16> tobf(const std::vector<float>& v) { std::vector<bf16> r(v.size()); for (size_t i = 0; i < v.size(); ++i) r[i] = from_f32<bf16>(v[i]); return r; }
std::vector<float> fromb(const std::vector<bf16>& v) { std::vector<float> r(v.size()); for (size_t i = 0; i < v.size(); ++i) r[i] = to_f32(v[i]); return r; }
std::vector<f16> toh(const std::vector<float>& v) { std::vector<f16> r(v.size()); for (size_t i = 0; i < v.size(); ++i) r[i] = from_f32<f16>(v[i]); return r; }
std::vector<float> fromh(const std::vector<f16>& v) { std::vector<float> r(v.size()); for (size_t i = 0; i < v.size(); ++i) r[i] = to_f32(v[i]); return r; }
/// The compiler's IEEE binary16 (`_Float16`, round to nearest even): the reference the
/// hand-written f16 conversions of common.cuh are checked against.
float ref_round_f16(float x) { return (float)(_Float16)x; }

void test_activation() {
    const i64 n = 1000;
    auto x = rnd(n, 6), d = rnd(n), u = rnd(n, 3);
    std::vector<float> o(n), o2(n);
    std::vector<double> w(n), w2(n);
    auto gelu = [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); };
    auto num = [](auto f, double x) { double h = 1e-6; return (f(x + h) - f(x - h)) / (2 * h); };
    auto silu = [](double x) { return x / (1 + std::exp(-x)); };
    launch(G(3), G(256), [&] { gelu_forward_f32(o.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = gelu(x[i]);
    close("gelu fwd", o, w, 1e-6);
    launch(G(3), G(256), [&] { gelu_backward_f32(o.data(), d.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = d[i] * num(gelu, x[i]);
    close("gelu bwd", o, w, 1e-5);
    launch(G(3), G(256), [&] { silu_forward_f32(o.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = silu(x[i]);
    close("silu fwd", o, w, 1e-6);
    launch(G(3), G(256), [&] { silu_backward_f32(o.data(), d.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = d[i] * num(silu, x[i]);
    close("silu bwd", o, w, 1e-5);
    launch(G(3), G(256), [&] { relu_forward_f32(o.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = x[i] > 0 ? x[i] : 0;
    close("relu fwd", o, w, 0);
    launch(G(3), G(256), [&] { relu_backward_f32(o.data(), d.data(), x.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = x[i] > 0 ? d[i] : 0;
    close("relu bwd", o, w, 0);
    launch(G(3), G(256), [&] { swiglu_forward_f32(o.data(), x.data(), u.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = silu(x[i]) * u[i];
    close("swiglu fwd", o, w, 1e-6);
    launch(G(3), G(256), [&] { swiglu_backward_f32(o.data(), o2.data(), d.data(), x.data(), u.data(), n); });
    for (int i = 0; i < n; ++i) { w[i] = d[i] * u[i] * num(silu, x[i]); w2[i] = d[i] * silu(x[i]); }
    close("swiglu bwd dgate", o, w, 1e-5);
    close("swiglu bwd dup", o2, w2, 1e-6);
    {
        // Phi-3's packed rows [gate | up] of width W: the same arithmetic on the two halves.
        const int W = 37, rows = 9;
        auto px = rnd((size_t)rows * 2 * W, 6), pd = rnd((size_t)rows * W);
        std::vector<float> po((size_t)rows * W, NAN), pdx((size_t)rows * 2 * W, NAN);
        std::vector<double> pw((size_t)rows * W), pwdx((size_t)rows * 2 * W);
        launch(G(2), G(256), [&] { packed_swiglu_forward_f32(po.data(), px.data(), W, (i64)rows * W); });
        for (int r = 0; r < rows; ++r) for (int c = 0; c < W; ++c) { double g = px[r * 2 * W + c], u = px[r * 2 * W + W + c]; pw[r * W + c] = silu(g) * u; }
        close("packed swiglu fwd", po, pw, 1e-6);
        launch(G(2), G(256), [&] { packed_swiglu_backward_f32(pdx.data(), pd.data(), px.data(), W, (i64)rows * W); });
        for (int r = 0; r < rows; ++r) for (int c = 0; c < W; ++c) {
            double g = px[r * 2 * W + c], u = px[r * 2 * W + W + c], dd = pd[r * W + c];
            pwdx[r * 2 * W + c] = dd * u * num(silu, g);
            pwdx[r * 2 * W + W + c] = dd * silu(g);
        }
        close("packed swiglu bwd", pdx, pwdx, 1e-5);
    }
    launch(G(3), G(256), [&] { geglu_forward_f32(o.data(), x.data(), u.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = gelu(x[i]) * u[i];
    close("geglu fwd", o, w, 1e-6);
    launch(G(3), G(256), [&] { geglu_backward_f32(o.data(), o2.data(), d.data(), x.data(), u.data(), n); });
    for (int i = 0; i < n; ++i) { w[i] = d[i] * u[i] * num(gelu, x[i]); w2[i] = d[i] * gelu(x[i]); }
    close("geglu bwd dgate", o, w, 1e-5);
    close("geglu bwd dup", o2, w2, 1e-6);
    auto cap = [](double x) { return 2.0 * std::tanh(x / 2.0); };
    launch(G(3), G(256), [&] { softcap_forward_f32(o.data(), x.data(), 2.0f, n); });
    for (int i = 0; i < n; ++i) w[i] = cap(x[i]);
    close("softcap fwd", o, w, 1e-6);
    std::vector<float> y(o);
    launch(G(3), G(256), [&] { softcap_backward_f32(o.data(), d.data(), y.data(), 2.0f, n); });
    for (int i = 0; i < n; ++i) w[i] = d[i] * num(cap, x[i]);
    close("softcap bwd", o, w, 1e-5);
    launch(G(3), G(256), [&] { scale_forward_f32(o.data(), x.data(), 1.5f, n); });
    for (int i = 0; i < n; ++i) w[i] = 1.5 * x[i];
    close("scale fwd", o, w, 1e-7);
    // bf16 variant: same function on rounded inputs, result rounded.
    auto xb = tobf(x); std::vector<bf16> ob(n);
    launch(G(2), G(256), [&] { gelu_forward_bf16(ob.data(), xb.data(), n); });
    auto xr = fromb(xb);
    for (int i = 0; i < n; ++i) w[i] = gelu(xr[i]);
    close("gelu fwd bf16", fromb(ob), w, 4e-3);
}

void test_add_cast() {
    const i64 n = 777; const int cols = 37; const i64 rows = 21;
    auto a = rnd(n), b = rnd(n); std::vector<float> o(n), o2(n); std::vector<double> w(n);
    launch(G(2), G(256), [&] { add_forward_f32(o.data(), a.data(), b.data(), n); });
    for (int i = 0; i < n; ++i) w[i] = (double)(a[i] + b[i]);
    close("add fwd", o, w, 0);
    // accumulate_grad runs add_forward in place (acc += grad): three micro-batches into a
    // zeroed accumulator, in order, exactly as the host sums them (bf16: f32 sum, rounded once
    // per micro-batch to nearest even).
    {
        std::vector<float> acc(n, 0.0f); std::vector<double> wacc(n, 0.0);
        std::vector<bf16> accb(n, from_f32<bf16>(0.0f)); std::vector<double> waccb(n, 0.0);
        for (int m = 0; m < 3; ++m) {
            auto g = rnd(n); auto gb = tobf(g); auto gr = fromb(gb);
            launch(G(2), G(256), [&] { add_forward_f32(acc.data(), acc.data(), g.data(), n); });
            launch(G(2), G(256), [&] { add_forward_bf16(accb.data(), accb.data(), gb.data(), n); });
            for (int i = 0; i < n; ++i) {
                wacc[i] = (double)((float)wacc[i] + g[i]);
                waccb[i] = (double)to_f32(from_f32<bf16>((float)waccb[i] + gr[i]));
            }
        }
        close("accumulate_grad in place", acc, wacc, 0);
        close("accumulate_grad in place bf16", fromb(accb), waccb, 0);
    }
    launch(G(2), G(256), [&] { add_backward_f32(o.data(), o2.data(), a.data(), n); });
    close("add bwd da", o, dbl(a), 0); close("add bwd db", o2, dbl(a), 0);
    auto x = rnd(rows * cols), bias = rnd(cols); std::vector<float> y(rows * cols); std::vector<double> wy(rows * cols);
    launch(G(2), G(256), [&] { bias_add_f32(y.data(), x.data(), bias.data(), rows, cols); });
    for (i64 i = 0; i < rows * cols; ++i) wy[i] = (double)(x[i] + bias[i % cols]);
    close("bias_add", y, wy, 0);
    // RNE: 1 + 2^-8 is a tie -> 1; 1 + 3*2^-8 -> 1 + 2^-6 (up to even); NaN stays NaN.
    std::vector<float> c = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, NAN, INFINITY, 3.0e38f};
    std::vector<bf16> cb(c.size()); std::vector<float> back(c.size());
    launch(G(1), G(32), [&] { cast_f32_to_bf16(cb.data(), c.data(), (i64)c.size()); });
    launch(G(1), G(32), [&] { cast_bf16_to_f32(back.data(), cb.data(), (i64)c.size()); });
    bool ok = back[0] == 1.0f && back[1] == 1.0f + 4.0f / 256 && back[2] == -2.5f && std::isnan(back[3]) && back[4] == INFINITY && back[5] > 2.9e38f;
    printf("%s casts: %g %g %g %g %g %g\n", ok ? "ok  " : "FAIL", back[0], back[1], back[2], back[3], back[4], back[5]);
    if (!ok) failures++;
}

void test_embedding() {
    const int V = 11, C = 300, N = 70;
    std::vector<int> tok(N); for (int i = 0; i < N; ++i) tok[i] = (i * 7 + i / 5) % (V - 2); // rows V-2, V-1 absent
    tok[3] = 4; tok[50] = 4;
    auto table = rnd((size_t)V * C), dout = rnd((size_t)N * C);
    std::vector<float> out((size_t)N * C); std::vector<double> w((size_t)N * C);
    launch(G(5), G(256), [&] { embedding_forward_f32(out.data(), tok.data(), table.data(), N, V, C); });
    for (int n = 0; n < N; ++n) for (int c = 0; c < C; ++c) w[(size_t)n * C + c] = table[(size_t)tok[n] * C + c];
    close("embedding fwd", out, w, 0);
    int bad = -7; std::vector<int> tb = tok; tb[33] = V; tb[60] = -1;
    launch(G(1), G(1024), [&] { check_tokens(&bad, tb.data(), N, V); });
    printf("%s check_tokens first bad %d\n", bad == 33 ? "ok  " : "FAIL", bad); if (bad != 33) failures++;
    launch(G(1), G(1024), [&] { check_tokens(&bad, tok.data(), N, V); });
    printf("%s check_tokens none bad -> %d\n", bad == N ? "ok  " : "FAIL", bad); if (bad != N) failures++;
    std::vector<int> span(2 * V);
    launch(G(2), G(64), [&] { embedding_backward_span(span.data(), tok.data(), N, V, 0); });
    launch(G(2), G(64), [&] { embedding_backward_span(span.data(), tok.data(), N, V, 1); });
    for (int pad : {-1, 4}) for (int acc : {0, 1}) {
        std::vector<float> dt = rnd((size_t)V * C), dt0 = dt;
        launch(G(V, (C + 255) / 256), G(256), [&] { embedding_backward_f32(dt.data(), dout.data(), tok.data(), span.data(), N, V, C, acc, pad); });
        std::vector<float> ref((size_t)V * C);
        for (int v = 0; v < V; ++v) for (int c = 0; c < C; ++c) {
            float s = acc ? dt0[(size_t)v * C + c] : 0.0f;
            if (v != pad) for (int n = 0; n < N; ++n) if (tok[n] == v) s += dout[(size_t)n * C + c];
            ref[(size_t)v * C + c] = s;
        }
        close(("embedding bwd (bit-exact) pad " + std::to_string(pad) + " acc " + std::to_string(acc)).c_str(), dt, dbl(ref), 0);
    }
    // position embedding, offset 2
    const int B = 3, T = 5, P = 9, off = 2;
    auto pt = rnd((size_t)P * C), pd = rnd((size_t)B * T * C);
    std::vector<float> po((size_t)B * T * C); std::vector<double> pw((size_t)B * T * C);
    launch(G(4), G(256), [&] { position_embedding_forward_f32(po.data(), pt.data(), B, T, C, off); });
    for (int b = 0; b < B; ++b) for (int t = 0; t < T; ++t) for (int c = 0; c < C; ++c) pw[((size_t)b * T + t) * C + c] = pt[(size_t)(off + t) * C + c];
    close("position fwd", po, pw, 0);
    std::vector<float> pg((size_t)P * C, 5.0f); std::vector<double> pgw((size_t)P * C, 0.0);
    launch(G(4), G(256), [&] { position_embedding_backward_f32(pg.data(), pd.data(), B, T, C, off, P, 0); });
    for (int p = off; p < off + T; ++p) for (int c = 0; c < C; ++c) { float s = 0; for (int b = 0; b < B; ++b) s += pd[((size_t)b * T + p - off) * C + c]; pgw[(size_t)p * C + c] = s; }
    close("position bwd", pg, pgw, 0);
}

void test_norm() {
    const int R = 300, C = 333; const float eps = 1e-5f;
    auto x = rnd((size_t)R * C, 2), wt = rnd(C), bs = rnd(C), dout = rnd((size_t)R * C);
    for (int i = 0; i < R * C; ++i) x[i] += 0.5f; // nonzero mean
    std::vector<float> out((size_t)R * C), mean(R), rstd(R), dx((size_t)R * C);
    launch(G(7), G(256), [&] { layer_norm_forward_f32(out.data(), mean.data(), rstd.data(), x.data(), wt.data(), bs.data(), R, C, eps); });
    std::vector<double> w((size_t)R * C), wdx((size_t)R * C), wdw(C, 0), wdb(C, 0);
    for (int r = 0; r < R; ++r) {
        double mu = 0, var = 0; for (int c = 0; c < C; ++c) mu += x[(size_t)r * C + c]; mu /= C;
        for (int c = 0; c < C; ++c) var += std::pow(x[(size_t)r * C + c] - mu, 2); var /= C;
        double rs = 1 / std::sqrt(var + eps), gs = 0, gns = 0;
        for (int c = 0; c < C; ++c) { double n = (x[(size_t)r * C + c] - mu) * rs; w[(size_t)r * C + c] = n * wt[c] + bs[c];
            double g = dout[(size_t)r * C + c] * wt[c]; gs += g; gns += g * n; wdw[c] += dout[(size_t)r * C + c] * n; wdb[c] += dout[(size_t)r * C + c]; }
        for (int c = 0; c < C; ++c) { double n = (x[(size_t)r * C + c] - mu) * rs; wdx[(size_t)r * C + c] = (dout[(size_t)r * C + c] * wt[c] - gs / C - n * gns / C) * rs; }
    }
    close("layer_norm fwd", out, w, 1e-5);
    launch(G(7), G(256), [&] { layer_norm_backward_f32(dx.data(), dout.data(), x.data(), wt.data(), mean.data(), rstd.data(), R, C); });
    close("layer_norm bwd dx", dx, wdx, 1e-5);
    const int rpc = 64, chunks = (R + rpc - 1) / rpc;
    std::vector<float> pw((size_t)chunks * C), pb((size_t)chunks * C), dw(C, 1.0f), db(C);
    launch(G((C + 127) / 128, chunks), G(32, 8), [&] { norm_backward_params_partial_f32(pw.data(), pb.data(), dout.data(), x.data(), mean.data(), rstd.data(), R, C, rpc); });
    launch(G(2), G(256), [&] { column_sum_finish_f32(dw.data(), pw.data(), chunks, C, 0); });
    launch(G(2), G(256), [&] { column_sum_finish_f32(db.data(), pb.data(), chunks, C, 0); });
    close("layer_norm bwd dweight", dw, wdw, 1e-5);
    close("layer_norm bwd dbias", db, wdb, 1e-5);
    launch(G(2), G(256), [&] { column_sum_finish_f32(db.data(), pb.data(), chunks, C, 1); });
    std::vector<double> w2db(C); for (int c = 0; c < C; ++c) w2db[c] = 2 * wdb[c];
    close("layer_norm bwd dbias accumulate", db, w2db, 1e-5);
    // bias grad via column sums
    std::vector<float> cp((size_t)chunks * C), cs(C);
    launch(G((C + 31) / 32, chunks), G(32, 8), [&] { column_sum_partial_f32(cp.data(), dout.data(), R, C, rpc); });
    launch(G(2), G(256), [&] { column_sum_finish_f32(cs.data(), cp.data(), chunks, C, 0); });
    close("column_sum (bias grad)", cs, wdb, 1e-5);
    // RMS
    const float e2 = 1e-6f;
    std::vector<float> rr(R);
    launch(G(7), G(256), [&] { rms_norm_forward_f32(out.data(), rr.data(), x.data(), wt.data(), R, C, e2, 0); });
    std::fill(wdw.begin(), wdw.end(), 0.0);
    for (int r = 0; r < R; ++r) {
        double ms = 0; for (int c = 0; c < C; ++c) ms += std::pow(x[(size_t)r * C + c], 2); ms /= C;
        double rs = 1 / std::sqrt(ms + e2), gns = 0;
        for (int c = 0; c < C; ++c) { double n = x[(size_t)r * C + c] * rs; w[(size_t)r * C + c] = wt[c] * n; gns += dout[(size_t)r * C + c] * wt[c] * n; wdw[c] += dout[(size_t)r * C + c] * n; }
        for (int c = 0; c < C; ++c) { double n = x[(size_t)r * C + c] * rs; wdx[(size_t)r * C + c] = (dout[(size_t)r * C + c] * wt[c] - n * gns / C) * rs; }
    }
    close("rms_norm fwd", out, w, 1e-5);
    launch(G(7), G(256), [&] { rms_norm_backward_f32(dx.data(), dout.data(), x.data(), wt.data(), rr.data(), R, C, 0); });
    close("rms_norm bwd dx", dx, wdx, 1e-5);
    launch(G((C + 127) / 128, chunks), G(32, 8), [&] { norm_backward_params_partial_f32(pw.data(), nullptr, dout.data(), x.data(), nullptr, rr.data(), R, C, rpc); });
    launch(G(2), G(256), [&] { column_sum_finish_f32(dw.data(), pw.data(), chunks, C, 0); });
    close("rms_norm bwd dweight", dw, wdw, 1e-5);
    // RMS per head of D = 37 (C = 333 = 9 heads) with a `1 + weight` scale (Qwen3's q_norm on
    // Gemma's RMSNorm): each head of each row normalised alone, the weight [D] shared.
    {
        const int D = 37, H = C / D, HR = R * H, hchunks = (HR + rpc - 1) / rpc;
        std::vector<float> hw(wt.begin(), wt.begin() + D), hr(HR), hdw(D), hpw((size_t)hchunks * D);
        std::vector<double> want((size_t)R * C), wantdx((size_t)R * C), wantdw(D, 0.0);
        for (int g = 0; g < HR; ++g) {
            const size_t b = (size_t)g * D;
            double ms = 0; for (int c = 0; c < D; ++c) ms += std::pow(x[b + c], 2); ms /= D;
            double rs = 1 / std::sqrt(ms + e2), gns = 0;
            for (int c = 0; c < D; ++c) { double n = x[b + c] * rs, s = 1.0 + hw[c]; want[b + c] = s * n; gns += dout[b + c] * s * n; wantdw[c] += dout[b + c] * n; }
            for (int c = 0; c < D; ++c) { double n = x[b + c] * rs; wantdx[b + c] = (dout[b + c] * (1.0 + hw[c]) - n * gns / D) * rs; }
        }
        launch(G(7), G(256), [&] { rms_norm_forward_f32(out.data(), hr.data(), x.data(), hw.data(), HR, D, e2, 1); });
        close("rms_norm per head, unit offset fwd", out, want, 1e-5);
        launch(G(7), G(256), [&] { rms_norm_backward_f32(dx.data(), dout.data(), x.data(), hw.data(), hr.data(), HR, D, 1); });
        close("rms_norm per head, unit offset bwd dx", dx, wantdx, 1e-5);
        launch(G((D + 127) / 128, hchunks), G(32, 8), [&] { norm_backward_params_partial_f32(hpw.data(), nullptr, dout.data(), x.data(), nullptr, hr.data(), HR, D, rpc); });
        launch(G(2), G(256), [&] { column_sum_finish_f32(hdw.data(), hpw.data(), hchunks, D, 0); });
        close("rms_norm per head, unit offset bwd dweight", hdw, wantdw, 1e-5);
    }
    // bf16 layer norm forward
    auto xb = tobf(x), wb = tobf(wt), bb = tobf(bs); std::vector<bf16> ob((size_t)R * C);
    launch(G(7), G(256), [&] { layer_norm_forward_bf16(ob.data(), mean.data(), rstd.data(), xb.data(), wb.data(), bb.data(), R, C, eps); });
    std::vector<float> ln32((size_t)R * C); auto xr = fromb(xb), wr = fromb(wb), br = fromb(bb);
    launch(G(7), G(256), [&] { layer_norm_forward_f32(ln32.data(), mean.data(), rstd.data(), xr.data(), wr.data(), br.data(), R, C, eps); });
    close("layer_norm fwd bf16 vs f32 on the same inputs", fromb(ob), dbl(ln32), 8e-3);
}

/// Whole heads (R = D, every head rotated, factor 1), then Phi-3's forms: a partial rotary
/// width, heads past `rot` copied whole, cos and sin scaled by an attention factor.
void test_rope_case(const char* what, int B, int T, int H, int D, int R, int rot, float factor) {
    std::vector<float> inv(R / 2); for (int i = 0; i < R / 2; ++i) inv[i] = 1.0f / std::pow(10000.0f, 2.0f * i / R);
    auto x = rnd((size_t)B * T * H * D); std::vector<float> o(x.size(), NAN), back(x.size(), NAN); std::vector<double> w(x.size());
    launch(G(2), G(256), [&] { rope_forward_f32(o.data(), x.data(), inv.data(), B, T, H, D, R, rot, factor); });
    for (int b = 0; b < B; ++b) for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) for (int i = 0; i < D; ++i) {
        size_t base = (((size_t)b * T + t) * H + h) * D;
        if (h >= rot || i >= R) { w[base + i] = x[base + i]; continue; }
        int j = i % (R / 2); double a = (double)(float)((float)t * inv[j]);
        double rot_x = i < R / 2 ? -x[base + i + R / 2] : x[base + i - R / 2];
        w[base + i] = (x[base + i] * std::cos(a) + rot_x * std::sin(a)) * factor;
    }
    std::string name = std::string(what) + " fwd";
    close(name.c_str(), o, w, 1e-6);
    // The backward is the transposed rotation: applied to the forward's output it gives
    // x * factor^2 in the rotated part and x elsewhere.
    launch(G(2), G(256), [&] { rope_backward_f32(back.data(), o.data(), inv.data(), B, T, H, D, R, rot, factor); });
    for (int b = 0; b < B; ++b) for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) for (int i = 0; i < D; ++i) {
        size_t at = (((size_t)b * T + t) * H + h) * D + i;
        w[at] = (h >= rot || i >= R) ? x[at] : (double)x[at] * factor * factor;
    }
    name = std::string(what) + " bwd (inverse rotation of fwd)";
    close(name.c_str(), back, w, 1e-6);
}

void test_rope() {
    test_rope_case("rope", 2, 9, 3, 16, 16, 3, 1.0f);
    test_rope_case("rope scaled (yarn's attention factor)", 2, 9, 3, 16, 16, 3, 1.1386f);
    test_rope_case("partial rope (packed qkv, v copied, longrope factor)", 2, 9, 8, 16, 16, 6, 1.0408f);
    test_rope_case("partial rope (rotary 10 of 16)", 1, 7, 3, 16, 10, 3, 1.0f);
    test_rope_case("partial rope (rotary 6 of 10 in 2 of 5 heads)", 2, 5, 5, 10, 6, 2, 1.25f);
}

struct AttnRef { std::vector<double> out, lse, dq, dk, dv; };
AttnRef attn_naive(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dout,
                   int B, int T, int H, int KV, int D, int W, int qs, int ks, int qo, int ko, int vo) {
    AttnRef r; r.out.assign((size_t)B * T * H * D, 0); r.lse.assign((size_t)B * H * T, 0);
    r.dq.assign((size_t)B * T * H * D, 0); r.dk.assign((size_t)B * T * KV * D, 0); r.dv.assign((size_t)B * T * KV * D, 0);
    double sc = 1 / std::sqrt((double)D);
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
        int kvh = h / (H / KV);
        for (int t = 0; t < T; ++t) {
            std::vector<double> s(T, -INFINITY), p(T, 0);
            for (int j = 0; j <= t; ++j) { if (W > 0 && j <= t - W) continue; double d = 0;
                for (int e = 0; e < D; ++e) d += (double)q[((size_t)b * T + t) * qs + qo + h * D + e] * k[((size_t)b * T + j) * ks + ko + kvh * D + e]; s[j] = d * sc; }
            double m = -INFINITY; for (double x : s) m = std::max(m, x);
            double z = 0; for (double x : s) z += std::exp(x - m);
            r.lse[((size_t)b * H + h) * T + t] = m + std::log(z);
            for (int j = 0; j < T; ++j) p[j] = std::exp(s[j] - m) / z;
            std::vector<double> o(D, 0);
            for (int j = 0; j < T; ++j) for (int e = 0; e < D; ++e) o[e] += p[j] * v[((size_t)b * T + j) * ks + vo + kvh * D + e];
            for (int e = 0; e < D; ++e) r.out[((size_t)b * T + t) * H * D + h * D + e] = o[e];
            // backward
            std::vector<double> dp(T, 0); double delta = 0;
            for (int j = 0; j < T; ++j) for (int e = 0; e < D; ++e) dp[j] += (double)dout[((size_t)b * T + t) * H * D + h * D + e] * v[((size_t)b * T + j) * ks + vo + kvh * D + e];
            for (int j = 0; j < T; ++j) delta += p[j] * dp[j];
            for (int j = 0; j < T; ++j) {
                double ds = p[j] * (dp[j] - delta) * sc;
                for (int e = 0; e < D; ++e) {
                    r.dq[((size_t)b * T + t) * H * D + h * D + e] += ds * k[((size_t)b * T + j) * ks + ko + kvh * D + e];
                    r.dk[((size_t)b * T + j) * KV * D + kvh * D + e] += ds * q[((size_t)b * T + t) * qs + qo + h * D + e];
                    r.dv[((size_t)b * T + j) * KV * D + kvh * D + e] += p[j] * dout[((size_t)b * T + t) * H * D + h * D + e];
                }
            }
        }
    }
    return r;
}

void test_attention(int B, int T, int H, int KV, int D, int W, bool packed) {
    char name[160]; snprintf(name, sizeof name, "attention B%d T%d H%d KV%d D%d W%d %s", B, T, H, KV, D, W, packed ? "packed" : "separate");
    int qs, ks, ko = 0, vo = 0;
    std::vector<float> q, k, v, qkv;
    if (packed) { qs = ks = (H + 2 * KV) * D; qkv = rnd((size_t)B * T * qs, 2); ko = H * D; vo = (H + KV) * D; }
    else { qs = H * D; ks = KV * D; q = rnd((size_t)B * T * qs, 2); k = rnd((size_t)B * T * ks, 2); v = rnd((size_t)B * T * ks, 2); }
    const float* qp = packed ? qkv.data() : q.data(); const float* kp = packed ? qkv.data() + ko : k.data(); const float* vp = packed ? qkv.data() + vo : v.data();
    auto dout = rnd((size_t)B * T * H * D);
    std::vector<float> out((size_t)B * T * H * D), lse((size_t)B * H * T), delta((size_t)B * H * T);
    launch(G((T + 15) / 16, H, B), G(128), [&] { attention_forward_f32(out.data(), lse.data(), qp, kp, vp, B, T, H, KV, D, W, qs, ks); });
    auto ref = packed ? attn_naive(qkv, qkv, qkv, dout, B, T, H, KV, D, W, qs, ks, 0, ko, vo) : attn_naive(q, k, v, dout, B, T, H, KV, D, W, qs, ks, 0, 0, 0);
    close((std::string(name) + " out").c_str(), out, ref.out, 2e-6);
    close((std::string(name) + " lse").c_str(), lse, ref.lse, 2e-6);
    launch(G(3), G(128), [&] { attention_backward_delta_f32(delta.data(), out.data(), dout.data(), B, T, H, D); });
    std::vector<float> dq, dk, dv, dqkv; float *dqp, *dkp, *dvp;
    if (packed) { dqkv.assign((size_t)B * T * qs, NAN); dqp = dqkv.data(); dkp = dqkv.data() + ko; dvp = dqkv.data() + vo; }
    else { dq.assign((size_t)B * T * qs, NAN); dk.assign((size_t)B * T * ks, NAN); dv.assign((size_t)B * T * ks, NAN); dqp = dq.data(); dkp = dk.data(); dvp = dv.data(); }
    launch(G((T + 7) / 8, H, B), G(128), [&] { attention_backward_dq_f32(dqp, dout.data(), qp, kp, vp, lse.data(), delta.data(), B, T, H, KV, D, W, qs, ks); });
    launch(G((T + 7) / 8, KV, B), G(128), [&] { attention_backward_dkv_f32(dkp, dvp, dout.data(), qp, kp, vp, lse.data(), delta.data(), B, T, H, KV, D, W, qs, ks); });
    if (packed) {
        dq.resize((size_t)B * T * H * D); dk.resize((size_t)B * T * KV * D); dv.resize(dk.size());
        for (size_t r = 0; r < (size_t)B * T; ++r) {
            for (int e = 0; e < H * D; ++e) dq[r * H * D + e] = dqkv[r * qs + e];
            for (int e = 0; e < KV * D; ++e) { dk[r * KV * D + e] = dqkv[r * qs + ko + e]; dv[r * KV * D + e] = dqkv[r * qs + vo + e]; }
        }
    }
    close((std::string(name) + " dq").c_str(), dq, ref.dq, 5e-6);
    close((std::string(name) + " dk").c_str(), dk, ref.dk, 5e-6);
    close((std::string(name) + " dv").c_str(), dv, ref.dv, 5e-6);
}

// The GEMM path's row kernels: scores of `n` heads [n, T, T] (f32), each row softmaxed in place
// (P in the storage type over the f32 row, ld T * 4 / sizeof(storage)), then the backward's
// P and dS = P (dP - delta) scale, against f64 softmax with the causal / window mask.
template <typename S>
void test_attention_rows(int n, int T, int W, int threads, float cap = 0.0f) {
    char name[160]; snprintf(name, sizeof name, "attention rows n%d T%d W%d %s x%d cap%g", n, T, W, sizeof(S) == 2 ? "bf16" : "f32", threads, cap);
    // Gemma 2's soft-cap of the scores, and its derivative.
    auto capped = [&](double x) { return cap > 0 ? cap * std::tanh(x / cap) : x; };
    auto dcap = [&](double x) { double th = cap > 0 ? std::tanh(x / cap) : 0.0; return 1.0 - th * th; };
    const int hs = 3 * T;  // lse / delta head stride (the heads of a GQA group lie apart)
    const size_t tt = (size_t)n * T * T;
    const int ldp = T * 4 / (int)sizeof(S);
    const float scale = 0.125f;
    auto s0 = rnd(tt, 4), dp0 = rnd(tt, 2), delta_all = rnd((size_t)n * hs + 5);
    const float* delta = delta_all.data() + 5;
    auto scores = s0;
    const i64 first = 5;  // the batch's first row in lse / delta
    std::vector<float> lse_all((size_t)n * hs + first, NAN);
    launch(G(T, n), G(threads), [&] { attention_softmax<S>(scores.data(), lse_all.data(), first, T, W, hs, cap); });
    const float* lse = lse_all.data() + first;
    auto visible = [&](int t, int c) { return c <= t && (W <= 0 || c > t - W); };
    std::vector<float> got_p(tt), got_lse((size_t)n * T), got_ds(tt);
    std::vector<double> want_p(tt), want_lse((size_t)n * T), want_ds(tt);
    for (int i = 0; i < n; ++i) for (int t = 0; t < T; ++t) {
        const float* row = &s0[((size_t)i * T + t) * T];
        double m = -INFINITY, z = 0;
        for (int c = 0; c < T; ++c) if (visible(t, c)) m = std::max(m, capped(row[c]));
        for (int c = 0; c < T; ++c) if (visible(t, c)) z += std::exp(capped(row[c]) - m);
        want_lse[(size_t)i * T + t] = m + std::log(z);
        got_lse[(size_t)i * T + t] = lse[(size_t)i * hs + t];
        const S* p = reinterpret_cast<const S*>(&scores[((size_t)i * T + t) * T]);
        for (int c = 0; c < T; ++c) {
            want_p[((size_t)i * T + t) * T + c] = visible(t, c) ? std::exp(capped(row[c]) - m) / z : 0.0;
            got_p[((size_t)i * T + t) * T + c] = to_f32(p[c]);
        }
    }
    const double tol = sizeof(S) == 2 ? 4e-3 : 2e-6;
    close((std::string(name) + " softmax P").c_str(), got_p, want_p, tol);
    close((std::string(name) + " lse").c_str(), got_lse, want_lse, 2e-6);
    // Backward, from the f32 scores and the lse the forward wrote.
    scores = s0;
    auto dp = dp0;
    launch(G(T, n), G(threads), [&] { attention_backward_ds<S>(scores.data(), dp.data(), lse_all.data(), delta_all.data(), first, T, W, hs, scale, cap); });
    for (int i = 0; i < n; ++i) for (int t = 0; t < T; ++t) {
        const size_t r = ((size_t)i * T + t) * T;
        const S* p = reinterpret_cast<const S*>(&scores[r]);
        const S* ds = reinterpret_cast<const S*>(&dp[r]);
        for (int c = 0; c < T; ++c) {
            got_p[r + c] = to_f32(p[c]);
            got_ds[r + c] = to_f32(ds[c]);
            const double pv = visible(t, c) ? std::exp(capped(s0[r + c]) - lse[(size_t)i * hs + t]) : 0.0;
            want_ds[r + c] = pv * (dp0[r + c] - (double)delta[(size_t)i * hs + t]) * dcap(s0[r + c]) * scale;
        }
    }
    close((std::string(name) + " backward P").c_str(), got_p, want_p, tol);
    close((std::string(name) + " dS").c_str(), got_ds, want_ds, tol);
    (void)ldp;
}

void test_cross_entropy() {
    const int N = 13, V = 1000;
    auto logits = rnd((size_t)N * V, 8); std::vector<int> tg(N); for (int i = 0; i < N; ++i) tg[i] = (i * 97) % V;
    std::vector<float> lse(N), rl(N), loss(1), dl((size_t)N * V);
    launch(G(4), G(256), [&] { cross_entropy_forward_f32(lse.data(), rl.data(), logits.data(), tg.data(), N, V, V); });
    launch(G(1), G(1024), [&] { cross_entropy_loss(loss.data(), rl.data(), N); });
    std::vector<double> wl(N), wd((size_t)N * V); double tot = 0;
    for (int r = 0; r < N; ++r) { double m = -INFINITY, z = 0; for (int c = 0; c < V; ++c) m = std::max(m, (double)logits[(size_t)r * V + c]);
        for (int c = 0; c < V; ++c) z += std::exp(logits[(size_t)r * V + c] - m); wl[r] = m + std::log(z); tot += wl[r] - logits[(size_t)r * V + tg[r]];
        for (int c = 0; c < V; ++c) wd[(size_t)r * V + c] = (std::exp(logits[(size_t)r * V + c] - wl[r]) - (c == tg[r])) * 0.5 / N; }
    close("cross_entropy lse", lse, wl, 1e-6);
    close("cross_entropy loss", loss, {tot / N}, 1e-6);
    launch(G(8), G(256), [&] { cross_entropy_backward_f32(dl.data(), logits.data(), lse.data(), tg.data(), N, V, V, 0.5f); });
    close("cross_entropy bwd", dl, wd, 1e-6);
}

void test_adamw_norm() {
    const i64 n = 5000;
    auto g = rnd(n), p = rnd(n), m = rnd(n, 0.1f), v = rnd(n, 0.01f); for (auto& x : v) x = std::fabs(x);
    // grad norm
    const int parts = 3; std::vector<double> partial(parts); float nsq[2]; double want = 0; for (auto x : g) want += (double)x * x;
    launch(G(parts), G(256), [&] { grad_norm_sq_partial_f32(partial.data(), g.data(), n); });
    launch(G(1), G(256), [&] { grad_norm_sq_finish(&nsq[0], partial.data(), parts); });
    close("grad_norm_sq", {nsq[0]}, {want}, 1e-7);
    nsq[1] = 3.0f; const float* ptrs[2] = {&nsq[0], &nsq[1]}; float coef, norm;
    launch(G(1), G(32), [&] { clip_coef(&coef, &norm, ptrs, 2, 1.0f); });
    float tn = (float)std::sqrt((double)nsq[0] + (double)nsq[1]); float wc = std::min((1.0f / (tn + 1e-6f)) * 1.0f, 1.0f);
    printf("%s clip_coef %.9g (want %.9g) norm %.9g (want %.9g)\n", coef == wc && norm == tn ? "ok  " : "FAIL", coef, wc, norm, tn); if (!(coef == wc && norm == tn)) failures++;
    // adamw f32 with clip vs host formula (transcribed from kernels/adamw.rs)
    double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01; int step = 3;
    double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    float decay = (float)(1 - lr * wd), lw = (float)(1 - b1), fb2 = (float)b2, omb2 = (float)(1 - b2), bcs = (float)std::sqrt(bc2), fe = (float)eps, nss = (float)(-(lr / bc1));
    auto P = p, M = m, Vv = v;
    launch(G(4), G(256), [&] { adamw_f32(P.data(), g.data(), M.data(), Vv.data(), n, &coef, decay, lw, fb2, omb2, bcs, fe, nss); });
    std::vector<double> wp(n), wm(n), wv(n);
    for (i64 i = 0; i < n; ++i) { float gi = g[i] * coef; float pi = p[i] * decay; float mi = std::fmaf(lw, gi - m[i], m[i]);
        float vi = std::fmaf(omb2 * gi, gi, v[i] * fb2); float den = std::sqrt(vi) / bcs + fe; wp[i] = pi + (nss * mi) / den; wm[i] = mi; wv[i] = vi; }
    close("adamw_f32 param (bit-exact)", P, wp, 0); close("adamw_f32 m", M, wm, 0); close("adamw_f32 v", Vv, wv, 0);
    std::vector<float> master = p; auto gb = tobf(g); std::vector<bf16> pb(n); M = m; Vv = v;
    launch(G(4), G(256), [&] { adamw_bf16(master.data(), pb.data(), gb.data(), M.data(), Vv.data(), n, nullptr, decay, lw, fb2, omb2, bcs, fe, nss); });
    auto gr = fromb(gb);
    for (i64 i = 0; i < n; ++i) { float gi = gr[i]; float pi = p[i] * decay; float mi = std::fmaf(lw, gi - m[i], m[i]);
        float vi = std::fmaf(omb2 * gi, gi, v[i] * fb2); float den = std::sqrt(vi) / bcs + fe; wp[i] = pi + (nss * mi) / den; }
    close("adamw_bf16 master (bit-exact)", master, wp, 0);
    std::vector<double> wpb(n); for (i64 i = 0; i < n; ++i) wpb[i] = to_f32(from_f32<bf16>((float)wp[i]));
    close("adamw_bf16 param copy", fromb(pb), wpb, 0);
}

// f16 storage: the conversions against the compiler's `_Float16` (every f16, and f32 values at,
// between and around every pair of neighbouring f16s: ties, overflow past 65504, subnormals),
// then the loss-scaling kernels and f16 entry points against references.
void test_f16() {
    long bad = 0, checked = 0;
    for (u32 h = 0; h < 0x10000u; ++h) {
        f16 x; x.bits = (unsigned short)h;
        _Float16 r; memcpy(&r, &x.bits, 2);
        const float got = to_f32(x), want = (float)r;
        checked++;
        if (!(got == want || (std::isnan(got) && std::isnan(want))) || std::signbit(got) != std::signbit(want)) bad++;
        if ((h & 0x7fffu) >= 0x7c00u) continue;  // inf and NaN: no next neighbour
        // Midpoint to the next f16 up in magnitude (65504's is 65520, which overflows), and one
        // f32 ulp either side of it, and the value itself.
        const float next = to_f32(f16{(unsigned short)(h + 1)});
        const float mid = (float)(((double)got + (double)next) / 2);
        for (float v : {got, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 2 * mid)}) {
            const f16 c = from_f32<f16>(v);
            const float back = to_f32(c), w = ref_round_f16(v);
            checked++;
            if (!(back == w) || std::signbit(back) != std::signbit(w)) bad++;
        }
    }
    for (float v : {NAN, -NAN, INFINITY, -INFINITY, 1e30f, -1e-30f, 65504.0f, 65519.99f, 65520.0f, 5.96e-8f, 2.98e-8f, 2.99e-8f}) {
        const float back = to_f32(from_f32<f16>(v)), w = ref_round_f16(v);
        checked++;
        if (!(back == w || (std::isnan(back) && std::isnan(w))) || std::signbit(back) != std::signbit(w)) bad++;
    }
    printf("%s f16 conversions: %ld of %ld differ from _Float16\n", bad == 0 ? "ok  " : "FAIL", bad, checked);
    if (bad) failures++;

    const i64 n = 1000;
    auto x = rnd(n, 6);
    auto xh = toh(x); std::vector<f16> oh(n);
    auto gelu = [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); };
    launch(G(2), G(256), [&] { gelu_forward_f16(oh.data(), xh.data(), n); });
    auto xr = fromh(xh); std::vector<double> w(n);
    for (int i = 0; i < n; ++i) w[i] = gelu(xr[i]);
    close("gelu fwd f16", fromh(oh), w, 1e-3);
    // accumulate_grad in place, as the host's add_assign_f16: f32 sum rounded once; 60000 +
    // 60000 overflows to infinity.
    {
        std::vector<f16> acc(n, from_f32<f16>(0.0f)); std::vector<double> wacc(n, 0.0);
        for (int m = 0; m < 3; ++m) {
            auto g = toh(rnd(n, 100)); auto gr = fromh(g);
            launch(G(2), G(256), [&] { add_forward_f16(acc.data(), acc.data(), g.data(), n); });
            for (int i = 0; i < n; ++i) wacc[i] = ref_round_f16((float)wacc[i] + gr[i]);
        }
        close("accumulate_grad in place f16", fromh(acc), wacc, 0);
        std::vector<f16> big = toh({60000.0f, -60000.0f}), sum(2);
        launch(G(1), G(32), [&] { add_forward_f16(sum.data(), big.data(), big.data(), 2); });
        const bool ok = to_f32(sum[0]) == INFINITY && to_f32(sum[1]) == -INFINITY;
        printf("%s add f16 overflow: %g %g\n", ok ? "ok  " : "FAIL", to_f32(sum[0]), to_f32(sum[1]));
        if (!ok) failures++;
    }
    // The loss-scaled cross-entropy backward: the kernel of the unscaled one with dloss = S / K
    // (S = 1024, K = 2), stored in f16.
    {
        const int N = 5, V = 300;
        auto logits = toh(rnd((size_t)N * V, 4)); auto lr = fromh(logits);
        std::vector<int> tg(N); for (int i = 0; i < N; ++i) tg[i] = (i * 37) % V;
        std::vector<float> lse(N), rl(N); std::vector<f16> dl((size_t)N * V);
        launch(G(2), G(256), [&] { cross_entropy_forward_f16(lse.data(), rl.data(), logits.data(), tg.data(), N, V, V); });
        const float dloss = (float)(1024.0 / 2);
        launch(G(4), G(256), [&] { cross_entropy_backward_f16(dl.data(), logits.data(), lse.data(), tg.data(), N, V, V, dloss); });
        std::vector<double> wd((size_t)N * V);
        for (int r = 0; r < N; ++r) { double m = -INFINITY, z = 0; for (int c = 0; c < V; ++c) m = std::max(m, (double)lr[(size_t)r * V + c]);
            for (int c = 0; c < V; ++c) z += std::exp(lr[(size_t)r * V + c] - m);
            for (int c = 0; c < V; ++c) wd[(size_t)r * V + c] = (std::exp(lr[(size_t)r * V + c] - m) / z - (c == tg[r])) * dloss / N; }
        close("cross_entropy bwd f16 loss-scaled S/K", fromh(dl), wd, 1e-3);
    }
    // unscale_coef, transcribed from kernels::unscale_coef: norm = f32(sqrt(total)) * inv,
    // coef = clip_coef(norm) * inv (or inv); an inf or NaN total gives -1 and norm inf / NaN.
    {
        const float inv = (float)(1.0 / 65536.0);
        float a = 3.0e9f, b = 1.0e9f; const float* ptrs[2] = {&a, &b}; float coef, norm;
        launch(G(1), G(32), [&] { unscale_coef(&coef, &norm, ptrs, 2, inv, 0.5f, 1); });
        const float t = (float)std::sqrt((double)a + (double)b), wn = t * inv;
        const float c = (1.0f / (wn + 1e-6f)) * 0.5f, wc = (c > 1.0f ? 1.0f : c) * inv;
        bool ok = coef == wc && norm == wn;
        printf("%s unscale_coef clipped %.9g (want %.9g) norm %.9g (want %.9g)\n", ok ? "ok  " : "FAIL", coef, wc, norm, wn); if (!ok) failures++;
        launch(G(1), G(32), [&] { unscale_coef(&coef, &norm, ptrs, 2, inv, 0.0f, 0); });
        ok = coef == inv && norm == wn;
        printf("%s unscale_coef unclipped %.9g (want %.9g)\n", ok ? "ok  " : "FAIL", coef, inv); if (!ok) failures++;
        b = INFINITY;
        launch(G(1), G(32), [&] { unscale_coef(&coef, &norm, ptrs, 2, inv, 0.5f, 1); });
        ok = coef == -1.0f && norm == INFINITY;
        printf("%s unscale_coef overflow -> %g, norm %g\n", ok ? "ok  " : "FAIL", coef, norm); if (!ok) failures++;
        b = NAN;
        launch(G(1), G(32), [&] { unscale_coef(&coef, &norm, ptrs, 2, inv, 0.0f, 0); });
        ok = coef == -1.0f && std::isnan(norm);
        printf("%s unscale_coef nan -> %g, norm %g\n", ok ? "ok  " : "FAIL", coef, norm); if (!ok) failures++;
    }
    // AdamW: f16 as bf16 (bit-exact master, param the master rounded), and a negative
    // coefficient (an overflowed step) leaves everything as it was, f32 and f16.
    {
        auto g = rnd(n), p = rnd(n), m = rnd(n, 0.1f), v = rnd(n, 0.01f); for (auto& y : v) y = std::fabs(y);
        double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wdk = 0.01; int step = 2;
        double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
        float decay = (float)(1 - lr * wdk), lw = (float)(1 - b1), fb2 = (float)b2, omb2 = (float)(1 - b2), bcs = (float)std::sqrt(bc2), fe = (float)eps, nss = (float)(-(lr / bc1));
        const float scale = 1.0f / 1024;
        auto gh = toh(g); auto gr = fromh(gh);
        std::vector<float> master = p, M = m, Vv = v; std::vector<f16> ph = toh(p);
        launch(G(4), G(256), [&] { adamw_f16(master.data(), ph.data(), gh.data(), M.data(), Vv.data(), n, &scale, decay, lw, fb2, omb2, bcs, fe, nss); });
        std::vector<double> wp(n), wph(n);
        for (i64 i = 0; i < n; ++i) { float gi = gr[i] * scale; float pi = p[i] * decay; float mi = std::fmaf(lw, gi - m[i], m[i]);
            float vi = std::fmaf(omb2 * gi, gi, v[i] * fb2); float den = std::sqrt(vi) / bcs + fe; wp[i] = pi + (nss * mi) / den; wph[i] = ref_round_f16((float)wp[i]); }
        close("adamw_f16 master (bit-exact)", master, wp, 0);
        close("adamw_f16 param copy", fromh(ph), wph, 0);
        const float skip = -1.0f;
        auto master0 = master, M0 = M, V0 = Vv; auto ph0 = fromh(ph);
        launch(G(4), G(256), [&] { adamw_f16(master.data(), ph.data(), gh.data(), M.data(), Vv.data(), n, &skip, decay, lw, fb2, omb2, bcs, fe, nss); });
        close("adamw_f16 skipped: master", master, dbl(master0), 0); close("adamw_f16 skipped: param", fromh(ph), dbl(ph0), 0);
        close("adamw_f16 skipped: m", M, dbl(M0), 0); close("adamw_f16 skipped: v", Vv, dbl(V0), 0);
        auto P = p; M = m; Vv = v;
        launch(G(4), G(256), [&] { adamw_f32(P.data(), g.data(), M.data(), Vv.data(), n, &skip, decay, lw, fb2, omb2, bcs, fe, nss); });
        close("adamw_f32 skipped: param", P, dbl(p), 0); close("adamw_f32 skipped: m", M, dbl(m), 0); close("adamw_f32 skipped: v", Vv, dbl(v), 0);
    }
}

// adamw_multi_* against the per-tensor kernels, bit for bit: several tensors of odd sizes (one
// element, less than, one more than and several blocks' worth), some given fewer blocks than
// elements need so that a block strides; the table laid out as launch.rs's `adamw_multi` lays
// it out. Unclipped, clipped, and skipped (a negative coefficient changes nothing).
template <typename T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && (a.empty() || memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
template <typename T> void test_adamw_multi_storage(const char* name) {
    const std::vector<i64> sizes = {1, 255, 257, 1000, 3001};
    const std::vector<unsigned> blocks = {1, 1, 2, 2, 3};
    const size_t k = sizes.size();
    const float decay = 1 - 1e-3f * 0.01f, lw = 0.1f, b2 = 0.999f, omb2 = 1 - 0.999f, bcs = std::sqrt(1 - 0.999f * 0.999f * 0.999f), eps = 1e-8f, nss = -1e-3f / (1 - 0.9f * 0.9f * 0.9f);
    const bool is_f32 = std::is_same<T, float>::value;
    for (float coef : {0.0f, 0.75f, -1.0f}) {
        const float* scale = coef == 0.0f ? nullptr : &coef;
        // Per tensor: master (or the f32 param), low copy, grad, m, v; `a` for the multi launch,
        // `b` for the per-tensor launches, both from the same values.
        std::vector<std::vector<float>> ma(k), mb(k), m_a(k), m_b(k), v_a(k), v_b(k);
        std::vector<std::vector<T>> la(k), lb(k), g(k);
        for (size_t t = 0; t < k; ++t) {
            const size_t n = sizes[t];
            ma[t] = mb[t] = rnd(n);
            m_a[t] = m_b[t] = rnd(n, 0.1f);
            v_a[t] = rnd(n, 0.01f); for (auto& x : v_a[t]) x = std::fabs(x); v_b[t] = v_a[t];
            auto gf = rnd(n, 2.0f);
            g[t].resize(n); la[t].resize(n); lb[t].resize(n);
            for (size_t i = 0; i < n; ++i) { g[t][i] = from_f32<T>(gf[i]); la[t][i] = lb[t][i] = from_f32<T>(ma[t][i]); }
        }
        std::vector<AdamWTensor> table(k);
        i64 first = 0;
        for (size_t t = 0; t < k; ++t) {
            table[t] = AdamWTensor{ma[t].data(), is_f32 ? nullptr : (void*)la[t].data(), g[t].data(), m_a[t].data(), v_a[t].data(), sizes[t], first};
            first += blocks[t];
        }
        launch(G((unsigned)first), G(256), [&] {
            if constexpr (std::is_same<T, float>::value) adamw_multi_f32(table.data(), (int)k, scale, decay, lw, b2, omb2, bcs, eps, nss);
            else if constexpr (std::is_same<T, bf16>::value) adamw_multi_bf16(table.data(), (int)k, scale, decay, lw, b2, omb2, bcs, eps, nss);
            else adamw_multi_f16(table.data(), (int)k, scale, decay, lw, b2, omb2, bcs, eps, nss);
        });
        bool ok = true, changed = false;
        for (size_t t = 0; t < k; ++t) {
            const i64 n = sizes[t];
            std::vector<float> before = mb[t];
            launch(G(4), G(256), [&] {
                if constexpr (std::is_same<T, float>::value) adamw_f32(mb[t].data(), g[t].data(), m_b[t].data(), v_b[t].data(), n, scale, decay, lw, b2, omb2, bcs, eps, nss);
                else if constexpr (std::is_same<T, bf16>::value) adamw_bf16(mb[t].data(), lb[t].data(), g[t].data(), m_b[t].data(), v_b[t].data(), n, scale, decay, lw, b2, omb2, bcs, eps, nss);
                else adamw_f16(mb[t].data(), lb[t].data(), g[t].data(), m_b[t].data(), v_b[t].data(), n, scale, decay, lw, b2, omb2, bcs, eps, nss);
            });
            ok = ok && same_bits(ma[t], mb[t]) && same_bits(m_a[t], m_b[t]) && same_bits(v_a[t], v_b[t]) && same_bits(la[t], lb[t]);
            changed = changed || !same_bits(before, mb[t]);
        }
        // A skipped step changes nothing; any other changes every tensor's weights.
        ok = ok && changed == (coef >= 0.0f);
        printf("%s adamw_multi_%s (coef %g) = adamw_%s per tensor, bit for bit, %zu tensors\n", ok ? "ok  " : "FAIL", name, coef, name, k);
        if (!ok) failures++;
    }
}
void test_adamw_multi() {
    test_adamw_multi_storage<float>("f32");
    test_adamw_multi_storage<bf16>("bf16");
    test_adamw_multi_storage<f16>("f16");
}

// Flash attention on tensor cores (bf16 / f16, the m16n8k16 fragments exchanged between the
// warp's lanes as on the GPU) against f64 attention on the same rounded inputs, with the op's
// scale and soft-cap, GQA, windows, T not a multiple of the tiles, packed q/k/v.
struct FlashRef { std::vector<double> out, lse, dq, dk, dv; };
FlashRef flash_naive(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                     const std::vector<float>& dout, int B, int T, int H, int KV, int D, int W, int qs, int ks,
                     int ko, int vo, double scale, double cap) {
    FlashRef r;
    r.out.assign((size_t)B * T * H * D, 0); r.lse.assign((size_t)B * H * T, 0);
    r.dq.assign((size_t)B * T * H * D, 0); r.dk.assign((size_t)B * T * KV * D, 0); r.dv.assign((size_t)B * T * KV * D, 0);
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) {
        const int kvh = h / (H / KV);
        std::vector<double> s(T, -INFINITY), p(T, 0), dc(T, 1);
        double m = -INFINITY;
        for (int j = 0; j < T; ++j) {
            if (j > t || (W > 0 && j <= t - W)) continue;
            double dot = 0;
            for (int e = 0; e < D; ++e) dot += (double)q[((size_t)b * T + t) * qs + h * D + e] * k[((size_t)b * T + j) * ks + ko + kvh * D + e];
            double x = dot * scale;
            if (cap > 0) { double th = std::tanh(x / cap); x = cap * th; dc[j] = 1 - th * th; }
            s[j] = x; m = std::max(m, x);
        }
        double z = 0;
        for (int j = 0; j < T; ++j) z += s[j] == -INFINITY ? 0 : std::exp(s[j] - m);
        for (int j = 0; j < T; ++j) p[j] = s[j] == -INFINITY ? 0 : std::exp(s[j] - m) / z;
        r.lse[((size_t)b * H + h) * T + t] = m + std::log(z);
        const size_t orow = ((size_t)b * T + t) * H * D + h * D;
        for (int e = 0; e < D; ++e) {
            double o = 0;
            for (int j = 0; j < T; ++j) o += p[j] * v[((size_t)b * T + j) * ks + vo + kvh * D + e];
            r.out[orow + e] = o;
        }
        std::vector<double> dp(T, 0); double delta = 0;
        for (int j = 0; j < T; ++j) for (int e = 0; e < D; ++e) dp[j] += (double)dout[orow + e] * v[((size_t)b * T + j) * ks + vo + kvh * D + e];
        for (int j = 0; j < T; ++j) delta += p[j] * dp[j];
        for (int j = 0; j < T; ++j) {
            const double ds = p[j] * (dp[j] - delta) * dc[j] * scale;
            for (int e = 0; e < D; ++e) {
                r.dq[orow + e] += ds * k[((size_t)b * T + j) * ks + ko + kvh * D + e];
                r.dk[((size_t)b * T + j) * KV * D + kvh * D + e] += ds * q[((size_t)b * T + t) * qs + h * D + e];
                r.dv[((size_t)b * T + j) * KV * D + kvh * D + e] += p[j] * dout[orow + e];
            }
        }
    }
    return r;
}

template <typename S, int D>
void test_flash(int B, int T, int H, int KV, int W, float cap, bool packed) {
    char name[160];
    snprintf(name, sizeof name, "flash %s B%d T%d H%d KV%d D%d W%d cap%g %s", std::is_same<S, bf16>::value ? "bf16" : "f16", B, T, H, KV, D, W, cap, packed ? "packed" : "separate");
    const int qs = packed ? (H + 2 * KV) * D : H * D, ks = packed ? qs : KV * D;
    const int ko = packed ? H * D : 0, vo = packed ? (H + KV) * D : 0;
    auto round = [](const std::vector<float>& x) { std::vector<S> r(x.size()); for (size_t i = 0; i < x.size(); ++i) r[i] = from_f32<S>(x[i]); return r; };
    auto back = [](const std::vector<S>& x) { std::vector<float> r(x.size()); for (size_t i = 0; i < x.size(); ++i) r[i] = to_f32(x[i]); return r; };
    // Scores of a few units (scale 1 / sqrt(D) over entries of 1.5), so the softmax is peaked.
    std::vector<S> qh = round(rnd((size_t)B * T * qs, 1.5f)), kh, vh;
    if (!packed) { kh = round(rnd((size_t)B * T * ks, 1.5f)); vh = round(rnd((size_t)B * T * ks, 1.0f)); }
    const S* qp = qh.data();
    const S* kp = packed ? qh.data() + ko : kh.data();
    const S* vp = packed ? qh.data() + vo : vh.data();
    std::vector<S> douth = round(rnd((size_t)B * T * H * D));
    const float scale = 1.0f / std::sqrt((float)D);
    std::vector<S> out((size_t)B * T * H * D);
    std::vector<float> lse((size_t)B * H * T, NAN), delta((size_t)B * H * T);
    const unsigned tiles = (T + ATTN_FLASH_ROWS - 1) / ATTN_FLASH_ROWS;
    launch(G(tiles, H, B), G(ATTN_FLASH_THREADS), [&] {
        if constexpr (std::is_same<S, bf16>::value) {
            if constexpr (D == 64) flash_attention_forward_bf16_d64(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_forward_bf16_d128(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_forward_bf16_d256(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
        } else {
            if constexpr (D == 64) flash_attention_forward_f16_d64(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_forward_f16_d128(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_forward_f16_d256(out.data(), lse.data(), qp, kp, vp, T, H, KV, W, qs, ks, scale, cap);
        }
    });
    const std::vector<float> qf = back(qh), kf = packed ? qf : back(kh), vf = packed ? qf : back(vh), df = back(douth);
    const FlashRef ref = flash_naive(qf, kf, vf, df, B, T, H, KV, D, W, qs, ks, ko, vo, scale, cap);
    // The probabilities enter P V rounded to 16 bits, as in FlashAttention-2; outputs are
    // rounded to the storage type.
    const double tol = 8e-3;
    close((std::string(name) + " out").c_str(), back(out), ref.out, tol);
    close((std::string(name) + " lse").c_str(), lse, ref.lse, 1e-5);
    launch(G(3), G(128), [&] {
        if constexpr (std::is_same<S, bf16>::value) attention_backward_delta_bf16(delta.data(), out.data(), douth.data(), B, T, H, D);
        else attention_backward_delta_f16(delta.data(), out.data(), douth.data(), B, T, H, D);
    });
    const S nan = from_f32<S>(NAN);
    std::vector<S> dqh((size_t)B * T * qs, nan), dkh(packed ? 0 : (size_t)B * T * ks, nan), dvh(dkh.size(), nan);
    S* dqp = dqh.data();
    S* dkp = packed ? dqh.data() + ko : dkh.data();
    S* dvp = packed ? dqh.data() + vo : dvh.data();
    launch(G(tiles, H, B), G(ATTN_FLASH_THREADS), [&] {
        if constexpr (std::is_same<S, bf16>::value) {
            if constexpr (D == 64) flash_attention_backward_dq_bf16_d64(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_backward_dq_bf16_d128(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_backward_dq_bf16_d256(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
        } else {
            if constexpr (D == 64) flash_attention_backward_dq_f16_d64(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_backward_dq_f16_d128(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_backward_dq_f16_d256(dqp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
        }
    });
    launch(G(tiles, KV, B), G(ATTN_FLASH_THREADS), [&] {
        if constexpr (std::is_same<S, bf16>::value) {
            if constexpr (D == 64) flash_attention_backward_dkv_bf16_d64(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_backward_dkv_bf16_d128(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_backward_dkv_bf16_d256(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
        } else {
            if constexpr (D == 64) flash_attention_backward_dkv_f16_d64(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 128) flash_attention_backward_dkv_f16_d128(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
            if constexpr (D == 256) flash_attention_backward_dkv_f16_d256(dkp, dvp, douth.data(), qp, kp, vp, lse.data(), delta.data(), T, H, KV, W, qs, ks, scale, cap);
        }
    });
    std::vector<float> dq((size_t)B * T * H * D), dk((size_t)B * T * KV * D), dv(dk.size());
    for (size_t r = 0; r < (size_t)B * T; ++r) {
        for (int e = 0; e < H * D; ++e) dq[r * H * D + e] = to_f32(dqh[r * qs + e]);
        for (int e = 0; e < KV * D; ++e) {
            dk[r * KV * D + e] = to_f32(packed ? dqh[r * qs + ko + e] : dkh[r * ks + e]);
            dv[r * KV * D + e] = to_f32(packed ? dqh[r * qs + vo + e] : dvh[r * ks + e]);
        }
    }
    close((std::string(name) + " dq").c_str(), dq, ref.dq, tol);
    close((std::string(name) + " dk").c_str(), dk, ref.dk, tol);
    close((std::string(name) + " dv").c_str(), dv, ref.dv, tol);
}

void test_flash_all() {
    test_flash<bf16, 64>(2, 100, 4, 2, 0, 0.0f, false);   // GQA, T not a multiple of 64
    test_flash<f16, 64>(1, 70, 2, 2, 0, 0.0f, true);      // packed q/k/v (GPT-2)
    test_flash<bf16, 64>(1, 150, 2, 1, 40, 0.0f, false);  // sliding window: skipped tiles
    test_flash<bf16, 128>(1, 80, 4, 1, 0, 0.0f, false);   // Llama's head dimension, 4 heads a group
    test_flash<f16, 128>(1, 33, 2, 1, 17, 0.0f, false);
    test_flash<bf16, 256>(1, 70, 2, 1, 30, 5.0f, false);  // Gemma 2: D 256, soft-cap, window
}

/// Integer results must be equal: prints one line, counts a failure when they differ.
void same(const char* what, const std::vector<int>& got, const std::vector<int>& want) {
    size_t at = 0;
    while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
    const bool ok = got.size() == want.size() && at == got.size();
    if (!ok) failures++;
    if (ok) printf("ok   %s: %zu equal\n", what, got.size());
    else printf("FAIL %s: differ at %zu (got %d want %d)\n", what, at, at < got.size() ? got[at] : -1, at < want.size() ? want[at] : -1);
}

/// The mixture-of-experts kernels against naive references from runtime/src/kernels/moe.rs:
/// routing (softmax, top-k with ties to the lower expert, renormalisation) and the packed
/// layout over several tiles of the packing block, its gradient, dispatch and combine and their
/// gradients, and the grouped matmul over uneven groups (an empty one, one longer than a tile,
/// sizes that are no multiple of the tile).
void test_moe() {
    const int N = 150, E = 5, K = 2, NK = N * K;
    std::vector<float> logits = rnd((size_t)N * E, 3.0f);
    // Token 0 ties experts 1 and 3 for first place and 0 and 4 for third.
    for (int e = 0; e < E; ++e) logits[e] = e == 1 || e == 3 ? 2.0f : e == 2 ? -1.0f : 0.5f;
    for (int normalize : {1, 0}) {
        std::vector<float> w(NK, NAN);
        std::vector<int> ex(NK, -1), rows(NK, -1), slots(NK, -1), off(E + 1, -1);
        launch(G(2), G(64), [&] { moe_route_softmax_f32(w.data(), ex.data(), logits.data(), N, E, K, normalize); });
        launch(G(1), G(256), [&] { moe_route_pack(rows.data(), slots.data(), off.data(), ex.data(), NK, E); });
        std::vector<int> want_ex(NK);
        std::vector<double> want_w(NK);
        for (int t = 0; t < N; ++t) {
            double mx = -INFINITY, sum = 0;
            for (int e = 0; e < E; ++e) mx = std::max(mx, (double)logits[t * E + e]);
            std::vector<double> p(E);
            for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[t * E + e] - mx);
            for (int e = 0; e < E; ++e) p[e] /= sum;
            double chosen_sum = 0;
            for (int j = 0; j < K; ++j) {
                int best = -1;
                for (int e = 0; e < E; ++e) {
                    bool taken = false;
                    for (int i = 0; i < j; ++i) taken |= want_ex[t * K + i] == e;
                    if (!taken && (best < 0 || p[e] > p[best])) best = e;
                }
                want_ex[t * K + j] = best;
                want_w[t * K + j] = p[best];
                chosen_sum += p[best];
            }
            if (normalize)
                for (int j = 0; j < K; ++j) want_w[t * K + j] /= chosen_sum;
        }
        same(normalize ? "moe route experts (renormalised)" : "moe route experts", ex, want_ex);
        if (ex[0] != 1 || ex[1] != 3) { printf("FAIL moe route: a tie went to %d, %d\n", ex[0], ex[1]); failures++; }
        close(normalize ? "moe route weights (renormalised)" : "moe route weights", w, want_w, 1e-6);
        // The packed layout: a stable counting sort of the slots by expert.
        std::vector<int> want_off(E + 1, 0), want_rows, want_slots(NK);
        for (int e = 0; e < E; ++e) {
            for (int s = 0; s < NK; ++s)
                if (want_ex[s] == e) {
                    want_slots[s] = (int)want_rows.size();
                    want_rows.push_back(s);
                }
            want_off[e + 1] = (int)want_rows.size();
        }
        same("moe route offsets", off, want_off);
        same("moe route rows", rows, want_rows);
        same("moe route slots", slots, want_slots);

        // The routing gradient: through the renormalisation and the softmax.
        const std::vector<float> dw = rnd(NK);
        std::vector<float> dl((size_t)N * E, NAN);
        launch(G(3), G(32), [&] { moe_route_backward_f32(dl.data(), dw.data(), logits.data(), ex.data(), N, E, K, normalize); });
        std::vector<double> want_dl((size_t)N * E);
        for (int t = 0; t < N; ++t) {
            double mx = -INFINITY, sum = 0;
            for (int e = 0; e < E; ++e) mx = std::max(mx, (double)logits[t * E + e]);
            std::vector<double> p(E), dp(E, 0.0);
            for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[t * E + e] - mx);
            for (int e = 0; e < E; ++e) p[e] /= sum;
            double s = 0, dot = 0;
            for (int j = 0; j < K; ++j) s += p[want_ex[t * K + j]];
            for (int j = 0; j < K; ++j) dot += dw[t * K + j] * p[want_ex[t * K + j]] / s;
            for (int j = 0; j < K; ++j)
                dp[want_ex[t * K + j]] = normalize ? (dw[t * K + j] - dot) / s : dw[t * K + j];
            double dot2 = 0;
            for (int e = 0; e < E; ++e) dot2 += dp[e] * p[e];
            for (int e = 0; e < E; ++e) want_dl[t * E + e] = p[e] * (dp[e] - dot2);
        }
        close(normalize ? "moe route backward (renormalised)" : "moe route backward", dl, want_dl, 1e-5);

        // Dispatch and its gradient, combine and its gradients, on this routing.
        const int C = 7;
        const std::vector<float> x = rnd((size_t)N * C);
        std::vector<float> xs((size_t)NK * C, NAN);
        launch(G(4), G(64), [&] { moe_dispatch_f32(xs.data(), x.data(), rows.data(), NK, C, K); });
        std::vector<double> want_xs((size_t)NK * C);
        for (int r = 0; r < NK; ++r)
            for (int c = 0; c < C; ++c) want_xs[(size_t)r * C + c] = x[(size_t)(want_rows[r] / K) * C + c];
        close("moe dispatch", xs, want_xs, 0.0);
        const std::vector<float> dxs = rnd((size_t)NK * C);
        std::vector<float> dx((size_t)N * C, NAN);
        launch(G(4), G(64), [&] { moe_dispatch_backward_f32(dx.data(), dxs.data(), slots.data(), N, C, K); });
        std::vector<double> want_dx((size_t)N * C, 0.0);
        for (int s = 0; s < NK; ++s)
            for (int c = 0; c < C; ++c) want_dx[(size_t)(s / K) * C + c] += dxs[(size_t)want_slots[s] * C + c];
        close("moe dispatch backward", dx, want_dx, 1e-6);
        const std::vector<float> ys = rnd((size_t)NK * C), dout = rnd((size_t)N * C);
        std::vector<float> out((size_t)N * C, NAN), dys((size_t)NK * C, NAN), dwt(NK, NAN);
        launch(G(4), G(64), [&] { moe_combine_f32(out.data(), ys.data(), w.data(), slots.data(), N, C, K); });
        launch(G(4), G(64), [&] { moe_combine_backward_dys_f32(dys.data(), dout.data(), w.data(), slots.data(), NK, C, K); });
        launch(G(2), G(64), [&] { moe_combine_backward_weights_f32(dwt.data(), dout.data(), ys.data(), slots.data(), NK, C, K); });
        std::vector<double> want_out((size_t)N * C, 0.0), want_dys((size_t)NK * C), want_dwt(NK, 0.0);
        for (int s = 0; s < NK; ++s) {
            const size_t r = (size_t)want_slots[s], t = (size_t)(s / K);
            for (int c = 0; c < C; ++c) {
                want_out[t * C + c] += (double)ys[r * C + c] * w[s];
                want_dys[r * C + c] = (double)dout[t * C + c] * w[s];
                want_dwt[s] += (double)dout[t * C + c] * ys[r * C + c];
            }
        }
        close("moe combine", out, want_out, 1e-6);
        close("moe combine backward dys", dys, want_dys, 1e-6);
        close("moe combine backward weights", dwt, want_dwt, 1e-6);
        if (normalize) {
            // bf16 storage: loaded exactly, computed in f32, rounded once when stored.
            const std::vector<bf16> ysb = tobf(ys);
            std::vector<bf16> outb((size_t)N * C);
            launch(G(4), G(64), [&] { moe_combine_bf16(outb.data(), ysb.data(), w.data(), slots.data(), N, C, K); });
            std::vector<double> want_b((size_t)N * C, 0.0);
            for (int s = 0; s < NK; ++s)
                for (int c = 0; c < C; ++c)
                    want_b[(size_t)(s / K) * C + c] += (double)to_f32(ysb[(size_t)want_slots[s] * C + c]) * w[s];
            close("moe combine bf16", fromb(outb), want_b, 4e-3);
        }
    }

    // The grouped matmul over groups of 0, 21, 3 and 16 rows, 20 inputs, 19 outputs.
    const int GE = 4, DI = 20, DO = 19;
    const std::vector<int> goff = {0, 0, 21, 24, 40};
    const int R = goff[GE];
    const std::vector<float> gx = rnd((size_t)R * DI), gdy = rnd((size_t)R * DO);
    std::vector<std::vector<float>> gw(GE);
    for (auto& m : gw) m = rnd((size_t)DO * DI);
    const float* wp[GE] = {gw[0].data(), gw[1].data(), gw[2].data(), gw[3].data()};
    std::vector<float> gy((size_t)R * DO, NAN), gdx((size_t)R * DI, NAN);
    std::vector<std::vector<float>> gdw(GE, std::vector<float>((size_t)DO * DI, NAN));
    float* dwp[GE] = {gdw[0].data(), gdw[1].data(), gdw[2].data(), gdw[3].data()};
    const unsigned row_tiles = (R + MOE_TILE - 1) / MOE_TILE + GE;
    launch(G(row_tiles, (DO + 15) / 16), G(16, 16), [&] { grouped_linear_forward_f32(gy.data(), gx.data(), goff.data(), wp, GE, DI, DO); });
    launch(G(row_tiles, (DI + 15) / 16), G(16, 16), [&] { grouped_linear_backward_dx_f32(gdx.data(), gdy.data(), goff.data(), wp, GE, DI, DO); });
    launch(G((DI + 15) / 16, (DO + 15) / 16, GE), G(16, 16), [&] { grouped_linear_backward_dw_f32(dwp, gdy.data(), gx.data(), goff.data(), DI, DO); });
    std::vector<double> want_y((size_t)R * DO, 0.0), want_gdx((size_t)R * DI, 0.0);
    std::vector<std::vector<double>> want_gdw(GE, std::vector<double>((size_t)DO * DI, 0.0));
    for (int e = 0; e < GE; ++e)
        for (int r = goff[e]; r < goff[e + 1]; ++r)
            for (int o = 0; o < DO; ++o)
                for (int i = 0; i < DI; ++i) {
                    const double wv = gw[e][(size_t)o * DI + i];
                    want_y[(size_t)r * DO + o] += (double)gx[(size_t)r * DI + i] * wv;
                    want_gdx[(size_t)r * DI + i] += (double)gdy[(size_t)r * DO + o] * wv;
                    want_gdw[e][(size_t)o * DI + i] += (double)gdy[(size_t)r * DO + o] * gx[(size_t)r * DI + i];
                }
    close("grouped linear forward", gy, want_y, 1e-5);
    close("grouped linear backward dx", gdx, want_gdx, 1e-5);
    for (int e = 0; e < GE; ++e) {
        const std::string what = "grouped linear backward dw, expert " + std::to_string(e) + (e == 0 ? " (no rows: zero)" : "");
        close(what.c_str(), gdw[e], want_gdw[e], 1e-5);
    }
}

/// The load-balancing loss and its gradient over three layers of 150 rows (450 rows: the 256
/// partial sums take one or two rows each) against f64 references of transformers' formula.
void test_moe_aux() {
    const int L = 3, N = 150, E = 5, K = 2;
    const double coef = 0.05, seed = 0.25;
    std::vector<std::vector<float>> logits(L);
    for (auto& l : logits) l = rnd((size_t)N * E, 3.0f);
    const void* lp[L] = {logits[0].data(), logits[1].data(), logits[2].data()};
    // f64 references: counts of each expert in the rows' top-k, summed probabilities.
    std::vector<double> counts(E, 0.0), probs(E, 0.0);
    std::vector<std::vector<double>> p(L, std::vector<double>((size_t)N * E));
    for (int l = 0; l < L; ++l)
        for (int t = 0; t < N; ++t) {
            const float* x = logits[l].data() + (size_t)t * E;
            double* q = p[l].data() + (size_t)t * E;
            double mx = -INFINITY, sum = 0;
            for (int e = 0; e < E; ++e) mx = std::max(mx, (double)x[e]);
            for (int e = 0; e < E; ++e) sum += q[e] = std::exp(x[e] - mx);
            for (int e = 0; e < E; ++e) probs[e] += q[e] /= sum;
            std::vector<int> chosen;
            for (int j = 0; j < K; ++j) {
                int best = -1;
                for (int e = 0; e < E; ++e)
                    if (std::find(chosen.begin(), chosen.end(), e) == chosen.end() && (best < 0 || q[e] > q[best])) best = e;
                chosen.push_back(best);
                counts[best] += 1;
            }
        }
    const double R = (double)L * N;
    double aux = 0;
    for (int e = 0; e < E; ++e) aux += counts[e] / R * probs[e] / R;
    aux *= E;
    const float ce = 2.25f;
    std::vector<float> loss(1, NAN);
    long long coef_bits;
    memcpy(&coef_bits, &coef, 8);
    launch(G(1), G(MOE_AUX_THREADS), [&] { moe_aux_loss_f32(loss.data(), &ce, lp, L, N, E, K, coef_bits); });
    close("moe aux loss", loss, {(double)ce + coef * aux}, 1e-6);
    // The gradient: d/dl = p (g - p . g) per row with g_e = seed coef E c_e / R^2.
    const double scale = seed * coef * E / (R * R);
    long long scale_bits;
    memcpy(&scale_bits, &scale, 8);
    std::vector<float> g(E, NAN);
    launch(G(1), G(MOE_AUX_THREADS), [&] { moe_aux_grads_f32(g.data(), lp, L, N, E, K, scale_bits); });
    // Compared in units of `scale` (the gradients are that small): the counts themselves.
    std::vector<double> want_g(E);
    std::vector<float> g_units(E);
    for (int e = 0; e < E; ++e) {
        want_g[e] = counts[e] * scale;
        g_units[e] = (float)(g[e] / scale);
    }
    close("moe aux coefficients (in units of the scale)", g_units, counts, 1e-6);
    std::vector<std::vector<float>> dl(L, std::vector<float>((size_t)N * E, NAN));
    void* dp[L] = {dl[0].data(), dl[1].data(), dl[2].data()};
    launch(G(2), G(64), [&] { moe_aux_loss_backward_f32(dp, lp, g.data(), L, N, E); });
    for (int l = 0; l < L; ++l) {
        std::vector<double> want((size_t)N * E);
        std::vector<float> got((size_t)N * E);
        for (int t = 0; t < N; ++t) {
            const double* q = p[l].data() + (size_t)t * E;
            double dot = 0;
            for (int e = 0; e < E; ++e) dot += q[e] * counts[e];
            for (int e = 0; e < E; ++e) want[(size_t)t * E + e] = q[e] * (counts[e] - dot);
        }
        for (size_t i = 0; i < got.size(); ++i) got[i] = (float)(dl[l][i] / scale);
        // `c - p . c` cancels: f32 keeps about 1e-7 of counts in the hundreds.
        close("moe aux loss backward (in units of the scale)", got, want, 1e-4);
    }
}

// The elementwise kernels' 16-byte vector path against their scalar path, bit for bit: each
// kernel runs on the same values at 16-byte-aligned addresses (vectors, then a scalar tail
// when n is not a multiple of the vector) and one element past them (every element scalar,
// the arithmetic of the kernels before vectorisation), for lengths below, at and around the
// vector width and a long odd one, in place too.
template <typename T> struct Shifted {
    std::vector<unsigned char> store;
    T* p;
    Shifted(const std::vector<T>& v, int shift) : store((v.size() + 2) * sizeof(T) + 32) {
        auto base = ((uintptr_t)store.data() + 15) & ~(uintptr_t)15;
        p = (T*)base + shift;
        std::memcpy(p, v.data(), v.size() * sizeof(T));
    }
    std::vector<unsigned short> bits(size_t n) const {
        std::vector<unsigned short> r(n * sizeof(T) / 2);
        std::memcpy(r.data(), p, n * sizeof(T));
        return r;
    }
};
template <typename T> std::vector<T> as(const std::vector<float>& v) {
    std::vector<T> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = from_f32<T>(v[i]);
    return r;
}
/// Runs `k(outs..., ins...)` (pointers, then n) with every buffer shifted by 0 and by 1
/// element and checks that the outputs' bits agree. `outs` outputs come first.
template <typename To, typename Ti, typename K>
void same_bits(const char* what, int outs, int ins, bool in_place, K k) {
    for (i64 n : {1, 3, 4, 7, 8, 9, 17, 1003}) {
        std::vector<std::vector<float>> vals;
        for (int j = 0; j < ins; ++j) vals.push_back(rnd((size_t)n, 4));
        std::vector<unsigned short> got[2][2];
        for (int shift : {0, 1}) {
            std::vector<Shifted<To>> o;
            std::vector<Shifted<Ti>> in;
            for (int j = 0; j < outs; ++j) o.emplace_back(std::vector<To>((size_t)n, from_f32<To>(NAN)), shift);
            for (int j = 0; j < ins; ++j) in.emplace_back(as<Ti>(vals[j]), shift);
            // In place: the first output is the first input's buffer.
            To* o0 = in_place ? (To*)in[0].p : o[0].p;
            launch(G(2), G(64), [&] { k(o0, outs > 1 ? o[1].p : nullptr, in[0].p, ins > 1 ? in[1].p : nullptr, ins > 2 ? in[2].p : nullptr, n); });
            got[shift][0] = in_place ? in[0].bits((size_t)n) : o[0].bits((size_t)n);
            if (outs > 1) got[shift][1] = o[1].bits((size_t)n);
        }
        bool ok = got[0][0] == got[1][0] && got[0][1] == got[1][1];
        if (!ok) {
            failures++;
            printf("FAIL %s: the vector and scalar paths differ at n = %lld\n", what, n);
            return;
        }
    }
    printf("ok   %s: vector and scalar paths give the same bits\n", what);
}
template <typename T> void vector_paths(const char* dt) {
    auto name = [&](const char* k) { static std::string s; s = std::string(k) + " " + dt; return s.c_str(); };
#define UNARY(kern) same_bits<T, T>(name(#kern), 1, 1, false, [](T* o, T*, T* x, T*, T*, i64 n) { kern(o, x, n); })
#define BINARY(kern) same_bits<T, T>(name(#kern), 1, 2, false, [](T* o, T*, T* a, T* b, T*, i64 n) { kern(o, a, b, n); })
#define TERNARY(kern) same_bits<T, T>(name(#kern), 2, 3, false, [](T* o, T* o2, T* a, T* b, T* c, i64 n) { kern(o, o2, a, b, c, n); })
    UNARY(gelu_forward); UNARY(relu_forward); UNARY(silu_forward);
    BINARY(gelu_backward); BINARY(relu_backward); BINARY(silu_backward);
    BINARY(swiglu_forward); BINARY(geglu_forward); BINARY(add_forward);
    TERNARY(swiglu_backward); TERNARY(geglu_backward);
#undef UNARY
#undef BINARY
#undef TERNARY
    same_bits<T, T>(name("softcap_forward"), 1, 1, false, [](T* o, T*, T* x, T*, T*, i64 n) { softcap_forward(o, x, 2.5f, n); });
    same_bits<T, T>(name("softcap_backward"), 1, 2, false, [](T* o, T*, T* d, T* y, T*, i64 n) { softcap_backward(o, d, y, 2.5f, n); });
    same_bits<T, T>(name("scale_forward"), 1, 1, false, [](T* o, T*, T* x, T*, T*, i64 n) { scale_forward(o, x, 1.7f, n); });
    same_bits<T, T>(name("add_backward"), 2, 1, false, [](T* o, T* o2, T* d, T*, T*, i64 n) { add_backward(o, o2, d, n); });
    same_bits<T, T>(name("add_forward in place"), 1, 2, true, [](T* o, T*, T* a, T* b, T*, i64 n) { add_forward(o, a, b, n); });
    same_bits<T, T>(name("gelu_forward in place"), 1, 1, true, [](T* o, T*, T* x, T*, T*, i64 n) { gelu_forward(o, x, n); });
    // The bias add: rows of 8, 16 (vectors) and 7 (scalar only) columns; n = rows * cols.
    for (int cols : {7, 8, 16}) {
        same_bits<T, T>(name("bias_add"), 1, 2, false, [cols](T* o, T*, T* x, T* b, T*, i64 n) { bias_add(o, x, b, n / cols, cols); });
    }
}
// The row kernels' (norms, RoPE, embeddings) vector path against their scalar path, bit for
// bit: each runs on the same values with every buffer at 16-byte-aligned addresses and one
// element past them. The aligned run must take the vector path where the shape allows it
// (counted 16-byte accesses), the shifted run never, and their outputs must agree. Shapes:
// rows of many vectors (several parts per thread), rows of a width that is not a multiple of
// the vector (rows alternate between aligned and not, a short last part), and shapes where
// only the scalar path applies.
template <typename T> Shifted<T> sh(const std::vector<float>& v, int shift) { return Shifted<T>(as<T>(v), shift); }
template <typename T> std::vector<unsigned short> cat(std::initializer_list<std::vector<unsigned short>> parts) {
    std::vector<unsigned short> r;
    for (auto& p : parts) r.insert(r.end(), p.begin(), p.end());
    return r;
}
/// `shifted_scalar`: whether the shifted run must take no vector (false where a row width that is
/// not a multiple of the vector brings some shifted rows back to an aligned address).
template <typename Run> void paths(const std::string& what, bool vector, Run run, bool shifted_scalar = true) {
    vector_accesses = 0;
    auto aligned = run(0);
    const long long va = vector_accesses.exchange(0);
    auto shifted = run(1);
    const long long vs = vector_accesses.exchange(0);
    const bool ok = aligned == shifted && (vector ? va > 0 : va == 0) && (vs == 0 || !shifted_scalar);
    if (!ok) failures++;
    printf("%s %s: %s, %lld vector accesses aligned (%s), %lld shifted\n", ok ? "ok  " : "FAIL", what.c_str(),
           aligned == shifted ? "same bits on both paths" : "the paths DIFFER", va, vector ? "want some" : "want none", vs);
}
template <typename T> void row_paths(const char* dt) {
    constexpr int N = VecWidth<T>::N;
    const int R = 4;
    for (int C : {70 * N, 70 * N + 3, 5}) {
        const bool vector = C >= N; // C = 70N + 3: the aligned rows (row 0) take vectors
        const bool whole = C % N == 0;
        const std::string shape = std::string(" ") + dt + " C=" + std::to_string(C);
        auto x = rnd((size_t)R * C, 2), w = rnd(C), b = rnd(C), d = rnd((size_t)R * C), mu = rnd(R), rs = rnd(R);
        for (auto& v : rs) v = 1.0f + std::fabs(v);
        std::vector<float> nan_rc((size_t)R * C, NAN), nan_r(R, NAN);
        paths("layer_norm_forward" + shape, vector, [&](int s) {
            auto o = sh<T>(nan_rc, s); auto xs = sh<T>(x, s), ws = sh<T>(w, s), bs = sh<T>(b, s);
            auto m = sh<float>(nan_r, s), r = sh<float>(nan_r, s);
            launch(G(2), G(32), [&] { layer_norm_forward(o.p, m.p, r.p, xs.p, ws.p, bs.p, R, C, 1e-5f); });
            return cat<T>({o.bits((size_t)R * C), m.bits(R), r.bits(R)});
        }, whole);
        paths("layer_norm_forward without bias" + shape, vector, [&](int s) {
            auto o = sh<T>(nan_rc, s); auto xs = sh<T>(x, s), ws = sh<T>(w, s);
            auto m = sh<float>(nan_r, s), r = sh<float>(nan_r, s);
            launch(G(2), G(32), [&] { layer_norm_forward(o.p, m.p, r.p, xs.p, ws.p, (const T*)nullptr, R, C, 1e-5f); });
            return cat<T>({o.bits((size_t)R * C), m.bits(R), r.bits(R)});
        }, whole);
        paths("layer_norm_backward" + shape, vector, [&](int s) {
            auto o = sh<T>(nan_rc, s); auto ds = sh<T>(d, s), xs = sh<T>(x, s), ws = sh<T>(w, s);
            launch(G(2), G(32), [&] { layer_norm_backward(o.p, ds.p, xs.p, ws.p, mu.data(), rs.data(), R, C); });
            return o.bits((size_t)R * C);
        }, whole);
        for (int unit : {0, 1}) {
            const std::string u = unit ? " (1 + weight)" : "";
            paths("rms_norm_forward" + u + shape, vector, [&](int s) {
                auto o = sh<T>(nan_rc, s); auto xs = sh<T>(x, s), ws = sh<T>(w, s); auto r = sh<float>(nan_r, s);
                launch(G(2), G(32), [&] { rms_norm_forward(o.p, r.p, xs.p, ws.p, R, C, 1e-6f, unit); });
                return cat<T>({o.bits((size_t)R * C), r.bits(R)});
            }, whole);
            paths("rms_norm_backward" + u + shape, vector, [&](int s) {
                auto o = sh<T>(nan_rc, s); auto ds = sh<T>(d, s), xs = sh<T>(x, s), ws = sh<T>(w, s);
                launch(G(2), G(32), [&] { rms_norm_backward(o.p, ds.p, xs.p, ws.p, rs.data(), R, C, unit); });
                return o.bits((size_t)R * C);
            }, whole);
        }
    }
    // The norms' weight and bias gradient partials: rows of parts of N columns summed in 8 row
    // lanes, over chunks of 7 rows of 20 (a short last chunk), against the one-column-per-thread
    // order computed here in f32 (each lane's rows in order, then the lanes in order), which
    // neither the part width nor the load path may change by a bit.
    for (int C : {70 * N, 70 * N + 3, 5}) {
        const int PR = 20, rpc = 7, chunks = (PR + rpc - 1) / rpc;
        // The f32 partials are stored 4 at a time wherever 4 columns of a part are whole, so
        // C = 5 stores vectors even where its 16-bit rows load element by element.
        const bool vector = C >= 4, whole = C % N == 0;
        const std::string shape = std::string(" ") + dt + " C=" + std::to_string(C);
        auto x = as<T>(rnd((size_t)PR * C, 2)), d = as<T>(rnd((size_t)PR * C)), mu = rnd(PR), rs = rnd(PR);
        for (auto& v : rs) v = 1.0f + std::fabs(v);
        std::vector<float> nan_p((size_t)chunks * C, NAN);
        for (int layer : {1, 0}) {
            std::vector<float> want_w((size_t)chunks * C), want_b((size_t)chunks * C);
            for (int k = 0; k < chunks; ++k)
                for (int c = 0; c < C; ++c) {
                    float lw[NORM_ROW_LANES] = {}, lb[NORM_ROW_LANES] = {};
                    for (int j = 0; j < NORM_ROW_LANES; ++j)
                        for (int r = k * rpc + j; r < std::min(PR, (k + 1) * rpc); r += NORM_ROW_LANES) {
                            const size_t i = (size_t)r * C + c;
                            const float dv = to_f32(d[i]);
                            lw[j] += dv * ((to_f32(x[i]) - (layer ? mu[r] : 0.0f)) * rs[r]);
                            lb[j] += dv;
                        }
                    float sw = lw[0], sb = lb[0];
                    for (int j = 1; j < NORM_ROW_LANES; ++j) { sw += lw[j]; sb += lb[j]; }
                    want_w[(size_t)k * C + c] = sw;
                    want_b[(size_t)k * C + c] = sb;
                }
            auto bits = [](const std::vector<float>& v) { return Shifted<float>(v, 0).bits(v.size()); };
            const auto want = layer ? cat<T>({bits(want_w), bits(want_b)}) : bits(want_w);
            paths(std::string("norm_backward_params_partial") + (layer ? " (layer norm)" : " (RMS norm)") + shape, vector, [&](int s) {
                auto pw = sh<float>(nan_p, s), pb = sh<float>(nan_p, s);
                auto ds = Shifted<T>(d, s), xs = Shifted<T>(x, s);
                launch(G((C + 32 * N - 1) / (32 * N), chunks), G(32, 8), [&] {
                    norm_backward_params_partial(pw.p, layer ? pb.p : nullptr, ds.p, xs.p, layer ? mu.data() : nullptr, rs.data(), PR, C, rpc);
                });
                auto got = layer ? cat<T>({pw.bits((size_t)chunks * C), pb.bits((size_t)chunks * C)}) : pw.bits((size_t)chunks * C);
                if (got != want) got.push_back(0xbad); // the one-column-per-thread order's bits
                return got;
            }, whole);
        }
    }
    // RoPE: whole heads, a partial rotary width with copied elements and copied heads (both
    // multiples of the vector), and widths where only the scalar path applies.
    struct RopeShape { int D, Rot, rot; bool vector; };
    for (RopeShape r : {RopeShape{4 * N, 4 * N, 3, true}, RopeShape{4 * N, 2 * N, 2, true}, RopeShape{16, 10, 2, false},
                        RopeShape{2 * N + 2, 2 * N, 3, false}}) {
        const int B = 2, Tn = 3, H = 3;
        const size_t n = (size_t)B * Tn * H * r.D;
        std::vector<float> inv(r.Rot / 2);
        for (int i = 0; i < r.Rot / 2; ++i) inv[i] = 1.0f / std::pow(10000.0f, 2.0f * i / r.Rot);
        auto x = rnd(n, 2);
        std::vector<float> nans(n, NAN);
        const std::string shape = std::string(" ") + dt + " D=" + std::to_string(r.D) + " R=" + std::to_string(r.Rot);
        for (int bwd : {0, 1}) {
            auto kern = [&](T* o, const T* xs) {
                if (bwd) rope(o, xs, inv.data(), B, Tn, H, r.D, r.Rot, r.rot, 1.1f, -1.0f);
                else rope(o, xs, inv.data(), B, Tn, H, r.D, r.Rot, r.rot, 1.1f, 1.0f);
            };
            const std::string k = bwd ? "rope_backward" : "rope_forward";
            std::vector<unsigned short> out_of_place;
            paths(k + shape, r.vector, [&](int s) {
                auto o = sh<T>(nans, s); auto xs = sh<T>(x, s);
                launch(G(2), G(32), [&] { kern(o.p, xs.p); });
                out_of_place = o.bits(n);
                return out_of_place;
            });
            paths(k + " in place" + shape, r.vector, [&](int s) {
                auto xs = sh<T>(x, s);
                launch(G(2), G(32), [&] { kern(xs.p, xs.p); });
                auto got = xs.bits(n);
                if (got != out_of_place) got.push_back(0xdead); // in place must equal out of place
                return got;
            });
        }
    }
    // Embeddings: rows of whole vectors and rows that are not.
    for (int C : {70 * N, 70 * N + 1}) {
        const bool vector = C % N == 0;
        const std::string shape = std::string(" ") + dt + " C=" + std::to_string(C);
        const int V = 7, Tn = 9, Bn = 2, P = 6, off = 2;
        std::vector<int> tok = {3, 0, 6, 3, -1, 2, 3, 9, 0};
        auto table = rnd((size_t)V * C), dout = rnd((size_t)Tn * C), ptab = rnd((size_t)P * C), pd = rnd((size_t)Bn * 3 * C);
        auto dt0 = rnd((size_t)V * C), pg0 = rnd((size_t)P * C);
        std::vector<float> nans((size_t)Tn * C, NAN);
        paths("embedding_forward" + shape, vector, [&](int s) {
            auto o = sh<T>(nans, s); auto ts = sh<T>(table, s);
            launch(G(3), G(32), [&] { embedding_forward(o.p, tok.data(), ts.p, Tn, V, C); });
            return o.bits((size_t)Tn * C);
        });
        paths("position_embedding_forward" + shape, vector, [&](int s) {
            auto o = sh<T>(nans, s); auto ts = sh<T>(ptab, s);
            launch(G(3), G(32), [&] { position_embedding_forward(o.p, ts.p, Bn, 3, C, off); });
            return o.bits((size_t)Bn * 3 * C);
        });
        for (int acc : {0, 1}) {
            const std::string a = acc ? " accumulate" : "";
            paths("position_embedding_backward" + a + shape, vector, [&](int s) {
                auto g = sh<T>(pg0, s); auto ds = sh<T>(pd, s);
                launch(G(3), G(32), [&] { position_embedding_backward(g.p, ds.p, Bn, 3, C, off, P, acc); });
                return g.bits((size_t)P * C);
            });
            std::vector<int> span(2 * V);
            launch(G(1), G(32), [&] { embedding_backward_span(span.data(), tok.data(), Tn, V, 0); });
            launch(G(1), G(32), [&] { embedding_backward_span(span.data(), tok.data(), Tn, V, 1); });
            paths("embedding_backward pad 0" + a + shape, vector, [&](int s) {
                auto g = sh<T>(dt0, s); auto ds = sh<T>(dout, s);
                launch(G(V, 1), G(32), [&] { embedding_backward(g.p, ds.p, tok.data(), span.data(), Tn, V, C, acc, 0); });
                return g.bits((size_t)V * C);
            });
        }
    }
}

void test_vector_paths() {
    row_paths<float>("f32");
    row_paths<bf16>("bf16");
    row_paths<f16>("f16");
    vector_paths<float>("f32");
    vector_paths<bf16>("bf16");
    vector_paths<f16>("f16");
    same_bits<bf16, float>("cast f32 to bf16", 1, 1, false, [](bf16* o, bf16*, float* x, float*, float*, i64 n) { cast_f32_to_bf16(o, x, n); });
    same_bits<f16, float>("cast f32 to f16", 1, 1, false, [](f16* o, f16*, float* x, float*, float*, i64 n) { cast_f32_to_f16(o, x, n); });
    same_bits<float, bf16>("cast bf16 to f32", 1, 1, false, [](float* o, float*, bf16* x, bf16*, bf16*, i64 n) { cast_bf16_to_f32(o, x, n); });
    same_bits<float, f16>("cast f16 to f32", 1, 1, false, [](float* o, float*, f16* x, f16*, f16*, i64 n) { cast_f16_to_f32(o, x, n); });
}

int main(int argc, char** argv) {
    // `harness flash` runs the flash attention checks alone, `harness moe` the
    // mixture-of-experts checks, `harness norm` the norms' against their references and
    // `harness vector` the vector paths against the scalar ones.
    if (argc > 1 && std::string(argv[1]) == "moe") {
        test_moe();
        test_moe_aux();
        printf("%d failure(s)\n", failures);
        return failures != 0;
    }
    if (argc > 1 && std::string(argv[1]) == "norm") {
        test_norm();
        printf("%d failure(s)\n", failures);
        return failures != 0;
    }
    if (argc > 1 && std::string(argv[1]) == "vector") {
        test_vector_paths();
        printf("%d failure(s)\n", failures);
        return failures != 0;
    }
    if (argc > 1 && std::string(argv[1]) == "flash") {
        test_flash_all();
        printf("%d failure(s)\n", failures);
        return failures != 0;
    }
    test_activation(); test_add_cast(); test_vector_paths(); test_embedding(); test_norm(); test_rope(); test_cross_entropy(); test_adamw_norm(); test_f16();
    test_adamw_multi();
    test_attention(2, 7, 4, 2, 4, 0, false);
    test_attention(2, 7, 4, 2, 4, 3, false);
    test_attention(1, 70, 2, 1, 8, 0, false);
    test_attention(1, 70, 4, 2, 40, 20, false);
    test_attention(1, 45, 2, 2, 64, 45, true);
    test_attention(1, 40, 2, 1, 128, 0, false);
    test_attention(1, 33, 3, 3, 16, 1, true);
    // Rows shorter than, equal to and longer than a block (the in-place chunks), windows.
    for (int threads : {32, 64}) {
        test_attention_rows<float>(2, 7, 0, threads);
        test_attention_rows<bf16>(2, 7, 3, threads);
        test_attention_rows<float>(1, 64, 0, threads);
        test_attention_rows<bf16>(3, 70, 0, threads);
        test_attention_rows<bf16>(1, 129, 20, threads);
        test_attention_rows<float>(2, 100, 1, threads);
        test_attention_rows<float>(2, 70, 9, threads, 1.5f);
        test_attention_rows<bf16>(1, 33, 0, threads, 0.7f);
    }
    test_flash_all();
    test_moe();
    test_moe_aux();
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
