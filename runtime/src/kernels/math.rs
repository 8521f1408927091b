//! Scalar building blocks shared by the kernels: a vectorisable `exp`, dot products, gemm.
//!
//! Everything here is a pure function of its inputs with a fixed order of operations, so the
//! kernels built on it are deterministic whatever the thread count.

/// Rows per rayon task for row-parallel kernels whose rows are short: enough work per task to
/// amortise scheduling, small enough to balance over a few threads.
pub(crate) const ROW_GRAIN: usize = 16;

/// The fewest columns per rayon task for kernels that reduce over rows (bias and norm weight
/// gradients): sixteen `f32` are one 64-byte cache line, so tasks never write to the same line.
pub(crate) const COL_GRAIN: usize = 16;

/// The most columns per rayon task of [`reduce_rows`]. A task reads its block of every row, one
/// row a few KiB after the last, so each row costs a cache miss the prefetcher does not
/// foresee; 64 to 128 columns (four to eight lines) per miss instead of 16 (one line) took a
/// 2048-row bias gradient from 2.4-3.6 GB/s to 7-9 GB/s on one core (AVX-512, rows of 256
/// to 3072 columns evicted from cache first, as in a training step).
const COL_BLOCK_MAX: usize = 128;

/// Elements per rayon task for elementwise kernels.
pub(crate) const ELEM_GRAIN: usize = 1 << 14;

/// `e^x` in f32, accurate to about 2 ulp over the whole range (subnormal results included).
///
/// `f32::exp` is a libm call that the compiler cannot vectorise; softmax over a vocabulary and
/// attention spend most of their time here, so this is the Cephes `expf` scheme written without
/// branches: round `x / ln 2` to `n` with the 1.5 * 2^23 trick, reduce `r = x - n ln 2` in two
/// parts, a degree-6 polynomial for `e^r` on [-ln2/2, ln2/2], and `2^n` applied as two exact
/// power-of-two factors (so neither overflows nor underflows before the final rounding).
/// Below -103.97 the result is 0, above ln(f32::MAX) it is +inf, NaN gives NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0.693359375 exactly
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // e^LO is half the smallest subnormal; e^HI is f32::MAX.
    const LO: f32 = -103.972_08;
    const HI: f32 = 88.722_83;
    let xc = x.clamp(LO, HI);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes' 5.0000001e-1 rounds to 0.5 in f32
    let y = (p * (r * r) + r) + 1.0;
    // n is in -150..=128; each half is in -75..=64, a normal power of two. The integer is read
    // from the low mantissa bits of 1.5 * 2^23 + n (bits 0x4B40_0000 + n), not by `as i32`,
    // whose saturating conversion does not vectorise.
    let n = shifted.to_bits() as i32 - 0x4B40_0000;
    let (n1, n2) = (n >> 1, n - (n >> 1));
    let pow2 = |k: i32| f32::from_bits(((k + 127) << 23) as u32);
    let e = (y * pow2(n1)) * pow2(n2);
    let e = if x < LO { 0.0 } else { e };
    if x > HI {
        f32::INFINITY
    } else {
        e
    }
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `sum_i a[i] * b[i]` with eight interleaved f32 accumulators (vectorises; fixed order).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a * x`.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `sum_i x[i]` with eight interleaved f32 accumulators.
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let c = x.chunks_exact(8);
    let tail: f32 = c.remainder().iter().sum();
    for v in c {
        for i in 0..8 {
            acc[i] += v[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// The largest element (NaN if any element is NaN, so a NaN logit is not silently dropped).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let c = x.chunks_exact(8);
    let mut m = f32::NEG_INFINITY;
    for &v in c.remainder() {
        m = if v > m || v.is_nan() { v } else { m };
    }
    for v in c {
        for i in 0..8 {
            acc[i] = if v[i] > acc[i] || v[i].is_nan() {
                v[i]
            } else {
                acc[i]
            };
        }
    }
    acc.iter()
        .fold(m, |m, &v| if v > m || v.is_nan() { v } else { m })
}

/// Column-parallel reduction over rows: `dst` (one value per column) is split into blocks of
/// [`reduce_block`] columns; for each block, `dst` is zeroed unless `accumulate`, then
/// `add_row(r, first_column, block)` is called for `r` in `0..rows` in order. Each column's sum
/// therefore runs in row order whatever the block width and thread count: this is how bias
/// and norm weight gradients are reduced deterministically without scratch memory. Each block
/// runs under [`fast`], so `add_row` must be `#[inline(always)]` to be vectorised.
pub(crate) fn reduce_rows(
    dst: &mut [f32],
    rows: usize,
    accumulate: bool,
    add_row: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let width = reduce_block(dst.len(), rayon::current_num_threads());
    dst.par_chunks_mut(width)
        .enumerate()
        .for_each(|(i, block)| {
            fast(
                #[inline(always)]
                || {
                    if !accumulate {
                        block.fill(0.0);
                    }
                    for r in 0..rows {
                        add_row(r, i * width, block);
                    }
                },
            )
        });
}

