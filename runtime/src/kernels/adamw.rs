//! `torch.optim.AdamW` (single-tensor path) and the pieces of `clip_grad_norm_`.

use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::math::{fast_in, Isa, ELEM_GRAIN};
use super::share::share_out;

/// The driver of an intrinsics kernel for steps with a bf16 copy, the same for every width:
/// `run` (one block: the head before the copy's first `$align`-byte address one element at a
/// time where the copy is streamed, the body `$lanes` at a time, the rest one at a time, from
/// any gradient form) and `split` (the lerp form and division the step's scalars choose),
/// compiled for the instruction sets `$features` (`$cpu` in the safety contracts), reading
/// gradients through the kernel's `$load` trait and calling its `scalar` and `vectors`.
#[cfg(target_arch = "x86_64")]
macro_rules! copy_kernel_driver {
    ($features:literal, $cpu:literal, $align:literal, $lanes:literal, $load:ident) => {
        /// One block with a bf16 copy: [`super::block`]'s result for every element, from the
        /// gradient `g` (or the copy's storage, [`Src::InLow`]), the copy stored as `copy`
        /// says.
        ///
        /// # Safety
        #[doc = concat!("The CPU has ", $cpu, ".")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn run(
            p: &mut [f32],
            g: Src<'_>,
            m: &mut [f32],
            v: &mut [f32],
            low: &mut [bf16],
            copy: Copy16,
            c: &Coeffs,
        ) {
            let n = p.len();
            assert!(
                m.len() == n && v.len() == n && low.len() == n,
                "adamw: lengths differ"
            );
            let (pp, mp, vp, lp) = (
                p.as_mut_ptr(),
                m.as_mut_ptr(),
                v.as_mut_ptr(),
                low.as_mut_ptr(),
            );
            // Streaming stores need aligned addresses: the elements before the copy's first
            // such address go one at a time.
            let head = match copy {
                Copy16::Stream => lp.align_offset($align).min(n),
                Copy16::Store => 0,
            };
            let body = (n - head) / $lanes * $lanes;
            // SAFETY: every range `split` touches is within the slices' common length `n`;
            // the instruction sets are the caller's contract.
            unsafe {
                match g {
                    Src::F32(g) => {
                        assert_eq!(g.len(), n, "adamw: lengths differ");
                        split(head, body, n, pp, g.as_ptr(), mp, vp, lp, copy, c);
                    }
                    Src::Bf16(g) => {
                        assert_eq!(g.len(), n, "adamw: lengths differ");
                        split(head, body, n, pp, g.as_ptr(), mp, vp, lp, copy, c);
                    }
                    Src::InLow => split(head, body, n, pp, lp.cast_const(), mp, vp, lp, copy, c),
                }
                if copy == Copy16::Stream {
                    // Streaming stores are weakly ordered: make them visible before the step
                    // returns (another thread, or a copy engine, reads the copy next).
                    _mm_sfence();
                }
            }
        }

        /// The head one at a time, the body a vector pass at a time, the rest one at a time,
        /// for the lerp form and division the step's scalars choose.
        ///
        /// # Safety
        /// As [`vectors`], for `0..n`.
        #[inline]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn split<G: $load>(
            head: usize,
            body: usize,
            n: usize,
            p: *mut f32,
            g: *const G,
            m: *mut f32,
            v: *mut f32,
            low: *mut bf16,
            copy: Copy16,
            c: &Coeffs,
        ) {
            macro_rules! go {
                ($from_m:literal, $recip:literal) => {{
                    // SAFETY: the caller's contract.
                    unsafe {
                        scalar::<G, $from_m, $recip>(0..head, p, g, m, v, low, c);
                        vectors::<G, $from_m, $recip>(head, body, p, g, m, v, low, copy, c);
                        scalar::<G, $from_m, $recip>(head + body..n, p, g, m, v, low, c);
                    }
                }};
            }
            match (c.lerp_from_m, c.bc2_recip.is_some()) {
                (true, true) => go!(true, true),
                (true, false) => go!(true, false),
                (false, true) => go!(false, true),
                (false, false) => go!(false, false),
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// AdamW hyper-parameters, as `torch.optim.AdamW` takes them. `f64` because torch does the
/// scalar arithmetic (bias corrections, step size) in Python floats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// torch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2.
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// The bf16 type the fused step writes and reads (`half::bf16`), re-exported for callers.
pub use half::bf16;
/// The f16 type the fused step writes and reads (`half::f16`), re-exported for callers.
pub use half::f16;

/// Elements per rayon task of [`adamw_step_fused`]: 32 Ki elements are 128 KiB of each f32
/// stream, enough to amortise a task and to let the hardware prefetchers run; the block
/// boundaries depend only on the length, and no element's result depends on its block.
pub const ADAMW_BLOCK: usize = 1 << 15;

/// The gradient one step reads: f32, or bf16 (widened exactly, element by element, as it is
/// read; no widened copy is made).
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    /// An f32 gradient.
    F32(&'a [f32]),
    /// A bf16 gradient (of a bf16 parameter with an f32 master weight).
    Bf16(&'a [bf16]),
    /// An f16 gradient (of an f16 parameter with an f32 master weight).
    F16(&'a [f16]),
    /// The gradient is what the narrow parameter storage (`low`) holds: the 14-byte host
    /// layout, where a chunk's bf16 (f16) gradients land in its parameter storage after the
    /// chunk's last upload of the step. Each element is read before the new parameter is
    /// written over it, so the result is the bits of the same gradient given apart.
    InLow,
}

/// The narrow copy of the parameter one step writes beside its f32 master weight (a mixed
/// precision parameter's storage), rounded to nearest even in the same pass.
#[derive(Debug)]
pub enum Low<'a> {
    /// A bf16 parameter.
    Bf16(&'a mut [bf16]),
    /// An f16 parameter.
    F16(&'a mut [f16]),
}

impl Low<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Low::Bf16(x) => x.len(),
            Low::F16(x) => x.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Grad<'_> {
    /// Elements; `None` for [`Grad::InLow`], which has the parameter storage's.
    pub fn len(&self) -> Option<usize> {
        match self {
            Grad::F32(g) => Some(g.len()),
            Grad::Bf16(g) => Some(g.len()),
            Grad::F16(g) => Some(g.len()),
            Grad::InLow => None,
        }
    }

    /// Whether it has no elements (`false` for [`Grad::InLow`], whose storage decides).
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }
}

/// The f32 scalars of one step, rounded from Python-float arithmetic as torch rounds a Python
/// scalar that meets an f32 tensor.
#[derive(Clone, Copy)]
struct Coeffs {
    /// `1 - lr * wd`; exactly 1 without weight decay, and `p * 1` is `p` to the bit.
    decay: f32,
    /// The FMA's multiplier in `exp_avg.lerp_(grad, w)`: `w` when `|w| < 0.5`, else `w - 1`.
    lerp_a: f32,
    /// Whether the FMA adds to `m` (`|w| < 0.5`) or to `g` (otherwise).
    lerp_from_m: bool,
    beta2: f32,
    one_minus_beta2: f32,
    bc2_sqrt: f32,
    /// `1 / bc2_sqrt` rounded to f32, when dividing by `bc2_sqrt` may be done with it
    /// ([`divide_by_bc2`]); `None` where `bc2_sqrt` is zero, subnormal or infinite.
    bc2_recip: Option<f32>,
    eps: f32,
    neg_step_size: f32,
    /// The gradient's scale (the clip coefficient); exactly 1 when unclipped.
    grad_scale: f32,
    /// Whether the bf16 copy is written with streaming stores ([`STREAM_MIN`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    stream_copy: bool,
}

impl Coeffs {
    fn new(step: u64, cfg: &AdamWConfig, grad_scale: f32) -> Coeffs {
        assert!(step >= 1, "adamw: step is 1-based");
        let t = step as f64;
        let bias_correction1 = 1.0 - cfg.beta1.powf(t);
        let bias_correction2 = 1.0 - cfg.beta2.powf(t);
        let step_size = cfg.lr / bias_correction1;
        let lerp_w = (1.0 - cfg.beta1) as f32;
        Coeffs {
            decay: match cfg.weight_decay != 0.0 {
                true => (1.0 - cfg.lr * cfg.weight_decay) as f32,
                false => 1.0,
            },
            lerp_a: if lerp_w.abs() < 0.5 {
                lerp_w
            } else {
                lerp_w - 1.0
            },
            lerp_from_m: lerp_w.abs() < 0.5,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            bc2_sqrt: bias_correction2.sqrt() as f32,
            bc2_recip: {
                let b = bias_correction2.sqrt() as f32;
                let y = 1.0 / b;
                (b.is_normal() && y.is_normal()).then_some(y)
            },
            eps: cfg.eps as f32,
            neg_step_size: (-step_size) as f32,
            grad_scale,
            stream_copy: false,
        }
    }
}

/// One element, in the order of torch's `_single_tensor_adam` with
/// `decoupled_weight_decay=True` and the CPU kernels it calls:
/// `param.mul_(1 - lr * wd)`; `exp_avg.lerp_(grad, 1 - beta1)` (an FMA, as `lerp_vec`:
/// `fma(w, g - m, m)` for `|w| < 0.5`, else `fma(w - 1, g - m, g)`);
/// `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` (`fma(c * g, g, v)`: torch's
/// vectorised `addcmul` fuses the last multiply-add; found by matching its bits);
/// `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`;
/// `param.addcdiv_(exp_avg, denom, value=-step_size)` (`p + (s * m) / denom`).
/// Every operation is an IEEE one (add, multiply, FMA, divide, square root), so its vector
/// form gives the scalar bits. `g` arrives already scaled (`g * s` rounds as `scale` does).
#[inline(always)]
/// `RECIP` says whether `c.bc2_recip` is given ([`divide_by_bc2`]).
fn update<const FROM_M: bool, const RECIP: bool>(
    p: f32,
    g: f32,
    m: f32,
    v: f32,
    c: &Coeffs,
) -> (f32, f32, f32) {
    let pi = p * c.decay;
    let mi = c.lerp_a.mul_add(g - m, if FROM_M { m } else { g });
    let vi = (c.one_minus_beta2 * g).mul_add(g, v * c.beta2);
    let denom = divide_by_bc2::<RECIP>(vi.sqrt(), c) + c.eps;
    (pi + (c.neg_step_size * mi) / denom, mi, vi)
}

/// `root / c.bc2_sqrt` rounded to f32, to the bit, with one divider operation fewer per element
/// where the reciprocal allows it: `q = root * y` with `y = RN(1 / b)`, then one correction
/// `q + (root - q * b) * y`, both by FMA. Markstein's theorem (Handbook of Floating-Point
/// Arithmetic, 2nd ed., Theorem 4.10): with `y` the correctly rounded reciprocal of `b` and
/// `q` within one ulp of `root / b`, the remainder `root - q * b` is exact and the corrected
/// quotient is the correctly rounded `root / b`, barring underflow and overflow. Neither can
/// occur here: `root` is a square root of an f32, so 0 or at least 2^-74.5, and at most
/// 2^64; `b` is a normal number at most 1 (`bias_correction2` is in (0, 1]), so the quotient
/// is no smaller than `root` and below 2^64 / b, finite for any `b` whose reciprocal is. The
/// one exception is an infinite `root` (an overflowed second moment), where the remainder is
/// NaN: that quotient is infinite, as `q` is. The divider is what bounds this kernel on data
/// in cache (a square root and two divides per element, 16 lanes each taking it about ten
/// cycles); the multiply and two FMAs run on the other ports.
///
/// `RECIP` is whether `c.bc2_recip` is given, decided by the caller so that a loop over
/// elements has no branch in it: a choice made per element leaves a branch per vector in the
/// AVX2 instance, and the comparison's mask is then repacked through 16-bit lanes.
#[inline(always)]
fn divide_by_bc2<const RECIP: bool>(root: f32, c: &Coeffs) -> f32 {
    match c.bc2_recip {
        Some(y) if RECIP => {
            let q = root * y;
            let corrected = (-q).mul_add(c.bc2_sqrt, root).mul_add(y, q);
            if root == f32::INFINITY {
                q
            } else {
                corrected
            }
        }
        _ => root / c.bc2_sqrt,
    }
}

/// A gradient element type: widened to f32 exactly.
trait Widen: Copy {
    fn widen(self) -> f32;

    /// The gradient as the intrinsics kernels ([`avx2`], [`avx512`]) read it, where they read
    /// this type.
    #[cfg(target_arch = "x86_64")]
    fn simd_src(g: &[Self]) -> Option<Src<'_>> {
        let _ = g;
        None
    }
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    fn simd_src(g: &[f32]) -> Option<Src<'_>> {
        Some(Src::F32(g))
    }
}

impl Widen for bf16 {
    /// The bf16 bits are the high half of the f32's (written with shifts so it vectorises).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    fn simd_src(g: &[bf16]) -> Option<Src<'_>> {
        Some(Src::Bf16(g))
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// A narrow storage type a step rounds the new weight to.
trait Narrow: Copy + Send + Sync {
    /// `x` rounded to nearest, ties to even.
    fn narrow(x: f32) -> Self;

    /// The storage as bf16, where this type is bf16 (the intrinsics kernels write only bf16).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn as_bf16(x: &mut [Self]) -> Option<&mut [bf16]> {
        let _ = x;
        None
    }
}

impl Narrow for bf16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        to_bf16(x)
    }

    fn as_bf16(x: &mut [bf16]) -> Option<&mut [bf16]> {
        Some(x)
    }
}

