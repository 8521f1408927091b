// AdamW on the device, the pieces of `clip_grad_norm_`, and scaling; mirroring
// runtime/src/kernels/adamw.rs and dispatch.rs's clipped step.
//
// The update is written operation by operation with explicit rounding (`__fmul_rn`, ...,
// `fmaf` where torch's CPU kernels fuse), so no multiply-add is contracted and a device step
// gives the same bits as the host's `adamw_step` (which matches torch's CPU AdamW): chunks
// updated on the GPU and chunks updated by the CPU Adam stay consistent. The per-step scalars
// are computed on the host in f64 and rounded to f32 exactly as the host kernel does
// (`cuda::AdamWScalars` in runtime/src/cuda/mod.rs).
//
// Grid-stride over `n` elements: any grid, any 1-D block (256 intended).

/// One element of torch's `_single_tensor_adam` (decoupled weight decay). `decay` is
/// 1 - lr * wd (1 when wd = 0: multiplying by 1 is exact); `g` is already scaled by the clip
/// coefficient when clipping.
__device__ __forceinline__ float adamw_update(float p, float g, float* m, float* v, i64 i, float decay, float lerp_w,
                                              float beta2, float one_minus_beta2, float bc2_sqrt, float eps,
                                              float neg_step_size) {
    const float pi = __fmul_rn(p, decay);
    const float mo = m[i], vo = v[i];
    const float diff = __fsub_rn(g, mo);
    const float mi = fabsf(lerp_w) < 0.5f ? fmaf(lerp_w, diff, mo) : fmaf(__fsub_rn(lerp_w, 1.0f), diff, g);
    const float vi = fmaf(__fmul_rn(one_minus_beta2, g), g, __fmul_rn(vo, beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    m[i] = mi;
    v[i] = vi;
    return __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step_size, mi), denom));
}

/// Whether an AdamW reading clip coefficient `coef` leaves everything unchanged: a loss-scaled
/// step whose gradients overflowed (`unscale_coef`'s -1), as the host's `kernels::skips_step`.
__device__ __forceinline__ bool skips_step(float coef) { return coef < 0.0f; }

/// Pure-f32 AdamW: updates `param`, `exp_avg`, `exp_avg_sq` in place from `grad`, all [n].
/// `grad_scale` points at the clip coefficient (`clip_coef`'s output), or is null for an
/// unclipped step; the gradient is multiplied by it first, as dispatch's `adamw_step_scaled`.
/// A negative coefficient (an overflowed loss-scaled step) skips the update.
extern "C" __global__ void adamw_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, i64 n, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) {
    const float gs = grad_scale ? grad_scale[0] : 1.0f;
    if (skips_step(gs)) return;
    GRID_STRIDE(i, n) {
        const float g = grad_scale ? __fmul_rn(grad[i], gs) : grad[i];
        param[i] = adamw_update(param[i], g, exp_avg, exp_avg_sq, i, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size);
    }
}

template <typename T>
__device__ void adamw_low(float* master, T* param, const T* grad, float* exp_avg, float* exp_avg_sq, i64 n, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) {
    const float gs = grad_scale ? grad_scale[0] : 1.0f;
    if (skips_step(gs)) return;
    GRID_STRIDE(i, n) {
        const float g = grad_scale ? __fmul_rn(to_f32(grad[i]), gs) : to_f32(grad[i]);
        const float p = adamw_update(master[i], g, exp_avg, exp_avg_sq, i, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size);
        master[i] = p;
        param[i] = from_f32<T>(p);
    }
}

/// Mixed precision AdamW: the f32 master weights `master`, with `exp_avg`, `exp_avg_sq` (f32),
/// are updated from the bf16 (f16) gradient `grad`; the bf16 (f16) working copy `param` is
/// rewritten from the new master (round to nearest even). Arguments otherwise as `adamw_f32`.
extern "C" __global__ void adamw_bf16(float* master, bf16* param, const bf16* grad, float* exp_avg, float* exp_avg_sq, i64 n, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) { adamw_low(master, param, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size); }
extern "C" __global__ void adamw_f16(float* master, f16* param, const f16* grad, float* exp_avg, float* exp_avg_sq, i64 n, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) { adamw_low(master, param, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size); }

/// One tensor of a multi-tensor AdamW launch, as the launcher's table lays it out: seven 8-byte
/// words (`runtime/src/cuda/launch.rs`, `adamw_multi`). `master` is the f32 parameter (the f32
/// master weight of a bf16 or f16 parameter), `low` the bf16 or f16 working copy (null in f32),
/// `grad` the gradient in the storage type, `n` the element count (at least 1), and
/// `first_block` the first block of the grid that works on this tensor: tensors are in table
/// order and own consecutive block ranges, the last one up to `gridDim.x`.
struct AdamWTensor {
    float* master;
    void* low;
    const void* grad;
    float* exp_avg;
    float* exp_avg_sq;
    i64 n;
    i64 first_block;
};