/// Columns per task of [`reduce_rows`] over `columns` columns on `threads` threads: wide
/// blocks read rows in longer runs ([`COL_BLOCK_MAX`]), but at least two blocks per thread,
/// so a thread the OS preempts leaves work for the others to steal; a whole number of cache
/// lines ([`COL_GRAIN`]). The width changes no bits: every column is summed alone, in row
/// order.
fn reduce_block(columns: usize, threads: usize) -> usize {
    columns
        .div_ceil(2 * threads.max(1))
        .next_multiple_of(COL_GRAIN)
        .clamp(COL_GRAIN, COL_BLOCK_MAX)
}

/// The instruction sets [`fast_in`] compiles a closure for, widest first: the one mechanism
/// of run-time CPU feature dispatch in the kernels ([`fast`] picks the widest the CPU has;
/// tests run each instance the CPU has to compare their bits).
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Isa {
    /// AVX-512F with AVX2 and FMA (sixteen lanes).
    Avx512,
    /// AVX2 + FMA (eight lanes).
    Avx2,
    /// As built (SSE2 on x86-64; `mul_add` is then a libm call).
    Baseline,
}

/// The environment variable that caps the instruction set the kernels use
/// ([`Isa::detect`]): `avx2` or `baseline` (`avx512` leaves the widest). It can only narrow
/// what the CPU has, so an AVX-512 machine can measure the kernels an AVX2-only machine runs
/// (as `ATEN_CPU_CAPABILITY=avx2` does for torch); every instance gives the same bits.
pub const ISA_CAP_VAR: &str = "PROTRAIN_CPU_ISA";

impl Isa {
    /// The widest instruction set this CPU has, capped by [`ISA_CAP_VAR`] when it is set
    /// (both read once; `is_x86_feature_detected!` caches its answer too).
    #[inline(always)]
    pub(crate) fn detect() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let cap = std::env::var(ISA_CAP_VAR).ok();
            Isa::widest().narrowed_to(cap.as_deref().and_then(Isa::parse))
        })
    }

    /// The widest instruction set this CPU has.
    fn widest() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                if std::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }

    /// The instruction set [`ISA_CAP_VAR`] names (`avx512`, `avx2`, `baseline`, any case);
    /// `None` for anything else, which caps nothing.
    fn parse(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "avx512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "baseline" => Some(Isa::Baseline),
            _ => None,
        }
    }

    /// `self`, or `cap` where `cap` is narrower: a cap never widens what the CPU has.
    fn narrowed_to(self, cap: Option<Isa>) -> Isa {
        let width = |isa: Isa| match isa {
            Isa::Avx512 => 2,
            Isa::Avx2 => 1,
            Isa::Baseline => 0,
        };
        match cap {
            Some(cap) if width(cap) < width(self) => cap,
            _ => self,
        }
    }
}

/// Runs `f` compiled for AVX-512F when the CPU has it, else for AVX2 (and FMA) when it has
/// them, else as built (SSE2 on x86-64): [`fast_in`] with [`Isa::detect`]. `f` is inlined into
/// the chosen instance, so the loops in it (and the `#[inline(always)]` helpers above) are
/// vectorised sixteen or eight wide instead of four. Results are the same bits on every path:
/// Rust never contracts `a * b + c` into an FMA, LLVM never reorders a floating-point sum, and
/// every lane computes what the scalar code does.
///
/// The closure must be marked `#[inline(always)]` (`fast(#[inline(always)] || ...)`), and so
/// must any closure or function it calls in its loops: one LLVM declines to inline (a long
/// one, such as a softmax row or an attention tile loop) is compiled apart for the baseline
/// and runs four SSE lanes wide (seen in the disassembly: no `ymm` register in it).
#[inline(always)]
pub(crate) fn fast<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the instruction set was detected on this CPU.
    unsafe { fast_in(Isa::detect(), f) }
}

