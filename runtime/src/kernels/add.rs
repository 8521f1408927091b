//! Elementwise addition (residual connections, token + position embeddings).

use rayon::prelude::*;

use super::math::ELEM_GRAIN;

/// `out = a + b`, all the same length; `out` is overwritten.
pub fn add_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert_eq!(out.len(), a.len(), "add: a length differs from out");
    assert_eq!(out.len(), b.len(), "add: b length differs from out");
    out.par_chunks_mut(ELEM_GRAIN)
        .zip(a.par_chunks(ELEM_GRAIN).zip(b.par_chunks(ELEM_GRAIN)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// `acc = acc + b` elementwise, the same sum [`add_forward`] computes (addition of two floats
/// is commutative bit for bit), for fused epilogues and gradient accumulation.
pub fn add_assign(acc: &mut [f32], b: &[f32]) {
    assert_eq!(acc.len(), b.len(), "add_assign: b length differs from acc");
    acc.par_chunks_mut(ELEM_GRAIN)
        .zip(b.par_chunks(ELEM_GRAIN))
        .for_each(|(acc, b)| {
            for (o, &b) in acc.iter_mut().zip(b) {
                *o += b;
            }
        });
}

/// `acc = bf16(f32(acc) + f32(b))` elementwise: a bf16 gradient summed into a bf16
/// accumulator in f32 and rounded once to nearest even (the CUDA `add_forward_bf16` run in
/// place computes the same bits).
pub fn add_assign_bf16(acc: &mut [half::bf16], b: &[half::bf16]) {
    assert_eq!(
        acc.len(),
        b.len(),
        "add_assign_bf16: b length differs from acc"
    );
    acc.par_chunks_mut(ELEM_GRAIN)
        .zip(b.par_chunks(ELEM_GRAIN))
        .for_each(|(acc, b)| {
            for (o, b) in acc.iter_mut().zip(b) {
                *o = half::bf16::from_f32(o.to_f32() + b.to_f32());
            }
        });
}

/// `acc = f16(f32(acc) + f32(b))` elementwise: [`add_assign_bf16`] for f16 (the CUDA
/// `add_forward_f16` run in place computes the same bits; a sum past 65504 becomes infinity).
pub fn add_assign_f16(acc: &mut [half::f16], b: &[half::f16]) {
    assert_eq!(
        acc.len(),
        b.len(),
        "add_assign_f16: b length differs from acc"
    );
    acc.par_chunks_mut(ELEM_GRAIN)
        .zip(b.par_chunks(ELEM_GRAIN))
        .for_each(|(acc, b)| {
            for (o, b) in acc.iter_mut().zip(b) {
                *o = half::f16::from_f32(o.to_f32() + b.to_f32());
            }
        });
}

/// `y[r, c] += bias[c]` for `y` `[rows, bias.len()]`: a bias added after the product it
/// belongs to (the CUDA backend's `bias_add` after its GEMM, where bf16 storage rounds the
/// product first; [`super::linear_forward`] adds an f32 bias before the product instead).
pub fn bias_add_assign(y: &mut [f32], bias: &[f32]) {
    let cols = bias.len();
    if cols == 0 {
        assert!(
            y.is_empty(),
            "bias_add_assign: y has values but the bias has none"
        );
        return;
    }
    assert_eq!(y.len() % cols, 0, "bias_add_assign: y is not [rows, bias]");
    let rows_per_task = (ELEM_GRAIN / cols).max(1);
    y.par_chunks_mut(rows_per_task * cols).for_each(|rows| {
        for row in rows.chunks_exact_mut(cols) {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    });
}

/// Backward of [`add_forward`]: `da = dout` and `db = dout`, both overwritten.
pub fn add_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    assert_eq!(
        da.len(),
        dout.len(),
        "add_backward: da length differs from dout"
    );
    assert_eq!(
        db.len(),
        dout.len(),
        "add_backward: db length differs from dout"
    );
    da.par_chunks_mut(ELEM_GRAIN)
        .zip(db.par_chunks_mut(ELEM_GRAIN))
        .zip(dout.par_chunks(ELEM_GRAIN))
        .for_each(|((a, b), d)| {
            a.copy_from_slice(d);
            b.copy_from_slice(d);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{check_grad, Rng};

    #[test]
    fn add_and_its_gradient() {
        let mut rng = Rng::new(40);
        let (a, b, cot) = (rng.vec(33), rng.vec(33), rng.vec(33));
        let mut out = vec![f32::NAN; 33];
        add_forward(&mut out, &a, &b);
        assert!(out
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(o, (a, b))| *o == a + b));
        let (mut da, mut db) = (vec![f32::NAN; 33], vec![f32::NAN; 33]);
        add_backward(&mut da, &mut db, &cot);
        let f = |a: &[f32], b: &[f32]| {
            let mut o = vec![0.0; 33];
            add_forward(&mut o, a, b);
            o
        };
        check_grad("add da", &a, &da, |a| f(a, &b), &cot);
        check_grad("add db", &b, &db, |b| f(&a, b), &cot);
    }

    #[test]
    fn bias_add_assign_adds_the_bias_to_every_row() {
        let mut rng = Rng::new(42);
        let (cols, rows) = (7, 5000);
        let (y0, bias) = (rng.vec(rows * cols), rng.vec(cols));
        let mut y = y0.clone();
        bias_add_assign(&mut y, &bias);
        for (i, (got, x)) in y.iter().zip(&y0).enumerate() {
            assert_eq!(got.to_bits(), (x + bias[i % cols]).to_bits(), "element {i}");
        }
        let mut empty: [f32; 0] = [];
        bias_add_assign(&mut empty, &[]);
    }

    #[test]
    fn add_assign_is_add_forward_bit_for_bit() {
        let mut rng = Rng::new(41);
        let (a, b) = (rng.vec(5000), rng.vec(5000));
        let mut out = vec![f32::NAN; 5000];
        add_forward(&mut out, &b, &a);
        let mut acc = a.clone();
        add_assign(&mut acc, &b);
        assert!(acc
            .iter()
            .zip(&out)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    /// f16 accumulation is the f32 sum rounded once, past 65504 to infinity, over more than one
    /// parallel chunk (the CUDA `add_forward_f16` in place gives these bits; the emulation
    /// harness checks that side).
    #[test]
    fn add_assign_f16_rounds_the_f32_sum_once() {
        let mut rng = Rng::new(43);
        let n = 3 * ELEM_GRAIN + 7;
        let to_f16 = |v: Vec<f32>| -> Vec<half::f16> {
            v.iter()
                .map(|&x| half::f16::from_f32(x * 40000.0))
                .collect()
        };
        let (a, b) = (to_f16(rng.vec(n)), to_f16(rng.vec(n)));
        let mut acc = a.clone();
        add_assign_f16(&mut acc, &b);
        let mut overflowed = 0;
        for (i, ((got, x), y)) in acc.iter().zip(&a).zip(&b).enumerate() {
            let want = half::f16::from_f32(x.to_f32() + y.to_f32());
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
            overflowed += usize::from(got.is_infinite());
        }
        assert!(overflowed > 0, "some sums pass 65504");
    }
}