impl Narrow for f16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// `x` rounded to bf16 to nearest, ties to even; a NaN stays a quiet NaN. The same bits as
/// `half::bf16::from_f32`, written without branches so it vectorises.
#[inline(always)]
pub fn to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    // Wraps only for NaNs (above 0xffff_8000), whose result is replaced below.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    // A float comparison: one instruction a vector, where testing the bits takes three on AVX2.
    bf16::from_bits(if x.is_nan() { nan } else { rounded } as u16)
}

/// Elements from which a step's bf16 copy is written with streaming stores (AVX2, AVX-512):
/// a step over a million elements moves 30 MB or more (28 bytes an element, and the copy),
/// more than the share of the last-level cache its cores hold, so the copy's cache lines would
/// be read from memory only to be overwritten, and evicted before the upload reads them. Below
/// it the copy may stay in cache for the upload.
const STREAM_MIN: usize = 1 << 20;

/// How far ahead of the element it updates a step asks for cache lines (`prefetcht0`), in
/// elements: 512 are 2 KiB of each f32 stream, about 30 lines in flight over the four or five
/// streams. A step's rate on memory is bounded by the misses one core keeps in flight, not by
/// the memory's bandwidth, and the core keeps more in flight this way than its hardware
/// prefetchers start on their own: on one thread at 32 Mi elements the f32 step ran 1.11-1.32x
/// and the step with a bf16 copy 1.21-1.36x as fast with it (`benches/RESULTS.md`,
/// 2026-12-06). 1,024 and 2,048 elements ahead gained less on AVX2 and AVX-512; 256 as much on
/// AVX-512 and less on AVX2.
const PREFETCH_AHEAD: usize = 512;

/// Elements [`block`] updates between prefetches: 64 are four lines of each f32 stream. Asked
/// for a few lines at a time, the prefetches interleave with the loop's loads; asked for 256
/// elements' lines at once, they fill the core's miss buffers in bursts and gained a third as
/// much or less.
const PIECE: usize = 64;

/// The gradient an intrinsics kernel ([`avx2`], [`avx512`]) reads.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Src<'a> {
    /// f32.
    F32(&'a [f32]),
    /// bf16.
    Bf16(&'a [bf16]),
    /// bf16 in the bf16 copy's storage, each element read before the new weight is stored
    /// over it.
    InLow,
}

/// How an intrinsics kernel ([`avx2`], [`avx512`]) stores the new weight rounded to bf16.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copy16 {
    /// Ordinary stores (the copy is read again soon, or its lines were just read: the
    /// gradient in the parameter storage).
    Store,
    /// Streaming stores, aligned to the vector's width: the lines are written whole without
    /// being read.
    Stream,
}

/// Asks for the cache lines of `len` elements of `x` from element `from` (addresses computed
/// with wrapping arithmetic: a prefetch past the end of a slice neither faults nor reads
/// anything the program sees). A no-op off x86-64.
#[inline(always)]
fn prefetch_lines<T>(x: *const T, from: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let first = x.wrapping_add(from).cast::<u8>();
        let mut at = 0;
        while at < len * size_of::<T>() {
            // SAFETY: SSE is in every x86-64 CPU; a prefetch is a hint, and never faults,
            // whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(at).cast()) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, from, len);
}

/// One block: `p`, `m`, `v` updated in place from `g`, and `low` (when given, the same
/// length) set to the new `p` rounded to bf16 in the same pass; in [`PIECE`]-element pieces,
/// each after a request for the lines [`PREFETCH_AHEAD`] elements on. Elementwise, so the
/// pieces change no bit.
#[inline(always)]
fn block<G: Widen, L: Narrow, const FROM_M: bool, const RECIP: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    mut low: Option<&mut [L]>,
    c: &Coeffs,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let mut start = 0;
    while start < n {
        let end = (start + PIECE).min(n);
        let ahead = start + PREFETCH_AHEAD;
        prefetch_lines(p.as_ptr(), ahead, PIECE);
        prefetch_lines(g.as_ptr(), ahead, PIECE);
        prefetch_lines(m.as_ptr(), ahead, PIECE);
        prefetch_lines(v.as_ptr(), ahead, PIECE);
        let low = low.as_deref_mut().map(|low| &mut low[start..end]);
        piece::<G, L, FROM_M, RECIP>(
            &mut p[start..end],
            &g[start..end],
            &mut m[start..end],
            &mut v[start..end],
            low,
            c,
        );
        start = end;
    }
}

