//! The AVX-512 instance of the fused AdamW step with a bf16 copy, written with intrinsics:
//!
//! - thirty-two elements a pass, whose bf16 copy is one 64-byte line: two 16-lane vectors
//!   rounded to bf16 by the integer rounding of [`to_bf16`] and narrowed by `vpmovdw`, joined
//!   and stored by one 512-bit store;
//! - the copy of a tensor too large to stay in cache is written with streaming stores, one
//!   whole line each, so its lines are not read from memory only to be overwritten;
//! - each pass asks for the lines [`PREFETCH_AHEAD`] elements on (one core keeps more misses
//!   in flight than the hardware prefetchers alone start);
//! - a gradient in the parameter storage (the 14-byte layout) is read where it lies, each
//!   vector before the new parameter is stored over it, with no copy to the stack.
//!
//! The master weight and the moments are stored the ordinary way: their lines were just read
//! into the cache, and a streaming store to a cached line evicts it first (streaming them too
//! made the step 0.81-0.88x as fast on one thread at 4 and 32 Mi elements).
//!
//! `vcvtne2ps2bf16` (AVX512_BF16) would round two vectors in one instruction, but it flushes a
//! subnormal input to zero, where [`to_bf16`] (and `half`, and torch) round it: it is not used.
//! Every lane computes what [`update`] and [`to_bf16`] compute, with the same IEEE operations
//! in the same order, so the bits are those of every other instance.

use core::arch::x86_64::*;

use super::{bf16, to_bf16, update, Coeffs, Copy16, Src, Widen, PREFETCH_AHEAD};

/// A gradient element type this kernel reads sixteen at a time.
pub(super) trait Load16: Widen {
    /// Sixteen elements from `src`, widened to f32 exactly.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `src` is valid for reading sixteen elements.
    unsafe fn load16(src: *const Self) -> __m512;
}

impl Load16 for f32 {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load16(src: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(src) }
    }
}

impl Load16 for bf16 {
    /// Zero-extended to 32 bits, then shifted into the high half: the f32 with the same high
    /// bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load16(src: *const bf16) -> __m512 {
        // SAFETY: the caller's contract (sixteen bf16 are 32 bytes).
        unsafe {
            let x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))
        }
    }
}

/// The step's scalars broadcast to sixteen lanes, and the rounding's integer constants.
struct Lanes {
    scale: __m512,
    decay: __m512,
    lerp_a: __m512,
    beta2: __m512,
    one_minus_beta2: __m512,
    bc2_sqrt: __m512,
    bc2_recip: __m512,
    eps: __m512,
    neg_step_size: __m512,
    infinity: __m512,
    one: __m512i,
    bias: __m512i,
    quiet: __m512i,
}

impl Lanes {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn new(c: &Coeffs) -> Lanes {
        Lanes {
            scale: _mm512_set1_ps(c.grad_scale),
            decay: _mm512_set1_ps(c.decay),
            lerp_a: _mm512_set1_ps(c.lerp_a),
            beta2: _mm512_set1_ps(c.beta2),
            one_minus_beta2: _mm512_set1_ps(c.one_minus_beta2),
            bc2_sqrt: _mm512_set1_ps(c.bc2_sqrt),
            bc2_recip: _mm512_set1_ps(c.bc2_recip.unwrap_or(f32::NAN)),
            eps: _mm512_set1_ps(c.eps),
            neg_step_size: _mm512_set1_ps(c.neg_step_size),
            infinity: _mm512_set1_ps(f32::INFINITY),
            one: _mm512_set1_epi32(1),
            bias: _mm512_set1_epi32(0x7fff),
            quiet: _mm512_set1_epi32(0x40),
        }
    }
}

/// [`update`] on sixteen lanes: `p`, `g` (already scaled), `m`, `v` to the new `(p, m, v)`,
/// operation for operation.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn update16<const FROM_M: bool, const RECIP: bool>(
    p: __m512,
    g: __m512,
    m: __m512,
    v: __m512,
    k: &Lanes,
) -> (__m512, __m512, __m512) {
    let pi = _mm512_mul_ps(p, k.decay);
    let base = if FROM_M { m } else { g };
    let mi = _mm512_fmadd_ps(k.lerp_a, _mm512_sub_ps(g, m), base);
    let vi = _mm512_fmadd_ps(
        _mm512_mul_ps(k.one_minus_beta2, g),
        g,
        _mm512_mul_ps(v, k.beta2),
    );
    let root = _mm512_sqrt_ps(vi);
    let quotient = if RECIP {
        // `divide_by_bc2`: `q = root * y`, corrected by `(root - q * b) * y + q`; `q` itself
        // where `root` is infinite.
        let q = _mm512_mul_ps(root, k.bc2_recip);
        let corrected = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, k.bc2_sqrt, root), k.bc2_recip, q);
        let infinite = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(root, k.infinity);
        _mm512_mask_blend_ps(infinite, corrected, q)
    } else {
        _mm512_div_ps(root, k.bc2_sqrt)
    };
    let denom = _mm512_add_ps(quotient, k.eps);
    let step = _mm512_div_ps(_mm512_mul_ps(k.neg_step_size, mi), denom);
    (_mm512_add_ps(pi, step), mi, vi)
}

