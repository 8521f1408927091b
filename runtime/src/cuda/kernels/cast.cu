// Casts between f32 and bf16 or f16 storage (round to nearest even, NaN kept), grid-stride over `n`
// elements: any grid, any 1-D block (256 intended); 16-byte loads of the f32 side where both
// pointers are 16-byte aligned (`map1`, common.cuh).

/// out = bf16(x).
extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* x, i64 n) {
    map1(out, x, n, [](float v) { return v; });
}

/// out = f32(x), exact.
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* x, i64 n) {
    map1(out, x, n, [](float v) { return v; });
}

/// out = f16(x).
extern "C" __global__ void cast_f32_to_f16(f16* out, const float* x, i64 n) {
    map1(out, x, n, [](float v) { return v; });
}

/// out = f32(x), exact.
extern "C" __global__ void cast_f16_to_f32(float* out, const f16* x, i64 n) {
    map1(out, x, n, [](float v) { return v; });
}