/// One piece of a [`block`], element by element (vectorised by LLVM in each instance).
#[inline(always)]
fn piece<G: Widen, L: Narrow, const FROM_M: bool, const RECIP: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    low: Option<&mut [L]>,
    c: &Coeffs,
) {
    let n = p.len();
    // The scalars as locals: read through `c`, LLVM's AVX2 cost model finds the loop not worth
    // vectorising (the AVX-512 instance is vectorised either way).
    let c = &{ *c };
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    match low {
        Some(low) => {
            let low = &mut low[..n];
            for i in 0..n {
                let gi = g[i].widen() * c.grad_scale;
                let (pi, mi, vi) = update::<FROM_M, RECIP>(p[i], gi, m[i], v[i], c);
                (p[i], m[i], v[i], low[i]) = (pi, mi, vi, L::narrow(pi));
            }
        }
        None => {
            for i in 0..n {
                let gi = g[i].widen() * c.grad_scale;
                let (pi, mi, vi) = update::<FROM_M, RECIP>(p[i], gi, m[i], v[i], c);
                (p[i], m[i], v[i]) = (pi, mi, vi);
            }
        }
    }
}

/// [`block`] for both lerp forms and both divisions, in the CPU's widest instruction set ([`Isa::detect`]).
fn run_block<G: Widen, L: Narrow>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    low: Option<&mut [L]>,
    c: &Coeffs,
) {
    // SAFETY: the instruction set was detected on this CPU.
    unsafe { block_in(Isa::detect(), p, g, m, v, low, c) }
}

/// [`block`] compiled for `isa` through [`fast_in`], `block` inlined into the instance (it
/// and the closure are `#[inline(always)]`), so its loop is vectorised for it: `vdivps` and
/// `vsqrtps` on `ymm` or `zmm` registers and `vfmadd`, not `divss` and calls to `fmaf`. Every instance
/// gives the same bits (each operation is an IEEE add, multiply, FMA, divide or square root,
/// or integer bit work, in every lane alike). A step with a bf16 copy runs the intrinsics of
/// [`avx2`] or [`avx512`] instead (one pack, or one 512-bit store, per line of the copy;
/// streaming stores from [`STREAM_MIN`] elements; the lines [`PREFETCH_AHEAD`] on asked for
/// every pass). Tests call each instance the CPU has, to compare their bits.
///
/// # Safety
/// The CPU must have `isa`.
unsafe fn block_in<G: Widen, L: Narrow>(
    isa: Isa,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))] mut low: Option<&mut [L]>,
    c: &Coeffs,
) {
    // A step that writes a bf16 copy runs the kernel written with intrinsics ([`avx2`],
    // [`avx512`]); an f32 step (no copy) runs the generic loop, which LLVM vectorises as well.
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Baseline {
        if let (Some(src), Some(low)) = (G::simd_src(g), low.as_deref_mut().and_then(L::as_bf16)) {
            let copy = match c.stream_copy {
                true => Copy16::Stream,
                false => Copy16::Store,
            };
            // SAFETY: the caller's contract.
            return unsafe {
                match isa {
                    Isa::Avx512 => avx512::run(p, src, m, v, low, copy, c),
                    _ => avx2::run(p, src, m, v, low, copy, c),
                }
            };
        }
    }
    // SAFETY: the caller's contract.
    unsafe {
        fast_in(
            isa,
            #[inline(always)]
            || match (c.lerp_from_m, c.bc2_recip.is_some()) {
                (true, true) => block::<G, L, true, true>(p, g, m, v, low, c),
                (true, false) => block::<G, L, true, false>(p, g, m, v, low, c),
                (false, true) => block::<G, L, false, true>(p, g, m, v, low, c),
                (false, false) => block::<G, L, false, false>(p, g, m, v, low, c),
            },
        )
    }
}

/// One block of one tensor's step in [`adamw_steps_fused`]: at most [`ADAMW_BLOCK`] elements
/// of each of its operands, and the tensor's coefficients.
struct Piece<'a> {
    /// Which step of the run it belongs to.
    tensor: usize,
    p: &'a mut [f32],
    grad: Grad<'a>,
    m: &'a mut [f32],
    v: &'a mut [f32],
    low: Option<Low<'a>>,
    c: &'a Coeffs,
}

impl<'a> Piece<'a> {
    /// `step` (tensor `tensor` of a run) cut into [`ADAMW_BLOCK`]-element blocks, appended to
    /// `out`: the boundaries depend only on the length.
    fn cut(tensor: usize, step: AdamWStep<'a>, c: &'a Coeffs, out: &mut Vec<Piece<'a>>) {
        let AdamWStep {
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            mut low,
            ..
        } = step;
        let mut grad = grad;
        let (mut p, mut m, mut v) = (master, exp_avg, exp_avg_sq);
        while !p.is_empty() {
            let n = p.len().min(ADAMW_BLOCK);
            let (p0, p1) = std::mem::take(&mut p).split_at_mut(n);
            let (m0, m1) = std::mem::take(&mut m).split_at_mut(n);
            let (v0, v1) = std::mem::take(&mut v).split_at_mut(n);
            let (g0, g1) = grad.split_at(n);
            let (l0, l1) = match low {
                None => (None, None),
                Some(Low::Bf16(l)) => {
                    let (a, b) = l.split_at_mut(n);
                    (Some(Low::Bf16(a)), Some(Low::Bf16(b)))
                }
                Some(Low::F16(l)) => {
                    let (a, b) = l.split_at_mut(n);
                    (Some(Low::F16(a)), Some(Low::F16(b)))
                }
            };
            out.push(Piece {
                tensor,
                p: p0,
                grad: g0,
                m: m0,
                v: v0,
                low: l0,
                c,
            });
            (p, m, v, grad, low) = (p1, m1, v1, g1, l1);
        }
    }

    /// Runs the block: [`run_block`] on the gradient as given, or [`in_low_block`] on a
    /// gradient in the parameter storage.
    fn run(self) {
        let Piece {
            p,
            grad,
            m,
            v,
            low,
            c,
            ..
        } = self;
        fn with_grad<L: Narrow>(
            p: &mut [f32],
            grad: Grad<'_>,
            m: &mut [f32],
            v: &mut [f32],
            low: Option<&mut [L]>,
            c: &Coeffs,
        ) {
            match grad {
                Grad::F32(g) => run_block(p, g, m, v, low, c),
                Grad::Bf16(g) => run_block(p, g, m, v, low, c),
                Grad::F16(g) => run_block(p, g, m, v, low, c),
                Grad::InLow => unreachable!("handled below"),
            }
        }
        match (grad, low) {
            (Grad::InLow, Some(Low::Bf16(low))) => in_low_block(p, low, m, v, c),
            (Grad::InLow, Some(Low::F16(low))) => in_low_block(p, low, m, v, c),
            (Grad::InLow, None) => unreachable!("checked when the step was cut"),
            (grad, None) => with_grad::<bf16>(p, grad, m, v, None, c),
            (grad, Some(Low::Bf16(low))) => with_grad(p, grad, m, v, Some(low), c),
            (grad, Some(Low::F16(low))) => with_grad(p, grad, m, v, Some(low), c),
        }
    }
}

impl<'a> Grad<'a> {
    /// The first `n` elements and the rest; [`Grad::InLow`] both times.
    fn split_at(self, n: usize) -> (Grad<'a>, Grad<'a>) {
        match self {
            Grad::F32(g) => (Grad::F32(&g[..n]), Grad::F32(&g[n..])),
            Grad::Bf16(g) => (Grad::Bf16(&g[..n]), Grad::Bf16(&g[n..])),
            Grad::F16(g) => (Grad::F16(&g[..n]), Grad::F16(&g[n..])),
            Grad::InLow => (Grad::InLow, Grad::InLow),
        }
    }
}

/// Elements of the stack copy [`in_low_block`] takes of a gradient before the new parameter
/// is written over it (8 KiB of bf16).
const IN_LOW_PIECE: usize = 4096;

/// One block with the gradient in the narrow parameter storage `low` (the 14-byte host
/// layout): each piece of the gradient is copied to the stack, then the step reads the copy
/// and writes the new parameter over the gradient; the intrinsics kernels for bf16
/// ([`avx2`], [`avx512`]) read each vector of the gradient where it lies before storing over
/// it, with no copy. Elementwise, so the pieces change no bit.
fn in_low_block<L: Narrow + Widen + Default>(
    p: &mut [f32],
    low: &mut [L],
    m: &mut [f32],
    v: &mut [f32],
    c: &Coeffs,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(low) = L::as_bf16(low) {
        let (src, copy) = (Src::InLow, Copy16::Store);
        // SAFETY: the instruction set was detected on this CPU.
        match Isa::detect() {
            Isa::Avx512 => return unsafe { avx512::run(p, src, m, v, low, copy, c) },
            Isa::Avx2 => return unsafe { avx2::run(p, src, m, v, low, copy, c) },
            Isa::Baseline => {}
        }
    }
    let mut g = [L::default(); IN_LOW_PIECE];
    for (((p, low), m), v) in p
        .chunks_mut(IN_LOW_PIECE)
        .zip(low.chunks_mut(IN_LOW_PIECE))
        .zip(m.chunks_mut(IN_LOW_PIECE))
        .zip(v.chunks_mut(IN_LOW_PIECE))
    {
        let g = &mut g[..low.len()];
        g.copy_from_slice(low);
        run_block(p, g, m, v, Some(low), c);
    }
}

