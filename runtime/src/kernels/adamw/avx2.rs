//! The AVX2 instance of the fused AdamW step, written with intrinsics where the generic loop,
//! vectorised by LLVM, spends vector ALU operations AVX2 does not need to spend:
//!
//! - a bf16 gradient is widened by one in-lane byte shuffle of eight elements loaded into both
//!   128-bit halves (the broadcast is a load, not a shuffle), not `vpmovzxwd` and `vpslld`;
//! - the new weight is rounded to bf16 sixteen elements at a time, two 8-lane vectors packed
//!   by one `vpackusdw` and put in order by one `vpermq` (eight at a time, every eight lanes
//!   cost an extract and a pack);
//! - a gradient in the parameter storage (the 14-byte layout) is read where it lies, each
//!   vector before the new parameter is stored over it, with no copy to the stack;
//! - the bf16 copy of a tensor too large to stay in cache is written with streaming stores,
//!   so its cache lines are not read from memory only to be overwritten;
//! - each pass asks for the lines [`PREFETCH_AHEAD`] elements on (one core keeps more
//!   misses in flight than the hardware prefetchers alone start).
//!
//! Every lane computes what [`update`] and [`to_bf16`] compute, with the same IEEE
//! operations in the same order (multiply, add, subtract, FMA, square root, divide) and the
//! same integer rounding, so the bits are those of every other instance.

use core::arch::x86_64::*;

use super::{bf16, to_bf16, update, Coeffs, Copy16, Src, Widen, PREFETCH_AHEAD};

/// A gradient element type this kernel reads eight at a time.
pub(super) trait Load8: Widen {
    /// Eight elements from `src`, widened to f32 exactly.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `src` is valid for reading eight elements.
    unsafe fn load8(src: *const Self) -> __m256;
}

impl Load8 for f32 {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(src: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(src) }
    }
}

impl Load8 for bf16 {
    /// The eight bf16 values in both 128-bit halves, then one byte shuffle per half puts
    /// elements 0-3 (low half) and 4-7 (high half) in the high 16 bits of their 32-bit lanes,
    /// zeros below: the f32 with the same high bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(src: *const bf16) -> __m256 {
        const Z: i8 = -128;
        // SAFETY: the caller's contract (eight bf16 are 16 bytes).
        unsafe {
            let x = _mm256_broadcastsi128_si256(_mm_loadu_si128(src.cast()));
            let to_high = _mm256_setr_epi8(
                Z, Z, 0, 1, Z, Z, 2, 3, Z, Z, 4, 5, Z, Z, 6, 7, Z, Z, 8, 9, Z, Z, 10, 11, Z, Z, 12,
                13, Z, Z, 14, 15,
            );
            _mm256_castsi256_ps(_mm256_shuffle_epi8(x, to_high))
        }
    }
}

/// The step's scalars broadcast to eight lanes, and the rounding's integer constants.
struct Lanes {
    scale: __m256,
    decay: __m256,
    lerp_a: __m256,
    beta2: __m256,
    one_minus_beta2: __m256,
    bc2_sqrt: __m256,
    bc2_recip: __m256,
    eps: __m256,
    neg_step_size: __m256,
    infinity: __m256,
    one: __m256i,
    bias: __m256i,
    quiet: __m256i,
}

impl Lanes {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn new(c: &Coeffs) -> Lanes {
        Lanes {
            scale: _mm256_set1_ps(c.grad_scale),
            decay: _mm256_set1_ps(c.decay),
            lerp_a: _mm256_set1_ps(c.lerp_a),
            beta2: _mm256_set1_ps(c.beta2),
            one_minus_beta2: _mm256_set1_ps(c.one_minus_beta2),
            bc2_sqrt: _mm256_set1_ps(c.bc2_sqrt),
            bc2_recip: _mm256_set1_ps(c.bc2_recip.unwrap_or(f32::NAN)),
            eps: _mm256_set1_ps(c.eps),
            neg_step_size: _mm256_set1_ps(c.neg_step_size),
            infinity: _mm256_set1_ps(f32::INFINITY),
            one: _mm256_set1_epi32(1),
            bias: _mm256_set1_epi32(0x7fff),
            quiet: _mm256_set1_epi32(0x40),
        }
    }
}

/// [`update`] on eight lanes: `p`, `g` (already scaled), `m`, `v` to the new `(p, m, v)`,
/// operation for operation.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn update8<const FROM_M: bool, const RECIP: bool>(
    p: __m256,
    g: __m256,
    m: __m256,
    v: __m256,
    k: &Lanes,
) -> (__m256, __m256, __m256) {
    let pi = _mm256_mul_ps(p, k.decay);
    let base = if FROM_M { m } else { g };
    let mi = _mm256_fmadd_ps(k.lerp_a, _mm256_sub_ps(g, m), base);
    let vi = _mm256_fmadd_ps(
        _mm256_mul_ps(k.one_minus_beta2, g),
        g,
        _mm256_mul_ps(v, k.beta2),
    );
    let root = _mm256_sqrt_ps(vi);
    let quotient = if RECIP {
        // `divide_by_bc2`: `q = root * y`, corrected by `(root - q * b) * y + q`; `q` itself
        // where `root` is infinite.
        let q = _mm256_mul_ps(root, k.bc2_recip);
        let corrected = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, k.bc2_sqrt, root), k.bc2_recip, q);
        let infinite = _mm256_cmp_ps::<_CMP_EQ_OQ>(root, k.infinity);
        _mm256_blendv_ps(corrected, q, infinite)
    } else {
        _mm256_div_ps(root, k.bc2_sqrt)
    };
    let denom = _mm256_add_ps(quotient, k.eps);
    let step = _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, mi), denom);
    (_mm256_add_ps(pi, step), mi, vi)
}