/// Runs `f` compiled for `isa` (inlined into that instance, as [`fast`] says).
///
/// # Safety
/// The CPU must have `isa` ([`Isa::detect`] or a narrower one).
#[inline(always)]
pub(crate) unsafe fn fast_in<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        Isa::Avx512 => unsafe { avx512(f) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        Isa::Avx2 => unsafe { avx2(f) },
        _ => f(),
    }
}

/// The AVX2 instance of [`fast`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// The AVX-512 instance of [`fast`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// The gemm crate's parallelism for the current rayon pool.
pub(crate) fn parallelism() -> gemm::Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// A row-major or strided matrix operand: element (i, j) is at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// `dst[m, n] = lhs[m, k] * rhs[k, n]`, or `dst += lhs * rhs` when `accumulate`; `dst` is
/// row-major with `n` columns. Multi-threaded over the current rayon pool.
pub(crate) fn matmul(
    dst: &mut [f32],
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert_eq!(dst.len(), m * n, "matmul: dst is not [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: `dst` is an exclusive borrow of exactly m * n row-major elements, which the
    // shared operands cannot alias.
    unsafe {
        gemm_raw(
            dst.as_mut_ptr(),
            n,
            lhs,
            rhs,
            (m, n, k),
            accumulate,
            1.0,
            parallelism(),
        )
    }
}

/// [`matmul`] into a `dst` of `m` rows `pitch` elements apart, of which each row's first `n`
/// are written (`dst` is `[m, pitch]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_pitched(
    dst: &mut [f32],
    pitch: usize,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert!(pitch >= n, "matmul: pitch is shorter than n");
    assert_eq!(dst.len(), m * pitch, "matmul: dst is not [m, pitch]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(pitch).for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    // SAFETY: `dst` is an exclusive borrow of m rows of `pitch >= n` elements, which the
    // shared operands cannot alias.
    unsafe {
        gemm_raw(
            dst.as_mut_ptr(),
            pitch,
            lhs,
            rhs,
            (m, n, k),
            accumulate,
            1.0,
            parallelism(),
        )
    }
}

/// `dst = beta * lhs * rhs`, or `dst += beta * lhs * rhs` when `accumulate`, for a `dst` of
/// `m` rows of `n` contiguous elements, `dst_rs` apart. Operand bounds are checked here.
///
/// # Safety
/// `dst` must be valid for reads and writes of that strided region, and nothing else may
/// access the region during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw(
    dst: *mut f32,
    dst_rs: usize,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(m > 0 && n > 0 && k > 0, "gemm_raw: empty product");
    let last = |mat: &Mat<'_>, rows: usize, cols: usize| (rows - 1) * mat.rs + (cols - 1) * mat.cs;
    assert!(
        last(&lhs, m, k) < lhs.data.len(),
        "matmul: lhs out of bounds"
    );
    assert!(
        last(&rhs, k, n) < rhs.data.len(),
        "matmul: rhs out of bounds"
    );
    // SAFETY: every operand element read is in bounds (checked above); `dst` is the caller's.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::bits;

    #[test]
    fn the_instruction_set_cap_only_narrows() {
        // Each name, in any case, caps to itself or below; an unknown name caps nothing.
        assert_eq!(Isa::parse(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::parse("avx512"), Some(Isa::Avx512));
        assert_eq!(Isa::parse("Baseline"), Some(Isa::Baseline));
        assert_eq!(Isa::parse("sse4"), None);
        let all = [Isa::Avx512, Isa::Avx2, Isa::Baseline];
        for (i, &cpu) in all.iter().enumerate() {
            assert_eq!(cpu.narrowed_to(None), cpu);
            for (j, &cap) in all.iter().enumerate() {
                let want = if j > i { cap } else { cpu };
                assert_eq!(
                    cpu.narrowed_to(Some(cap)),
                    want,
                    "{cpu:?} capped to {cap:?}"
                );
            }
        }
    }

    #[test]
    fn exp_is_within_three_ulp_of_f64_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -103.9f32;
        while x < 88.72 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            // One ulp of the f32 result; subnormals have a fixed spacing of 2^-149.
            let ulp = ((want as f32).abs() * f32::EPSILON).max(f32::from_bits(1)) as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.0037;
        }
        assert!(worst < 3.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Every helper the kernels use, over `x` and `y`, as bits.
    #[inline(always)]
    fn helper_bits(x: &[f32], y: &[f32]) -> (Vec<u32>, Vec<u32>, u32, u32, u32) {
        let e: Vec<u32> = x.iter().map(|&v| exp(v).to_bits()).collect();
        let s: Vec<u32> = x.iter().map(|&v| sigmoid(v / 9.0).to_bits()).collect();
        (
            e,
            s,
            dot(x, y).to_bits(),
            sum(x).to_bits(),
            max(x).to_bits(),
        )
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        // `fast` must not change results, only speed: compare each instance the CPU has (and
        // whichever `fast` picks) with calling the helpers as built.
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.731).sin() * 90.0).collect();
        let y: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.117).cos()).collect();
        let baseline = helper_bits(&x, &y);
        let picked = fast(
            #[inline(always)]
            || helper_bits(&x, &y),
        );
        assert!(picked == baseline, "fast differs from the baseline");
        let widest = Isa::detect();
        for isa in [Isa::Avx2, Isa::Avx512] {
            let has = matches!((widest, isa), (Isa::Avx512, _) | (Isa::Avx2, Isa::Avx2));
            if !has {
                continue;
            }
            // SAFETY: the CPU has `isa` (it has the widest detected, which includes it).
            let got = unsafe {
                fast_in(
                    isa,
                    #[inline(always)]
                    || helper_bits(&x, &y),
                )
            };
            assert!(got == baseline, "{isa:?} differs from the baseline");
        }
    }

    #[test]
    fn reductions_match_naive_sums() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let y: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let naive_dot: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        let naive_sum: f64 = x.iter().map(|&a| a as f64).sum();
        assert!((dot(&x, &y) as f64 - naive_dot).abs() < 1e-5);
        assert!((sum(&x) as f64 - naive_sum).abs() < 1e-5);
        let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&x), m);
        let mut with_nan = x.clone();
        with_nan[3] = f32::NAN;
        assert!(max(&with_nan).is_nan());
    }

    #[test]
    fn reduce_rows_sums_each_column_in_row_order_at_every_block_width() {
        // Column sums in row order, one f32 add at a time: the bits every block width and
        // thread count must give (reordering the rows, or a partial sum per block of rows,
        // changes them for these values).
        let (rows, cols) = (300, 200);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * 0.618).sin() * 10f32.powi((i % 7) as i32))
            .collect();
        let mut want = vec![0.0f32; cols];
        for r in 0..rows {
            for (c, w) in want.iter_mut().enumerate() {
                *w += x[r * cols + c];
            }
        }
        for threads in [1, 2, 3, 16] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut got = vec![f32::NAN; cols];
            pool.install(|| {
                reduce_rows(
                    &mut got,
                    rows,
                    false,
                    #[inline(always)]
                    |r, c0, block| {
                        for (b, &v) in block.iter_mut().zip(&x[r * cols + c0..]) {
                            *b += v;
                        }
                    },
                )
            });
            assert_eq!(bits(&got), bits(&want), "{threads} threads");
        }
        assert_eq!(reduce_block(256, 2), 64);
        assert_eq!(reduce_block(768, 2), COL_BLOCK_MAX);
        assert_eq!(reduce_block(256, 16), COL_GRAIN);
        assert_eq!(reduce_block(200, 3), 48);
        assert_eq!(reduce_block(5, 2), COL_GRAIN);
    }

    #[test]
    fn matmul_overwrites_or_accumulates_with_strides() {
        // lhs [2,3] row-major, rhs given transposed: rhs^T is [2,3] row-major.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let bt = [1.0, 0.0, -1.0, 2.0, 1.0, 0.5];
        let want = [1.0 - 3.0, 2.0 + 2.0 + 1.5, 4.0 - 6.0, 8.0 + 5.0 + 3.0];
        let mut dst = [f32::NAN; 4];
        let lhs = Mat {
            data: &a,
            rs: 3,
            cs: 1,
        };
        let rhs = Mat {
            data: &bt,
            rs: 1,
            cs: 3,
        };
        matmul(&mut dst, lhs, rhs, 2, 2, 3, false);
        assert_eq!(dst, want);
        matmul(&mut dst, lhs, rhs, 2, 2, 3, true);
        assert_eq!(dst, want.map(|w| 2.0 * w));
    }
}