/// One tensor's AdamW step, as [`adamw_step_fused`] takes it: a member of a run of steps
/// that [`adamw_steps_fused`] updates in one parallel pass.
#[derive(Debug)]
pub struct AdamWStep<'a> {
    /// The f32 master weight (the parameter itself when it is f32).
    pub master: &'a mut [f32],
    /// The gradient.
    pub grad: Grad<'a>,
    /// The gradient's multiplier (the clip coefficient), when it has one.
    pub grad_scale: Option<f32>,
    /// The first moment.
    pub exp_avg: &'a mut [f32],
    /// The second moment.
    pub exp_avg_sq: &'a mut [f32],
    /// The narrow parameter the new master weight is rounded into, for a bf16 (f16) one.
    pub low: Option<Low<'a>>,
    /// The 1-based step count after this step's increment.
    pub step: u64,
    /// The hyperparameters.
    pub config: AdamWConfig,
}

impl AdamWStep<'_> {
    /// Panics when the operands' lengths differ, or when a gradient in the parameter storage
    /// comes without that storage.
    fn check(&self) {
        let n = self.master.len();
        if let Some(len) = self.grad.len() {
            assert_eq!(len, n, "adamw: grad length differs from param");
        }
        assert_eq!(
            self.exp_avg.len(),
            n,
            "adamw: exp_avg length differs from param"
        );
        assert_eq!(
            self.exp_avg_sq.len(),
            n,
            "adamw: exp_avg_sq length differs from param"
        );
        match &self.low {
            Some(low) => assert_eq!(
                low.len(),
                n,
                "adamw: narrow parameter length differs from master"
            ),
            None => assert!(
                !matches!(self.grad, Grad::InLow),
                "adamw: a gradient in the parameter storage needs that storage"
            ),
        }
    }

    /// Its coefficients.
    fn coeffs(&self) -> Coeffs {
        let mut c = Coeffs::new(self.step, &self.config, self.grad_scale.unwrap_or(1.0));
        c.stream_copy = self.master.len() >= STREAM_MIN;
        c
    }
}

/// The AdamW steps of several tensors (a host optimizer's run of AdamW ops) in one parallel
/// pass: every [`ADAMW_BLOCK`]-element block of every tensor is one task of the same
/// parallel loop, so a thread goes on to the next tensor's blocks instead of waiting at the
/// end of each tensor for the thread that holds its last block. That wait is what a run of
/// steps one after another pays for each tensor of several blocks, and it is long where
/// other threads share the cores: a thread descheduled in the middle of a block holds up
/// the tensor for the scheduler's time slice. Here it holds up only its own block, and the
/// run ends once.
///
/// `ended(i)` is called as soon as the last block of `steps[i]` is done, on the thread that
/// did it; blocks are taken in no fixed order, so the tensors end in no fixed order either.
/// A run of one block runs on the calling thread. Each element's result is the bits of
/// [`adamw_step_fused`] on its tensor alone, for any thread count and any order. The steps'
/// slices are distinct borrows, so no two tensors share memory. Panics as
/// [`adamw_step_fused`].
pub fn adamw_steps_fused(steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)) {
    in_pieces(steps, ended, |pieces, run| match pieces.len() {
        // One block has no second thread to share it with: a hand-over to the pool and back
        // would only add a wake-up (a schedule's optimizer stream issues every bias and norm
        // weight as an AdamW op of its own).
        0 | 1 => pieces.into_iter().for_each(run),
        _ => pieces.into_par_iter().for_each(run),
    });
}

/// [`adamw_steps_fused`] worked on by the calling thread itself from the first moment, with
/// the threads of `pool` joining in as they wake ([`share_out`]): the call returns as soon as
/// the last block is done, neither waiting for a pool thread to take the run on nor for the
/// calling thread to be woken when it ends. Where other threads hold the cores each of those
/// waits is a woken thread waiting for a core, up to the scheduler's time slice, at both ends
/// of every run. The same bits.
pub fn adamw_steps_beside(
    steps: Vec<AdamWStep<'_>>,
    ended: &(dyn Fn(usize) + Sync),
    pool: &rayon::ThreadPool,
) {
    in_pieces(steps, ended, |pieces, run| share_out(pieces, run, pool));
}

/// Checks `steps`, cuts them into [`Piece`]s and hands them to `each` with the work of one
/// piece, which calls `ended(i)` when the last piece of `steps[i]` is done (at once for an
/// empty step).
fn in_pieces(
    steps: Vec<AdamWStep<'_>>,
    ended: &(dyn Fn(usize) + Sync),
    each: impl FnOnce(Vec<Piece<'_>>, &(dyn Fn(Piece<'_>) + Sync)),
) {
    for step in &steps {
        step.check();
    }
    let coeffs: Vec<Coeffs> = steps.iter().map(AdamWStep::coeffs).collect();
    let left: Vec<AtomicUsize> = steps
        .iter()
        .map(|s| AtomicUsize::new(s.master.len().div_ceil(ADAMW_BLOCK)))
        .collect();
    let mut pieces = Vec::with_capacity(left.iter().map(|n| n.load(Ordering::Relaxed)).sum());
    for (i, (step, c)) in steps.into_iter().zip(&coeffs).enumerate() {
        if step.master.is_empty() {
            ended(i);
        }
        Piece::cut(i, step, c, &mut pieces);
    }
    let run = |piece: Piece<'_>| {
        let tensor = piece.tensor;
        piece.run();
        if left[tensor].fetch_sub(1, Ordering::AcqRel) == 1 {
            ended(tensor);
        }
    };
    each(pieces, &run);
}

/// The AdamW steps of several tensors one after another, each in its own parallel pass
/// ([`adamw_step_fused`]), calling `ended(i)` as `steps[i]` is done: the same bits as
/// [`adamw_steps_fused`], with a wait for each tensor's last block.
pub fn adamw_steps_in_turn(steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)) {
    for (i, step) in steps.into_iter().enumerate() {
        adamw_steps_fused(vec![step], &|_| {});
        ended(i);
    }
}

/// One AdamW step over a parameter tensor in one pass over memory: the f32 `master` weight
/// and the moments `exp_avg`, `exp_avg_sq` are read and updated in place from `grad` (f32 or
/// bf16, multiplied by `grad_scale` when given, the clip coefficient), and when `low` is given
/// the new weight rounded to bf16 is written there (the copy the next upload sends), in the
/// same pass. `step` is the 1-based step count after this step's increment.
///
/// Per element it is `torch.optim.AdamW(foreach=False)` on CPU to the bit, on `grad *
/// grad_scale` rounded to f32 (what `clip_grad_norm_` leaves in the gradient); vectorised
/// (AVX-512F, else AVX2 + FMA, as the CPU has them, chosen at run time) and parallel over fixed
/// [`ADAMW_BLOCK`]-element blocks. Elementwise with no reduction, so the result is the same
/// bits for any thread count. Panics when the lengths differ.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step_fused(
    master: &mut [f32],
    grad: Grad<'_>,
    grad_scale: Option<f32>,
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    low: Option<Low<'_>>,
    step: u64,
    cfg: &AdamWConfig,
) {
    let step = AdamWStep {
        master,
        grad,
        grad_scale,
        exp_avg,
        exp_avg_sq,
        low,
        step,
        config: *cfg,
    };
    adamw_steps_fused(vec![step], &|_| {});
}

/// One AdamW step over an f32 parameter tensor, exactly as `torch.optim.AdamW(foreach=False)`
/// on CPU, so results agree with PyTorch to the bit: [`adamw_step_fused`] with an f32
/// gradient, no scale and no bf16 copy. Updates `param`, `exp_avg` and `exp_avg_sq` in place;
/// all four slices have the same length.
pub fn adamw_step(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    step: u64,
    cfg: &AdamWConfig,
) {
    adamw_step_fused(
        param,
        Grad::F32(grad),
        None,
        exp_avg,
        exp_avg_sq,
        None,
        step,
        cfg,
    );
}

/// `sum x^2` in f64 (each square is exact in f64). Summed over a binary tree of fixed-size
/// leaves whose shape depends only on `x.len()`, so the result is the same bits for any thread
/// count. The squared L2 norm of one gradient tensor, for `clip_grad_norm_`.
pub fn grad_norm_sq(x: &[f32]) -> f64 {
    if x.len() <= ELEM_GRAIN {
        let mut acc = [0.0f64; 4];
        let c = x.chunks_exact(4);
        let tail: f64 = c.remainder().iter().map(|&v| v as f64 * v as f64).sum();
        for v in c {
            for i in 0..4 {
                acc[i] += v[i] as f64 * v[i] as f64;
            }
        }
        return (acc[0] + acc[2]) + (acc[1] + acc[3]) + tail;
    }
    let mid = (x.len() / 2).next_multiple_of(ELEM_GRAIN);
    let (a, b) = rayon::join(|| grad_norm_sq(&x[..mid]), || grad_norm_sq(&x[mid..]));
    a + b
}