/// [`to_bf16`] on eight lanes, each result in the low 16 bits of its 32-bit lane (at most
/// `0xffff`, so an unsigned-saturating pack keeps it).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn round8(x: __m256, k: &Lanes) -> __m256i {
    let b = _mm256_castps_si256(x);
    let high = _mm256_srli_epi32::<16>(b);
    let bias = _mm256_add_epi32(_mm256_and_si256(high, k.one), k.bias);
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
    let nan = _mm256_or_si256(high, k.quiet);
    let is_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded),
        _mm256_castsi256_ps(nan),
        is_nan,
    ))
}

/// Sixteen lanes (`a`, then `b`) rounded to bf16, in order: `vpackusdw` interleaves the two
/// vectors' 128-bit halves (a0-3 b0-3 | a4-7 b4-7), `vpermq` puts the quarters in order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn narrow16(a: __m256, b: __m256, k: &Lanes) -> __m256i {
    let packed = _mm256_packus_epi32(round8(a, k), round8(b, k));
    _mm256_permute4x64_epi64::<0b11_01_10_00>(packed)
}

/// Elements `range` one at a time ([`update`] and [`to_bf16`], scalar, in AVX2 code).
///
/// # Safety
/// The pointers are valid for the range; `g` may equal `low` (read before written).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scalar<G: Widen, const FROM_M: bool, const RECIP: bool>(
    range: core::ops::Range<usize>,
    p: *mut f32,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    low: *mut bf16,
    c: &Coeffs,
) {
    for i in range {
        // SAFETY: the caller's contract.
        unsafe {
            let gi = (*g.add(i)).widen() * c.grad_scale;
            let (pi, mi, vi) = update::<FROM_M, RECIP>(*p.add(i), gi, *m.add(i), *v.add(i), c);
            (*p.add(i), *m.add(i), *v.add(i), *low.add(i)) = (pi, mi, vi, to_bf16(pi));
        }
    }
}

/// `n` elements from index `start`, sixteen at a time (`n` a multiple of 16): two vectors
/// loaded, updated, stored, and their bf16 copy written as `copy` says (32-byte aligned at
/// `low + start` when streaming).
///
/// # Safety
/// AVX2 and FMA; the pointers valid for the range; `g` may equal `low` (each vector of the
/// gradient is loaded before the copy is stored over it).
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn vectors<G: Load8, const FROM_M: bool, const RECIP: bool>(
    start: usize,
    n: usize,
    p: *mut f32,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    low: *mut bf16,
    copy: Copy16,
    c: &Coeffs,
) {
    let k = Lanes::new(c);
    let mut i = start;
    while i < start + n {
        // The lines [`PREFETCH_AHEAD`] elements on: one of each f32 stream a pass (the
        // gradient's every pass, though a bf16 line holds two passes' worth).
        prefetch(i + PREFETCH_AHEAD, p, g, m, v);
        // SAFETY: the caller's contract: elements i..i + 16 are in range.
        unsafe {
            let ga = _mm256_mul_ps(G::load8(g.add(i)), k.scale);
            let gb = _mm256_mul_ps(G::load8(g.add(i + 8)), k.scale);
            let (pa, ma, va) = update8::<FROM_M, RECIP>(
                _mm256_loadu_ps(p.add(i)),
                ga,
                _mm256_loadu_ps(m.add(i)),
                _mm256_loadu_ps(v.add(i)),
                &k,
            );
            let (pb, mb, vb) = update8::<FROM_M, RECIP>(
                _mm256_loadu_ps(p.add(i + 8)),
                gb,
                _mm256_loadu_ps(m.add(i + 8)),
                _mm256_loadu_ps(v.add(i + 8)),
                &k,
            );
            _mm256_storeu_ps(p.add(i), pa);
            _mm256_storeu_ps(p.add(i + 8), pb);
            _mm256_storeu_ps(m.add(i), ma);
            _mm256_storeu_ps(m.add(i + 8), mb);
            _mm256_storeu_ps(v.add(i), va);
            _mm256_storeu_ps(v.add(i + 8), vb);
            let copy16 = narrow16(pa, pb, &k);
            match copy {
                Copy16::Store => _mm256_storeu_si256(low.add(i).cast(), copy16),
                Copy16::Stream => _mm256_stream_si256(low.add(i).cast(), copy16),
            }
        }
        i += 16;
    }
}

/// Asks for the cache lines of element `i` of `p`, `g`, `m` and `v` (addresses computed with
/// wrapping arithmetic: a prefetch past the end of a slice neither faults nor reads anything
/// the program sees).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch<G>(i: usize, p: *mut f32, g: *const G, m: *mut f32, v: *mut f32) {
    // A prefetch is a hint: it never faults, whatever the address.
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i).cast());
    _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(i).cast());
    _mm_prefetch::<_MM_HINT_T0>(m.wrapping_add(i).cast());
    _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(i).cast());
}

copy_kernel_driver!("avx2,fma", "AVX2 and FMA", 32, 16, Load8);

/// [`narrow16`] on sixteen values, for tests.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn narrow16_of(x: &[f32; 16]) -> [u16; 16] {
    let k = Lanes::new(&Coeffs::new(1, &super::AdamWConfig::default(), 1.0));
    let mut out = [0u16; 16];
    // SAFETY: `x` holds sixteen f32 and `out` sixteen u16 (32 bytes).
    unsafe {
        let (a, b) = (
            _mm256_loadu_ps(x.as_ptr()),
            _mm256_loadu_ps(x.as_ptr().add(8)),
        );
        _mm256_storeu_si256(out.as_mut_ptr().cast(), narrow16(a, b, &k));
    }
    out
}
