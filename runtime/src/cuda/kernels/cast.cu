// Casts between f32 and bf16 or f16 storage (round to nearest even, NaN kept), grid-stride over `n`
// elements: any grid, any 1-D block (256 intended).

/// out = bf16(x).
extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* x, i64 n) {
    GRID_STRIDE(i, n) { out[i] = from_f32<bf16>(x[i]); }
}

/// out = f32(x), exact.
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* x, i64 n) {
    GRID_STRIDE(i, n) { out[i] = to_f32(x[i]); }
}

/// out = f16(x).
extern "C" __global__ void cast_f32_to_f16(f16* out, const float* x, i64 n) {
    GRID_STRIDE(i, n) { out[i] = from_f32<f16>(x[i]); }
}

/// out = f32(x), exact.
extern "C" __global__ void cast_f16_to_f32(float* out, const f16* x, i64 n) {
    GRID_STRIDE(i, n) { out[i] = to_f32(x[i]); }
}