/// Every tensor of `tensors[0..count]` updated as `adamw_f32` / `adamw_low` update one, element
/// by element with the same operations, so a merged launch gives the per-tensor launches' bits;
/// only which thread handles an element differs. Block `b` works on the last tensor whose
/// `first_block` is at most `b` (a binary search of the table) and strides over its elements
/// with that tensor's blocks.
template <typename T>
__device__ void adamw_multi(const AdamWTensor* tensors, int count, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) {
    const float gs = grad_scale ? grad_scale[0] : 1.0f;
    if (skips_step(gs)) return;
    const i64 b = blockIdx.x;
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tensors[mid].first_block <= b) lo = mid;
        else hi = mid - 1;
    }
    const AdamWTensor t = tensors[lo];
    const i64 blocks = (lo + 1 < count ? tensors[lo + 1].first_block : (i64)gridDim.x) - t.first_block;
    const T* grad = (const T*)t.grad;
    T* low = (T*)t.low;
    for (i64 i = (b - t.first_block) * blockDim.x + threadIdx.x; i < t.n; i += blocks * blockDim.x) {
        const float g = grad_scale ? __fmul_rn(to_f32(grad[i]), gs) : to_f32(grad[i]);
        const float p = adamw_update(t.master[i], g, t.exp_avg, t.exp_avg_sq, i, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size);
        t.master[i] = p;
        if (low) low[i] = from_f32<T>(p);
    }
}

/// Multi-tensor AdamW (apex's FusedAdam, torch's fused AdamW): one launch updates the `count`
/// tensors of the table `tensors` (see `AdamWTensor`), all with the same step scalars and clip
/// coefficient (`grad_scale`, or null; negative: the step is skipped, nothing changes), each
/// element exactly as `adamw_f32` / `adamw_bf16` / `adamw_f16` would. Launch: 1-D blocks (256
/// intended), `gridDim.x` the table's total of blocks.
extern "C" __global__ void adamw_multi_f32(const AdamWTensor* tensors, int count, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) { adamw_multi<float>(tensors, count, grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size); }
extern "C" __global__ void adamw_multi_bf16(const AdamWTensor* tensors, int count, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) { adamw_multi<bf16>(tensors, count, grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size); }
extern "C" __global__ void adamw_multi_f16(const AdamWTensor* tensors, int count, const float* grad_scale, float decay, float lerp_w, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size) { adamw_multi<f16>(tensors, count, grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size); }

/// min((1 / (t + 1e-6)) * max_norm, 1) in f32, as the host's `kernels::clip_coef`.
__device__ __forceinline__ float clip_factor(float t, float max_norm) {
    const float c = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(t, 1e-6f)), max_norm);
    return c > 1.0f ? 1.0f : c;
}

/// `clip_grad_norm_`'s factor from the `count` squared norms `*norm_sq[k]` (one f32 per
/// gradient tensor, from reduce.cu's `grad_norm_sq_finish`; `norm_sq` is a device table of
/// their addresses): total = sqrt(sum in order, in f64); coef[0] = min((1 / (f32(total) + 1e-6))
/// * max_norm, 1) in f32, and norm[0] = f32(total), exactly as the host. Launch: one thread.
extern "C" __global__ void clip_coef(float* coef, float* norm, const float* const* norm_sq, int count, float max_norm) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (int k = 0; k < count; ++k) total += (double)norm_sq[k][0];
    const float t = __double2float_rn(sqrt(total));
    coef[0] = clip_factor(t, max_norm);
    norm[0] = t;
}

/// GradScaler's `unscale_` and `clip_grad_norm_` as one factor, as the host's
/// `kernels::unscale_coef`: from the `count` squared norms of the loss-scaled gradients (summed
/// in order in f64), norm[0] = f32(sqrt(total)) * inv_scale and coef[0] =
/// clip_factor(norm) * inv_scale when `clip`, else inv_scale (`inv_scale` is
/// f32(1 / loss_scale), rounded on the host). When the total is not finite (an f16 gradient
/// overflowed), coef[0] = -1, which makes every AdamW reading it skip, and norm[0] =
/// f32(sqrt(total)) (inf or NaN). Launch: one thread.
extern "C" __global__ void unscale_coef(float* coef, float* norm, const float* const* norm_sq, int count, float inv_scale, float max_norm, int clip) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (int k = 0; k < count; ++k) total += (double)norm_sq[k][0];
    const float t = __double2float_rn(sqrt(total));
    if (!isfinite(total)) {
        coef[0] = -1.0f;
        norm[0] = t;
        return;
    }
    const float n = __fmul_rn(t, inv_scale);
    coef[0] = clip ? __fmul_rn(clip_factor(n, max_norm), inv_scale) : inv_scale;
    norm[0] = n;
}

/// x *= s in place, `n` elements.
extern "C" __global__ void scale_f32(float* x, i64 n, float s) {
    GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], s); }
}
extern "C" __global__ void scale_bf16(bf16* x, i64 n, float s) {
    GRID_STRIDE(i, n) { x[i] = from_f32<bf16>(__fmul_rn(to_f32(x[i]), s)); }
}
extern "C" __global__ void scale_f16(f16* x, i64 n, float s) {
    GRID_STRIDE(i, n) { x[i] = from_f32<f16>(__fmul_rn(to_f32(x[i]), s)); }
}
/// x *= s[0] in place (a device scalar, e.g. the clip coefficient), `n` elements.
extern "C" __global__ void scale_by_f32(float* x, i64 n, const float* s) {
    const float f = s[0];
    GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], f); }
}
extern "C" __global__ void scale_by_bf16(bf16* x, i64 n, const float* s) {
    const float f = s[0];
    GRID_STRIDE(i, n) { x[i] = from_f32<bf16>(__fmul_rn(to_f32(x[i]), f)); }
}
extern "C" __global__ void scale_by_f16(f16* x, i64 n, const float* s) {
    const float f = s[0];
    GRID_STRIDE(i, n) { x[i] = from_f32<f16>(__fmul_rn(to_f32(x[i]), f)); }
}