/// `clip_grad_norm_`'s factor: `min(max_norm / (total_norm + 1e-6), 1)`, in f32 as torch
/// computes it on a tensor (`max_norm / t` is `t.reciprocal() * max_norm`; the clamp is
/// `torch.clamp(coef, max=1.0)`). `total_norm` is `sqrt` of the sum of every gradient's
/// [`grad_norm_sq`]. torch then multiplies every gradient by the factor unconditionally, which
/// [`scale`] does; a factor of exactly 1 leaves them unchanged.
pub fn clip_coef(total_norm: f32, max_norm: f64) -> f32 {
    let coef = (1.0 / (total_norm + 1e-6)) * max_norm as f32;
    if coef > 1.0 {
        1.0
    } else {
        coef
    }
}

/// The coefficient [`unscale_coef`] gives a step whose gradients overflowed: negative, which
/// no clip coefficient is (an AdamW op reading it changes nothing; see [`skips_step`]).
pub const SKIP_STEP: f32 = -1.0;

/// Whether an AdamW op reading clip coefficient `coef` skips its update: a loss-scaled step
/// whose gradients overflowed ([`SKIP_STEP`]).
#[inline]
pub fn skips_step(coef: f32) -> bool {
    coef < 0.0
}

/// GradScaler's `unscale_` and `clip_grad_norm_` as the one factor AdamW multiplies each
/// loss-scaled gradient by, from `total` (the sum of every gradient's [`grad_norm_sq`], in
/// f64) and the step's loss scale: returns the factor and the unscaled global norm.
///
/// The norm is `sqrt(total) / loss_scale`; the factor `clip_coef(norm, max_norm) / loss_scale`
/// (`1 / loss_scale` without clipping), with `1 / loss_scale` rounded to f32 as torch's
/// `scale.double().reciprocal().float()`. For a power-of-two scale both divisions are exact,
/// so `g * factor` is torch's unscaled-then-clipped gradient to the bit. When `total` is not
/// finite (an f16 gradient overflowed to infinity, or is NaN), the factor is [`SKIP_STEP`]
/// and the norm is infinite (or NaN): the step is skipped.
pub fn unscale_coef(total: f64, loss_scale: f64, max_norm: Option<f64>) -> (f32, f32) {
    let inv = (1.0 / loss_scale) as f32;
    if !total.is_finite() {
        return (SKIP_STEP, total.sqrt() as f32);
    }
    let norm = total.sqrt() as f32 * inv;
    let coef = match max_norm {
        Some(max_norm) => clip_coef(norm, max_norm) * inv,
        None => inv,
    };
    (coef, norm)
}

