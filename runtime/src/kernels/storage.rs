//! Storage types of mixed precision: bf16 and f16 widened to f32 (exact), f32 rounded to
//! bf16 or f16 (to nearest, ties to even; f16 overflows to infinity past 65504, as CUDA's
//! `__float2half_rn` does), and the rounding an op applies where its values pass through
//! narrow storage between two of its kernels.
//!
//! The kernels compute in f32 whatever the storage type. A bf16 op on the host reads its
//! inputs widened, computes in f32 and rounds what it writes, exactly where the CUDA backend's
//! kernels store bf16 (`runtime/src/cuda/kernels/common.cuh`: `ld` widens, `st` rounds with
//! the same bits as [`to_bf16`]). Where a CUDA op stores an intermediate in bf16 (a fused
//! linear's projection before a separate activation pass, attention's probabilities), the host
//! kernel applies [`Rounding`] at that point, so both backends round the same values at the
//! same places.

use rayon::prelude::*;

pub use super::adamw::{bf16, to_bf16};
use super::math::ELEM_GRAIN;
pub use half::f16;

/// `x` widened to f32: exact (the bf16 bits are the high half of the f32's).
#[inline(always)]
pub fn to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// `x` rounded to bf16 and widened back: the value a bf16 store followed by a load gives.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    to_f32(to_bf16(x))
}

/// `dst = src` widened, element by element; both the same length.
pub fn widen(dst: &mut [f32], src: &[bf16]) {
    assert_eq!(dst.len(), src.len(), "widen: lengths differ");
    dst.par_chunks_mut(ELEM_GRAIN)
        .zip(src.par_chunks(ELEM_GRAIN))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = to_f32(s);
            }
        });
}

/// `dst = src` rounded to bf16, element by element; both the same length.
pub fn narrow(dst: &mut [bf16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "narrow: lengths differ");
    dst.par_chunks_mut(ELEM_GRAIN)
        .zip(src.par_chunks(ELEM_GRAIN))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = to_bf16(s);
            }
        });
}

/// `x` rounded to f16 and widened back: the value an f16 store followed by a load gives.
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// `dst = src` widened, element by element; both the same length.
pub fn widen_f16(dst: &mut [f32], src: &[f16]) {
    assert_eq!(dst.len(), src.len(), "widen: lengths differ");
    dst.par_chunks_mut(ELEM_GRAIN)
        .zip(src.par_chunks(ELEM_GRAIN))
        .for_each(|(d, s)| half::slice::HalfFloatSliceExt::convert_to_f32_slice(s, d));
}

/// `dst = src` rounded to f16, element by element; both the same length.
pub fn narrow_f16(dst: &mut [f16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "narrow: lengths differ");
    dst.par_chunks_mut(ELEM_GRAIN)
        .zip(src.par_chunks(ELEM_GRAIN))
        .for_each(|(d, s)| half::slice::HalfFloatSliceExt::convert_from_f32_slice(d, s));
}

/// How an op rounds the values it stores between two of its kernels: the storage type of its
/// activations. [`Rounding::Exact`] leaves every value as computed, so a kernel taking a
/// rounding computes, for f32 storage, the same bits as without one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rounding {
    /// f32 storage: values stay as computed.
    #[default]
    Exact,
    /// bf16 storage: each stored value is rounded to bf16 and read back widened.
    Bf16,
    /// f16 storage: each stored value is rounded to f16 and read back widened.
    F16,
}

impl Rounding {
    /// The rounding of storage type `dtype`: bf16's, f16's, or none.
    pub fn of(dtype: protrain_ir::DType) -> Self {
        match dtype {
            protrain_ir::DType::BF16 => Rounding::Bf16,
            protrain_ir::DType::F16 => Rounding::F16,
            _ => Rounding::Exact,
        }
    }

    /// The rounding of storage type bf16 when `bf16` holds, else none.
    pub fn bf16_if(bf16: bool) -> Self {
        match bf16 {
            true => Rounding::Bf16,
            false => Rounding::Exact,
        }
    }

    /// Whether values are rounded at all.
    pub fn rounds(self) -> bool {
        self != Rounding::Exact
    }

    /// `x` as stored and read back.
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Rounding::Exact => x,
            Rounding::Bf16 => round_bf16(x),
            Rounding::F16 => round_f16(x),
        }
    }

    /// Every value of `x` as stored and read back, in place.
    pub fn apply(self, x: &mut [f32]) {
        match self {
            Rounding::Exact => {}
            Rounding::Bf16 => x.par_chunks_mut(ELEM_GRAIN).for_each(|c| {
                for v in c {
                    *v = round_bf16(*v);
                }
            }),
            Rounding::F16 => x.par_chunks_mut(ELEM_GRAIN).for_each(|c| {
                for v in c {
                    *v = round_f16(*v);
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ties, halfway cases, the largest finite values, infinities, NaNs and subnormals round
    /// as `half` (and CUDA's `__float2bfloat16_rn`) do.
    #[test]
    fn narrowing_rounds_to_nearest_even_as_half_does() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000), // halfway between two bf16, even below: rounds down
            f32::from_bits(0x3f81_8000), // halfway, odd below: rounds up
            f32::from_bits(0x3f80_8001), // just above halfway: up
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN becomes a quiet one
            f32::from_bits(1),           // the smallest subnormal
            1e-40,
            -2.718_75e3,
        ];
        let mut src: Vec<f32> = specials.to_vec();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        src.extend((0..5000).map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            f32::from_bits(seed as u32)
        }));
        let mut low = vec![bf16::ZERO; src.len()];
        narrow(&mut low, &src);
        for (x, got) in src.iter().zip(&low) {
            let want = half::bf16::from_f32(*x);
            if x.is_nan() {
                assert!(got.is_nan(), "{x:?}");
                assert_eq!(
                    got.to_bits() & 0x8000,
                    want.to_bits() & 0x8000,
                    "sign of {x:?}"
                );
                assert_ne!(got.to_bits() & 0x0040, 0, "{x:?} stays a quiet NaN");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e}");
            }
        }
        assert_eq!(low[4].to_bits(), 0x3f80);
        assert_eq!(low[5].to_bits(), 0x3f82);
        assert_eq!(low[6].to_bits(), 0x3f81);
    }

    #[test]
    fn widening_is_exact_and_rounding_is_narrowing_then_widening() {
        let src: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![0.0f32; src.len()];
        widen(&mut wide, &src);
        for (w, s) in wide.iter().zip(&src) {
            assert_eq!(w.to_bits(), u32::from(s.to_bits()) << 16);
        }
        let x: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut rounded = x.clone();
        Rounding::Bf16.apply(&mut rounded);
        let mut exact = x.clone();
        Rounding::Exact.apply(&mut exact);
        assert_eq!(exact, x, "exact rounding changes nothing");
        let (mut low, mut back) = (vec![bf16::ZERO; x.len()], vec![0.0f32; x.len()]);
        narrow(&mut low, &x);
        widen(&mut back, &low);
        assert_eq!(rounded, back);
        assert!(rounded.iter().zip(&x).any(|(r, x)| r != x));
        assert!(
            rounded.iter().all(|&r| r == Rounding::Bf16.round(r)),
            "idempotent"
        );
    }
}
