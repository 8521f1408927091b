//! The 12-byte host layout's cast: a staged chunk's f32 master weights rounded into its narrow
//! parameters before an upload, exactly as the CPU Adam rounds the master into the parameter
//! in the other layouts ([`to_bf16`], `half::f16::from_f32`), so every layout uploads the same
//! bits.

use super::adamw::{bf16, f16, to_bf16};
use rayon::prelude::*;

/// Elements per task: large enough to amortise the task, small enough to spread a chunk over
/// the cores.
pub const CAST_BLOCK: usize = 1 << 16;

/// `out[i]` = `master[i]` rounded to bf16, to nearest, ties to even. Panics when the lengths
/// differ (a verified schedule's casts never do).
pub fn cast_bf16(master: &[f32], out: &mut [bf16]) {
    assert_eq!(
        master.len(),
        out.len(),
        "a cast writes one element per master weight"
    );
    out.par_chunks_mut(CAST_BLOCK)
        .zip(master.par_chunks(CAST_BLOCK))
        .for_each(|(o, m)| {
            for (o, &x) in o.iter_mut().zip(m) {
                *o = to_bf16(x);
            }
        });
}

/// `out[i]` = `master[i]` rounded to f16, to nearest, ties to even (see [`cast_bf16`]).
pub fn cast_f16(master: &[f32], out: &mut [f16]) {
    assert_eq!(
        master.len(),
        out.len(),
        "a cast writes one element per master weight"
    );
    out.par_chunks_mut(CAST_BLOCK)
        .zip(master.par_chunks(CAST_BLOCK))
        .for_each(|(o, m)| {
            for (o, &x) in o.iter_mut().zip(m) {
                *o = f16::from_f32(x);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{adamw_step_fused, AdamWConfig, Grad, Low};

    #[test]
    fn the_cast_rounds_as_the_cpu_adam_rounds_the_parameter() {
        // Values around bf16 and f16 rounding boundaries (ties, subnormals, infinities,
        // NaN), across block boundaries.
        let n = CAST_BLOCK + 77;
        let master: Vec<f32> = (0..n)
            .map(|i| match i % 7 {
                0 => f32::from_bits(0x3f80_8000 + (i as u32 % 3)),
                1 => -1.0e-41 * i as f32,
                2 => 65504.0 + i as f32,
                3 => f32::INFINITY,
                4 => f32::NAN,
                _ => (i as f32).sin() * 3.7,
            })
            .collect();
        let mut cast = vec![bf16::ZERO; n];
        cast_bf16(&master, &mut cast);
        for (c, &x) in cast.iter().zip(&master) {
            assert_eq!(c.to_bits(), to_bf16(x).to_bits());
            if !x.is_nan() {
                assert_eq!(c.to_bits(), bf16::from_f32(x).to_bits());
            }
        }
        let mut cast16 = vec![f16::ZERO; n];
        cast_f16(&master, &mut cast16);
        for (c, &x) in cast16.iter().zip(&master) {
            assert_eq!(c.to_bits(), f16::from_f32(x).to_bits());
        }
        // An AdamW step with lr 0 and no decay leaves the master as it is and writes it
        // rounded into the parameter: the cast must write the same bits.
        let finite: Vec<usize> = (0..n).filter(|&i| master[i].is_finite()).collect();
        let mut p: Vec<f32> = finite.iter().map(|&i| master[i]).collect();
        let k = p.len();
        let (mut m, mut v) = (vec![0.0; k], vec![0.0; k]);
        let g = vec![0.0f32; k];
        let mut low = vec![bf16::ZERO; k];
        let config = AdamWConfig {
            lr: 0.0,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        adamw_step_fused(
            &mut p,
            Grad::F32(&g),
            None,
            &mut m,
            &mut v,
            Some(Low::Bf16(&mut low)),
            1,
            &config,
        );
        let cast: Vec<bf16> = finite.iter().map(|&i| cast[i]).collect();
        for (a, b) in low.iter().zip(&cast) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}