/// [`to_bf16`] on sixteen lanes, narrowed to sixteen 16-bit values in order (`vpmovdw`
/// truncates each lane, whose result is at most `0xffff`).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn round16(x: __m512, k: &Lanes) -> __m256i {
    let b = _mm512_castps_si512(x);
    let high = _mm512_srli_epi32::<16>(b);
    let bias = _mm512_add_epi32(_mm512_and_si512(high, k.one), k.bias);
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
    let nan = _mm512_or_si512(high, k.quiet);
    let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan))
}

/// Thirty-two lanes (`a`, then `b`) rounded to bf16, in order, as one 64-byte vector.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn narrow32(a: __m512, b: __m512, k: &Lanes) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(round16(a, k)), round16(b, k))
}

/// Elements `range` one at a time ([`update`] and [`to_bf16`], scalar, in AVX-512 code).
///
/// # Safety
/// The pointers are valid for the range; `g` may equal `low` (read before written).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
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

/// Asks for the cache lines of elements `i..i + 32` of `p`, `m`, `v` (two lines each) and
/// of `g` (one line of bf16, two of f32). Addresses are computed with wrapping arithmetic: a
/// prefetch past the end of a slice neither faults nor reads anything the program sees.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn prefetch<G>(i: usize, p: *mut f32, g: *const G, m: *mut f32, v: *mut f32) {
    // A prefetch is a hint: it never faults, whatever the address.
    for half in [i, i + 16] {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(half).cast());
        _mm_prefetch::<_MM_HINT_T0>(m.wrapping_add(half).cast());
        _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(half).cast());
    }
    _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(i).cast());
    if size_of::<G>() > 2 {
        _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(i + 16).cast());
    }
}

/// `n` elements from index `start`, thirty-two at a time (`n` a multiple of 32): two vectors
/// loaded, updated, stored, and their bf16 copy written as `copy` says (64-byte aligned at
/// `low + start` when streaming).
///
/// # Safety
/// AVX-512F, AVX2 and FMA; the pointers valid for the range; `g` may equal `low` (both
/// vectors of the gradient are loaded before the copy is stored over them).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn vectors<G: Load16, const FROM_M: bool, const RECIP: bool>(
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
        prefetch(i + PREFETCH_AHEAD, p, g, m, v);
        // SAFETY: the caller's contract: elements i..i + 32 are in range.
        unsafe {
            let ga = _mm512_mul_ps(G::load16(g.add(i)), k.scale);
            let gb = _mm512_mul_ps(G::load16(g.add(i + 16)), k.scale);
            let (pa, ma, va) = update16::<FROM_M, RECIP>(
                _mm512_loadu_ps(p.add(i)),
                ga,
                _mm512_loadu_ps(m.add(i)),
                _mm512_loadu_ps(v.add(i)),
                &k,
            );
            let (pb, mb, vb) = update16::<FROM_M, RECIP>(
                _mm512_loadu_ps(p.add(i + 16)),
                gb,
                _mm512_loadu_ps(m.add(i + 16)),
                _mm512_loadu_ps(v.add(i + 16)),
                &k,
            );
            _mm512_storeu_ps(p.add(i), pa);
            _mm512_storeu_ps(p.add(i + 16), pb);
            _mm512_storeu_ps(m.add(i), ma);
            _mm512_storeu_ps(m.add(i + 16), mb);
            _mm512_storeu_ps(v.add(i), va);
            _mm512_storeu_ps(v.add(i + 16), vb);
            let copy32 = narrow32(pa, pb, &k);
            match copy {
                Copy16::Store => _mm512_storeu_si512(low.add(i).cast(), copy32),
                Copy16::Stream => _mm512_stream_si512(low.add(i).cast(), copy32),
            }
        }
        i += 32;
    }
}

copy_kernel_driver!("avx512f,avx2,fma", "AVX-512F, AVX2 and FMA", 64, 32, Load16);

/// [`narrow32`] on thirty-two values, for tests.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn narrow32_of(x: &[f32; 32]) -> [u16; 32] {
    let k = Lanes::new(&Coeffs::new(1, &super::AdamWConfig::default(), 1.0));
    let mut out = [0u16; 32];
    // SAFETY: `x` holds thirty-two f32 and `out` thirty-two u16 (64 bytes).
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        _mm512_storeu_si512(out.as_mut_ptr().cast(), narrow32(a, b, &k));
    }
    out
}