/// `x *= s` in place.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(ELEM_GRAIN)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_steps_by_hand() {
        // lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.1; p = 1, grads 0.5 then -0.25.
        // Step 1: p = 0.99; m = 0.05; v = 2.5e-4; m_hat = 0.5, sqrt(v_hat) = 0.5;
        //         p = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.890000002.
        // Step 2: p = 0.890000002 * 0.99; m = 0.045 - 0.025 = 0.02; v = 2.4975e-4 + 6.25e-5
        //         = 3.1225e-4; m_hat = 0.02 / 0.19; sqrt(v_hat) = sqrt(3.1225e-4 / 0.001999)
        //         = 0.3952254; p = 0.8811000020 - 0.1 * 0.1052632 / 0.3952254 = 0.8544663.
        let cfg = AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adamw_step(&mut p, &[0.5], &mut m, &mut v, 1, &cfg);
        assert!((p[0] as f64 - 0.890_000_002).abs() < 1e-7, "{}", p[0]);
        assert!((m[0] - 0.05).abs() < 1e-8 && (v[0] - 2.5e-4).abs() < 1e-10);
        adamw_step(&mut p, &[-0.25], &mut m, &mut v, 2, &cfg);
        assert!((p[0] as f64 - 0.854_466_3).abs() < 1e-7, "{}", p[0]);
        assert!((m[0] - 0.02).abs() < 1e-8 && (v[0] - 3.1225e-4).abs() < 1e-10);
    }

    /// Printed by `make_fixtures.py` beside this file (torch 2.15, CPU, AVX-512): 37 parameters from `torch.randn` with
    /// seed 0, three steps with gradients `randn * (1, 0.01, 3)`, `AdamW(lr=3e-3,
    /// betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)`; f32 bit patterns.
    mod torch_fixture {
        pub const P0: &[u32] = &[
            0xbf901b85, 0xbf93808a, 0xbe804bd6, 0xbede255d, 0x3f594515, 0x3f312783, 0xbea1cc6d,
            0xc0075fc1, 0x3ea50138, 0xbfa1b4f4, 0x3eb330ff, 0x3e9dc3bb, 0x3df56f77, 0x3f9e6b93,
            0x3f8ef28e, 0xbe7d367c, 0xbfad23c2, 0xbfd91446, 0x3f111004, 0x3f4b235d, 0x3f194d8b,
            0x3de637d6, 0x3f240af8, 0x3ee1df3c, 0xbe5d0b42, 0xbf3e17a3, 0x3f100e82, 0x3e84ede2,
            0xbe3222d5, 0x40135755, 0xbfbc04b7, 0xbfcb189e, 0x3f9a033c, 0x3dad2087, 0xbf999e2b,
            0xbb9cd1ae, 0xbf04a08d,
        ];
        pub const G: [&[u32]; 3] = [
            &[
                0xbec89408, 0x3f0b155d, 0xbeca5217, 0x3e527552, 0xbee6919f, 0xbf12b52e, 0xbf0e2bf8,
                0x3f18258e, 0xbf9df823, 0x3fe8ecc2, 0xbf0d30fc, 0xbfa9a448, 0x3e411430, 0xbd8d75fb,
                0xbefd66db, 0xbfbf7a24, 0x40244d8b, 0xbef23cc2, 0x3eabcd4f, 0x3fc12ae8, 0x40053ec2,
                0x3f959790, 0x3ec9fc44, 0x3ff881d4, 0x3f4a9f9e, 0xbca5e729, 0xbedfd4b0, 0x3fd2abc5,
                0xbfae1a04, 0x3f775fa7, 0x3fcff8e5, 0xbebb3263, 0xbfa6b65e, 0x3dcb940b, 0x3ee2367f,
                0x3e7cda46, 0x3d9d76ef,
            ],
            &[
                0x3b38fc95, 0x3b8e497d, 0xbc037afe, 0xbc54340b, 0xbbf5d1c9, 0xbc56f3d4, 0xbb0f6a33,
                0xbcc77b05, 0xbb8c84de, 0x3b18a534, 0x3c028fdf, 0xbaf2468f, 0xbb729467, 0xbc464ae2,
                0xbbcc0bbc, 0xbb97f3d6, 0xbbc5cf85, 0xbc51834c, 0x3a73a9d8, 0xbbda447e, 0x3bc73eb2,
                0x3c2166e7, 0xbb2a28a0, 0x3a9b1b53, 0x3b1fe192, 0x3c3ecee4, 0x3b3d1f0b, 0x3b7d5c57,
                0xbb03c4ed, 0x3bac34ae, 0x3afbeb4c, 0xbbfd0537, 0xbc9bad21, 0x3aab4813, 0xbbe6c875,
                0x3b4e416a, 0x3ace4c4a,
            ],
            &[
                0xbf73aeaa, 0x4039b125, 0xc03e49b3, 0x3f67a20a, 0xbea4d6bc, 0x403fb424, 0xbfbf81a8,
                0x40122220, 0xc0155337, 0x3f713076, 0x3f23d6f9, 0xbeb865e8, 0x3f8a6aa2, 0xbf712dcb,
                0xc04f1ca8, 0x3f38f146, 0xc0620c34, 0xbe4b31cc, 0xbf899bbd, 0xc095e8f1, 0xbf882eda,
                0x3f03b86e, 0x4028335a, 0xbf5c7bae, 0x404427a7, 0xbfc44098, 0xc0a48493, 0xbfc3dd68,
                0xbfb65be5, 0x3ffe5030, 0xc0679c2d, 0x3fe941c0, 0xbfd21bb4, 0xc0534ac6, 0xc00a43b5,
                0x3d129a21, 0x3f827909,
            ],
        ];
        pub const P3: &[u32] = &[
            0xbf8f09fe, 0xbf9449a4, 0xbe790d5a, 0xbee18b44, 0x3f5afe0d, 0x3f31e68c, 0xbe9de556,
            0xc007b538, 0x3ea8a925, 0xbfa27ffe, 0x3eb55bc9, 0x3ea14028, 0x3de6b2bd, 0x3f9f3934,
            0x3f8fbbbf, 0xbe773b1e, 0xbfad8bd6, 0xbfd7f16b, 0x3f0ffc00, 0x3f4a0218, 0x3f17bdaa,
            0x3dd71049, 0x3f221457, 0x3edec183, 0xbe644199, 0xbf3c82e5, 0x3f11b8b6, 0x3e825081,
            0xbe2a4d2a, 0x4012bbe5, 0xbfbc5a9b, 0xbfca7586, 0x3f9ad6a5, 0x3da655bd, 0xbf99ec2e,
            0xbc4014ac, 0xbf0650bf,
        ];
        pub const M3: &[u32] = &[
            0xbe01b4da, 0x3eab4902, 0xbea8fcf2, 0x3dd90369, 0xbd8e05c7, 0x3e80fde2, 0xbe477873,
            0x3e8c6ead, 0xbeaad6f7, 0x3e77a02c, 0x3ca431c9, 0xbe12fa51, 0x3dfc1020, 0xbdcea1da,
            0xbeba8085, 0xbd4a1c32, 0xbe154bca, 0xbd72f62f, 0xbda45694, 0xbeb19396, 0x3d809971,
            0x3e16881e, 0x3e96cd39, 0x3d91e599, 0x3ebddc81, 0xbe1d9bbc, 0xbf0c9ceb, 0xbc9e9108,
            0xbe8171f6, 0x3e8e0ac0, 0xbe6ba209, 0x3e1b9166, 0xbe8aef0c, 0xbea4d9db, 0xbe3939cb,
            0x3cc37d42, 0x3dddcd1c,
        ];
        pub const V3: &[u32] = &[
            0x3d55ef0d, 0x3ede5458, 0x3ee5eb23, 0x3d2f8221, 0x3c6ae3a1, 0x3eed4804, 0x3e00dc41,
            0x3e8da4c3, 0x3eae8d5f, 0x3e4675e5, 0x3d0c1eff, 0x3daf9c3d, 0x3d761028, 0x3d36aed9,
            0x3f08e0ce, 0x3e02200c, 0x3f6bd0dc, 0x3c45e05d, 0x3d80c187, 0x3f999c69, 0x3e811fb8,
            0x3d99580a, 0x3eb46ada, 0x3e542643, 0x3efef428, 0x3df0c50a, 0x3faa446b, 0x3e750e9d,
            0x3e3d68b2, 0x3e7541fd, 0x3f4621a8, 0x3e30350b, 0x3e585b6d, 0x3f0ba0b4, 0x3e77fc62,
            0x3b388b2d, 0x3d55e1ec,
        ];
    }

    #[test]
    fn matches_torch_to_the_bit() {
        use torch_fixture::*;
        let f = |b: &[u32]| b.iter().map(|&x| f32::from_bits(x)).collect::<Vec<f32>>();
        let cfg = AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut p = f(P0);
        let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        for (i, g) in G.iter().enumerate() {
            adamw_step(&mut p, &f(g), &mut m, &mut v, i as u64 + 1, &cfg);
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&m), M3);
        assert_eq!(bits(&v), V3);
        assert_eq!(bits(&p), P3);
    }

    /// The reciprocal form of `root / bc2_sqrt` gives the quotient's bits for every bias
    /// correction a run meets (steps 1 to 3,000 and far on, for betas from 0 to 1 - 1e-9)
    /// and for the square root of second moments across the whole f32 range (every 4,099th
    /// bit pattern from 0 to infinity, subnormals included, and the ends: 0, the least
    /// subnormal, the largest finite and infinity; NaN stays NaN). The root of a subnormal is
    /// normal, which the reciprocal form needs (a subnormal dividend would not be exact).
    /// Without the FMA correction, `root * y` differs from the quotient in about a fifth of
    /// these cases.
    #[test]
    fn dividing_by_the_bias_correction_through_its_reciprocal_changes_no_bit() {
        let roots: Vec<f32> = (0..=0x7f80_0000u32)
            .step_by(4099)
            .map(f32::from_bits)
            .chain([0.0, f32::from_bits(1), f32::MAX, f32::INFINITY])
            .map(f32::sqrt)
            .collect();
        let steps = (1..=3000u64)
            .step_by(37)
            .chain([1, 2, 3, 10_000, 1 << 20, 1 << 40]);
        let divide = |root, c: &Coeffs| match c.bc2_recip.is_some() {
            true => divide_by_bc2::<true>(root, c),
            false => divide_by_bc2::<false>(root, c),
        };
        let mut with_recip = 0;
        for beta2 in [0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999, 1.0 - 1e-9] {
            for step in steps.clone() {
                let cfg = AdamWConfig {
                    beta2,
                    ..AdamWConfig::default()
                };
                let c = Coeffs::new(step, &cfg, 1.0);
                with_recip += usize::from(c.bc2_recip.is_some());
                for &root in &roots {
                    let want = root / c.bc2_sqrt;
                    let got = divide(root, &c);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{root:e} / {:e} (beta2 {beta2}, step {step})",
                        c.bc2_sqrt
                    );
                }
                assert!(divide(f32::NAN, &c).is_nan());
            }
        }
        assert!(
            with_recip > 600,
            "the reciprocal form ran {with_recip} times"
        );
    }

    /// Values that exercise every path: a length over two blocks with a ragged tail, mixed
    /// signs and magnitudes (subnormal to large), for p, g, m and v.
    fn operands() -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = 2 * ADAMW_BLOCK + 1234;
        let wave = |k: u32, scale: f32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| {
                    let h = i
                        .wrapping_mul(2_654_435_761)
                        .wrapping_add(k.wrapping_mul(40503));
                    let x = (h >> 8) as f32 / 8_388_608.0 - 1.0;
                    x * scale * [1.0, 1e-3, 1e-20, 1e-40, 7.0][(h % 5) as usize]
                })
                .collect()
        };
        let v = wave(4, 1e-2).iter().map(|x| x * x).collect();
        (wave(1, 1.0), wave(2, 0.1), wave(3, 1e-2), v)
    }

    #[test]
    fn the_bits_do_not_depend_on_the_thread_count() {
        let (p0, g, m0, v0) = operands();
        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let cfg = AdamWConfig::default();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut low = vec![bf16::ZERO; p.len()];
            pool.install(|| {
                for step in 1..=3 {
                    let grad = if step == 2 {
                        Grad::Bf16(&g16)
                    } else {
                        Grad::F32(&g)
                    };
                    let (p, m, v, low) = (&mut p, &mut m, &mut v, Some(Low::Bf16(&mut low[..])));
                    adamw_step_fused(p, grad, Some(0.7), m, v, low, step, &cfg);
                }
            });
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            let low: Vec<u16> = low.iter().map(|x| x.to_bits()).collect();
            (bits(&p), bits(&m), bits(&v), low)
        };
        let one = run(1);
        assert!(one == run(2), "two threads differ from one");
        assert!(one == run(3), "three threads differ from one");
    }

    #[test]
    fn a_bf16_gradient_is_its_widened_f32_and_the_bf16_copy_is_the_rounded_master() {
        // The fused pass against the same step on the widened gradient (f32 path, no copy)
        // followed by `half`'s rounding of the result: the same bits.
        let (p0, g, m0, v0) = operands();
        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let widened: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
        let cfg = AdamWConfig::default();
        let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
        adamw_step(&mut p1, &widened, &mut m1, &mut v1, 5, &cfg);
        let (mut p2, mut m2, mut v2) = (p0, m0, v0);
        let mut low = vec![bf16::ZERO; p2.len()];
        let (p, m, v) = (&mut p2, &mut m2, &mut v2);
        adamw_step_fused(
            p,
            Grad::Bf16(&g16),
            None,
            m,
            v,
            Some(Low::Bf16(&mut low)),
            5,
            &cfg,
        );
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&p1), bits(&p2));
        assert_eq!(bits(&m1), bits(&m2));
        assert_eq!(bits(&v1), bits(&v2));
        let want: Vec<u16> = p1.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let got: Vec<u16> = low.iter().map(|x| x.to_bits()).collect();
        assert!(want == got, "the bf16 copy is not the rounded master");
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        // The AVX-512, AVX2 and baseline instances of one block, on every operand pattern
        // (subnormal to large, ragged tail), f32 and bf16 gradients, with and without the bf16
        // copy, both lerp forms: the same bits as the baseline. An instance the CPU lacks is
        // skipped, so on a CPU with AVX-512 (this one) all three are compared.
        let (p0, g, m0, v0) = operands();
        let n = ADAMW_BLOCK + 1234;
        let g16: Vec<bf16> = g[..n].iter().map(|&x| bf16::from_f32(x)).collect();
        let widest = Isa::detect();
        let isas = [Isa::Baseline, Isa::Avx2, Isa::Avx512];
        let has = |isa: Isa| {
            matches!(
                (widest, isa),
                (Isa::Avx512, _) | (_, Isa::Baseline) | (Isa::Avx2, Isa::Avx2)
            )
        };
        for beta1 in [0.9, 0.2] {
            let cfg = AdamWConfig {
                beta1,
                ..AdamWConfig::default()
            };
            let c = Coeffs::new(3, &cfg, 0.7);
            let run = |isa: Isa, bf16_grad: bool, with_low: bool| {
                let (mut p, mut m, mut v) = (p0[..n].to_vec(), m0[..n].to_vec(), v0[..n].to_vec());
                let mut low = vec![bf16::ZERO; n];
                let low_arg = with_low.then_some(&mut low[..]);
                // SAFETY: `has(isa)`: the CPU has it.
                match bf16_grad {
                    true => unsafe { block_in(isa, &mut p, &g16, &mut m, &mut v, low_arg, &c) },
                    false => unsafe { block_in(isa, &mut p, &g[..n], &mut m, &mut v, low_arg, &c) },
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                let low: Vec<u16> = low.iter().map(|x| x.to_bits()).collect();
                (bits(&p), bits(&m), bits(&v), low)
            };
            for bf16_grad in [false, true] {
                for with_low in [false, true] {
                    let want = run(Isa::Baseline, bf16_grad, with_low);
                    for isa in isas.into_iter().filter(|&i| has(i)) {
                        assert!(
                            run(isa, bf16_grad, with_low) == want,
                            "{isa:?} differs from the baseline (beta1 {beta1}, bf16 grad \
                             {bf16_grad}, bf16 copy {with_low})"
                        );
                    }
                }
            }
        }
    }

    /// An intrinsics kernel's entry point ([`avx2::run`], [`avx512::run`]).
    #[cfg(target_arch = "x86_64")]
    type Kernel =
        unsafe fn(&mut [f32], Src<'_>, &mut [f32], &mut [f32], &mut [bf16], Copy16, &Coeffs);

    /// An intrinsics kernel of a step with a bf16 copy, whose copy is written `line` elements
    /// at a time (a streaming store's alignment), for every gradient form (f32, bf16, and bf16
    /// in the copy's storage), both stores of the copy (ordinary, and streaming with its
    /// one-at-a-time head up to the copy's first aligned address), the slices starting at each
    /// element offset of a line with ragged tails, both lerp forms and both divisions by the
    /// bias correction: the bits of the baseline instance given the same gradient apart
    /// (rounding, widening, packing order, the head and the tail). The CPU must have the
    /// kernel's instruction set.
    #[cfg(target_arch = "x86_64")]
    fn check_kernel_bits(kernel: Kernel, line: usize) {
        let (p0, g, m0, v0) = operands();
        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        let bits16 = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        for beta1 in [0.9, 0.2] {
            for recip in [true, false] {
                let cfg = AdamWConfig {
                    beta1,
                    ..AdamWConfig::default()
                };
                let mut c = Coeffs::new(3, &cfg, 0.7);
                if !recip {
                    c.bc2_recip = None;
                }
                for start in 0..line {
                    let r = start..start + 4000 + 3 * start;
                    for form in 0..3 {
                        let run = |simd: Option<Copy16>| {
                            let (mut p, mut m, mut v) = (
                                p0[r.clone()].to_vec(),
                                m0[r.clone()].to_vec(),
                                v0[r.clone()].to_vec(),
                            );
                            let mut low = match form {
                                2 => g16.clone(),
                                _ => vec![bf16::ZERO; g16.len()],
                            };
                            let low = &mut low[r.clone()];
                            let (g32, g16) = (&g[r.clone()], &g16[r.clone()]);
                            let (pm, mm, vm) = (&mut p[..], &mut m[..], &mut v[..]);
                            // SAFETY: the caller's contract: the CPU has the kernel's
                            // instruction set (the baseline needs none).
                            match (simd, form) {
                                (None, 0) => unsafe {
                                    block_in(Isa::Baseline, pm, g32, mm, vm, Some(low), &c)
                                },
                                (None, _) => unsafe {
                                    block_in(Isa::Baseline, pm, g16, mm, vm, Some(low), &c)
                                },
                                (Some(copy), _) => {
                                    let src = match form {
                                        0 => Src::F32(g32),
                                        1 => Src::Bf16(g16),
                                        _ => Src::InLow,
                                    };
                                    unsafe { kernel(pm, src, mm, vm, low, copy, &c) }
                                }
                            }
                            (bits(&p), bits(&m), bits(&v), bits16(low))
                        };
                        let want = run(None);
                        for copy in [Copy16::Store, Copy16::Stream] {
                            assert!(
                                run(Some(copy)) == want,
                                "{copy:?}, form {form}, start {start}, beta1 {beta1}, \
                                 reciprocal {recip}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Whether the CPU has what the AVX-512 kernel runs on (AVX-512F, AVX2, FMA).
    #[cfg(target_arch = "x86_64")]
    fn has_avx512() -> bool {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }

    /// [`check_kernel_bits`] for the AVX2 kernel (skipped where the CPU lacks AVX2 and FMA):
    /// sixteen bf16 to a 32-byte streaming store.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_kernel_gives_the_baseline_bits() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            return;
        }
        check_kernel_bits(avx2::run, 16);
    }

    /// [`check_kernel_bits`] for the AVX-512 kernel (skipped where the CPU lacks AVX-512F):
    /// thirty-two bf16 to a 64-byte streaming store.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_kernel_gives_the_baseline_bits() {
        if !has_avx512() {
            return;
        }
        check_kernel_bits(avx512::run, 32);
    }

    /// Lengths on both sides of one block (run on the calling thread at or below it, split
    /// over the pool above it) and odd tails, for every gradient form (f32, bf16, f16, and the
    /// gradient in the parameter storage) with a bf16 or f16 copy: the bits of the scalar
    /// update applied element by element, on one thread and on three.
    #[test]
    fn every_length_and_gradient_form_gives_the_scalar_bits() {
        let cfg = AdamWConfig::default();
        let c = Coeffs::new(4, &cfg, 0.7);
        let (p0, g, m0, v0) = operands();
        for n in [
            1,
            7,
            17,
            ADAMW_BLOCK - 1,
            ADAMW_BLOCK,
            ADAMW_BLOCK + 1,
            ADAMW_BLOCK + 37,
        ] {
            for form in 0..4 {
                let f16_low = form == 2;
                let grad: Vec<f32> = match f16_low {
                    true => g[..n].iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
                    false if form == 0 => g[..n].to_vec(),
                    false => g[..n].iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
                };
                // The reference: `update` on each element, with the gradient widened exactly
                // and the plain division by the bias correction.
                let (mut p, mut m, mut v) = (p0[..n].to_vec(), m0[..n].to_vec(), v0[..n].to_vec());
                for i in 0..n {
                    (p[i], m[i], v[i]) = update::<true, false>(p[i], grad[i] * 0.7, m[i], v[i], &c);
                }
                let want: Vec<u32> = p.iter().chain(&m).chain(&v).map(|x| x.to_bits()).collect();
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let (mut p, mut m, mut v) =
                        (p0[..n].to_vec(), m0[..n].to_vec(), v0[..n].to_vec());
                    let g16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
                    let gh: Vec<f16> = grad.iter().map(|&x| f16::from_f32(x)).collect();
                    let (mut low16, mut lowh) = (g16.clone(), gh.clone());
                    pool.install(|| {
                        let (grad, low) = match form {
                            0 => (Grad::F32(&grad), Low::Bf16(&mut low16)),
                            1 => (Grad::Bf16(&g16), Low::Bf16(&mut low16)),
                            2 => (Grad::F16(&gh), Low::F16(&mut lowh)),
                            _ => (Grad::InLow, Low::Bf16(&mut low16)),
                        };
                        let (pm, mm, vm) = (&mut p, &mut m, &mut v);
                        adamw_step_fused(pm, grad, Some(0.7), mm, vm, Some(low), 4, &cfg);
                    });
                    let low: Vec<u16> = match f16_low {
                        true => lowh.iter().map(|x| x.to_bits()).collect(),
                        false => low16.iter().map(|x| x.to_bits()).collect(),
                    };
                    let state: Vec<u32> =
                        p.iter().chain(&m).chain(&v).map(|x| x.to_bits()).collect();
                    (state, low, p)
                };
                for threads in [1, 3] {
                    let (state, low, p) = run(threads);
                    assert!(state == want, "n {n}, form {form}, {threads} threads");
                    let rounded: Vec<u16> = match f16_low {
                        true => p.iter().map(|&x| f16::from_f32(x).to_bits()).collect(),
                        false => p.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
                    };
                    assert!(
                        low == rounded,
                        "copy: n {n}, form {form}, {threads} threads"
                    );
                }
            }
        }
    }

    /// Bit patterns a rounding to bf16 must get right, `lanes` to a group: ties both ways, the
    /// carry into the exponent, infinities, NaNs of both signs (quiet and signalling),
    /// subnormals (which `vcvtne2ps2bf16` would flush to zero), each in every lane, and a sweep
    /// of bit patterns.
    #[cfg(target_arch = "x86_64")]
    fn rounding_groups(lanes: usize) -> Vec<u32> {
        let special = [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x3f7f_ffff,
            0x7f7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0xffff_ffff,
            0x7fff_ffff,
            0x0000_8000,
            0x0001_8000,
            0x8000_0000,
            0x0000_0001,
            0x807f_ffff,
            0,
        ];
        let sweep = (0..1u32 << 18).map(|i| i.wrapping_mul(4099).rotate_left(13));
        let mut all: Vec<u32> = (0..lanes)
            .flat_map(|shift| {
                special
                    .iter()
                    .cycle()
                    .skip(shift)
                    .take(special.len())
                    .copied()
            })
            .collect();
        all.extend(sweep);
        all
    }

    /// The AVX2 kernel's rounding of sixteen lanes to bf16 (skipped without AVX2 and FMA):
    /// `half`'s bits, in order, for every group of [`rounding_groups`].
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_rounding_to_bf16_is_halfs() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            return;
        }
        for group in rounding_groups(16).chunks_exact(16) {
            let x: [f32; 16] = std::array::from_fn(|i| f32::from_bits(group[i]));
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            let got = unsafe { avx2::narrow16_of(&x) };
            let want: [u16; 16] = std::array::from_fn(|i| bf16::from_f32(x[i]).to_bits());
            assert_eq!(got, want, "{group:08x?}");
        }
    }

    /// The AVX-512 kernel's rounding of thirty-two lanes to bf16 (skipped without AVX-512F):
    /// `half`'s bits, in order, for every group of [`rounding_groups`].
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_rounding_to_bf16_is_halfs() {
        if !has_avx512() {
            return;
        }
        for group in rounding_groups(32).chunks_exact(32) {
            let x: [f32; 32] = std::array::from_fn(|i| f32::from_bits(group[i]));
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked above).
            let got = unsafe { avx512::narrow32_of(&x) };
            let want: [u16; 32] = std::array::from_fn(|i| bf16::from_f32(x[i]).to_bits());
            assert_eq!(got, want, "{group:08x?}");
        }
    }

    #[test]
    fn to_bf16_rounds_as_half_does() {
        // Ties to even both ways, the carry into the exponent, infinities, NaNs (quiet and
        // signalling, both signs), subnormals, and a sweep of bit patterns.
        let special = [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3f7f_ffff,
            0x7f7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0xffff_ffff,
            0x0000_8000,
            0x0001_8000,
            0x8000_0000,
            0,
        ];
        let sweep = (0..1u32 << 20).map(|i| i.wrapping_mul(4099).rotate_left(13));
        for b in special.into_iter().chain(sweep) {
            let x = f32::from_bits(b);
            assert_eq!(
                to_bf16(x).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{b:#010x}"
            );
        }
    }

    #[test]
    fn grad_norm_is_deterministic_and_exact_enough() {
        let x: Vec<f32> = (0..100_003)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let a = one.install(|| grad_norm_sq(&x));
        let b = three.install(|| grad_norm_sq(&x));
        assert_eq!(a.to_bits(), b.to_bits());
        assert!((a - want).abs() < 1e-9 * want);
    }

    #[test]
    fn clipping_follows_torch() {
        // Norm 10, max 1: coefficient 1 / (10 + 1e-6), then the gradients are scaled by it.
        let c = clip_coef(10.0, 1.0);
        assert!((c as f64 - 1.0 / (10.0 + 1e-6)).abs() < 1e-8);
        let mut g = vec![3.0f32, -4.0];
        scale(&mut g, c);
        assert!((g[0] - 0.3).abs() < 1e-6 && (g[1] + 0.4).abs() < 1e-6);
        // Below the limit the coefficient is clamped to exactly 1.
        assert_eq!(clip_coef(0.5, 1.0), 1.0);
        assert_eq!(clip_coef(0.0, 1.0), 1.0);
    }

    /// The 14-byte host layout's step, gradient read from the parameter storage, gives the
    /// bits of the step given the same gradient apart, in bf16 and f16, over lengths that cut
    /// a block and a stack piece unevenly, with and without a clip scale. (Writing the
    /// parameter before reading its gradient element, or skipping a piece, fails this.)
    #[test]
    fn gradient_in_the_parameter_storage_gives_the_same_bits() {
        let n = ADAMW_BLOCK + IN_LOW_PIECE + 37;
        let master0: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5)
            .collect();
        let grad: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 977) as f32 * 1e-4 - 0.05)
            .collect();
        let cfg = AdamWConfig::default();
        for scale in [None, Some(0.25f32)] {
            let run = |in_low: bool, f16: bool| -> (Vec<u32>, Vec<u16>) {
                let mut master = master0.clone();
                let (mut m, mut v) = (vec![0.01f32; n], vec![0.02f32; n]);
                let bits = if f16 {
                    let g: Vec<f16> = grad.iter().map(|&x| f16::from_f32(x)).collect();
                    let mut low = match in_low {
                        true => g.clone(),
                        false => vec![f16::ZERO; n],
                    };
                    let given = match in_low {
                        true => Grad::InLow,
                        false => Grad::F16(&g),
                    };
                    let low_ref = Some(Low::F16(&mut low));
                    adamw_step_fused(&mut master, given, scale, &mut m, &mut v, low_ref, 3, &cfg);
                    low.iter().map(|x| x.to_bits()).collect()
                } else {
                    let g: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
                    let mut low = match in_low {
                        true => g.clone(),
                        false => vec![bf16::ZERO; n],
                    };
                    let given = match in_low {
                        true => Grad::InLow,
                        false => Grad::Bf16(&g),
                    };
                    let low_ref = Some(Low::Bf16(&mut low));
                    adamw_step_fused(&mut master, given, scale, &mut m, &mut v, low_ref, 3, &cfg);
                    low.iter().map(|x| x.to_bits()).collect()
                };
                let state = master.iter().chain(&m).chain(&v).map(|x| x.to_bits());
                (state.collect(), bits)
            };
            for f16 in [false, true] {
                assert!(
                    run(false, f16) == run(true, f16),
                    "f16 {f16}, scale {scale:?}"
                );
            }
        }
    }

    #[test]
    fn a_run_of_steps_in_one_pass_gives_each_tensors_bits_alone_and_ends_each_once() {
        let (p0, g0, m0, v0) = operands();
        let cfg = AdamWConfig::default();
        // Tensors of every form and size: an empty one, one element, one block, several
        // blocks with a ragged end; f32, bf16 and f16 gradients, a gradient in the parameter
        // storage, scaled or not, each at its own step.
        let lens = [
            0,
            1,
            ADAMW_BLOCK,
            2 * ADAMW_BLOCK + 1234,
            777,
            ADAMW_BLOCK + 1,
        ];
        type State = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<bf16>, Vec<f16>);
        let states: Vec<State> = lens
            .iter()
            .map(|&n| {
                let low = p0[..n].iter().map(|&x| bf16::from_f32(x)).collect();
                let half = g0[..n].iter().map(|&x| f16::from_f32(x)).collect();
                (
                    p0[..n].to_vec(),
                    m0[..n].to_vec(),
                    v0[..n].to_vec(),
                    low,
                    half,
                )
            })
            .collect();
        let g16: Vec<bf16> = g0.iter().map(|&x| bf16::from_f32(x)).collect();
        fn steps<'a>(
            states: &'a mut [State],
            g0: &'a [f32],
            g16: &'a [bf16],
            cfg: AdamWConfig,
        ) -> Vec<AdamWStep<'a>> {
            states
                .iter_mut()
                .enumerate()
                .map(|(i, (p, m, v, low, half))| {
                    let n = p.len();
                    let (grad, low) = match i % 4 {
                        0 => (Grad::F32(&g0[..n]), None),
                        1 => (Grad::Bf16(&g16[..n]), Some(Low::Bf16(&mut low[..]))),
                        2 => (Grad::InLow, Some(Low::Bf16(&mut low[..]))),
                        _ => (Grad::InLow, Some(Low::F16(&mut half[..]))),
                    };
                    AdamWStep {
                        master: p,
                        grad,
                        grad_scale: (i % 2 == 1).then_some(0.5),
                        exp_avg: m,
                        exp_avg_sq: v,
                        low,
                        step: 1 + i as u64,
                        config: cfg,
                    }
                })
                .collect()
        }
        let mut alone = states.clone();
        for step in steps(&mut alone, &g0, &g16, cfg) {
            let AdamWStep {
                master,
                grad,
                grad_scale,
                exp_avg,
                exp_avg_sq,
                low,
                step,
                config,
            } = step;
            adamw_step_fused(
                master, grad, grad_scale, exp_avg, exp_avg_sq, low, step, &config,
            );
        }
        let bits = |s: &[State]| -> Vec<Vec<u32>> {
            s.iter()
                .map(|(p, m, v, low, half)| {
                    let wide = p.iter().chain(m).chain(v).map(|x| x.to_bits());
                    let narrow = low.iter().map(|x| u32::from(x.to_bits()));
                    wide.chain(narrow)
                        .chain(half.iter().map(|x| u32::from(x.to_bits())))
                        .collect()
                })
                .collect()
        };
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut together = states.clone();
            let ended: Vec<AtomicUsize> = lens.iter().map(|_| AtomicUsize::new(0)).collect();
            pool.install(|| {
                adamw_steps_fused(steps(&mut together, &g0, &g16, cfg), &|i| {
                    ended[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(bits(&together) == bits(&alone), "{threads} threads");
            let ends: Vec<usize> = ended.iter().map(|e| e.load(Ordering::Relaxed)).collect();
            assert_eq!(ends, vec![1; lens.len()], "{threads} threads");
            // Shared out between this thread and the pool's: the same bits, each ended once.
            let mut beside = states.clone();
            let ended: Vec<AtomicUsize> = lens.iter().map(|_| AtomicUsize::new(0)).collect();
            let count = |i: usize| {
                ended[i].fetch_add(1, Ordering::Relaxed);
            };
            adamw_steps_beside(steps(&mut beside, &g0, &g16, cfg), &count, &pool);
            assert!(bits(&beside) == bits(&alone), "{threads} threads beside");
            let ends: Vec<usize> = ended.iter().map(|e| e.load(Ordering::Relaxed)).collect();
            assert_eq!(ends, vec![1; lens.len()], "{threads} threads beside");
        }
    }
}
