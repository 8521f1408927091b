//! Dense layers: `nn.Linear` (`[out, in]` weight) and GPT-2's `Conv1D` (`[in, out]`), via gemm.

use rayon::prelude::*;

use super::math::{matmul, matmul_pitched, reduce_rows, Mat, ROW_GRAIN};

pub use protrain_ir::WeightLayout;

/// `W` as the `[in, out]` right-hand operand of `y = x W`.
fn as_in_out(layout: WeightLayout, w: &[f32], d_in: usize, d_out: usize) -> Mat<'_> {
    match layout {
        WeightLayout::OutIn => Mat {
            data: w,
            rs: 1,
            cs: d_in,
        },
        WeightLayout::InOut => Mat {
            data: w,
            rs: d_out,
            cs: 1,
        },
    }
}

/// `W^T` as the `[out, in]` right-hand operand of `dx = dy W^T`.
fn as_out_in(layout: WeightLayout, w: &[f32], d_in: usize, d_out: usize) -> Mat<'_> {
    match layout {
        WeightLayout::OutIn => Mat {
            data: w,
            rs: d_in,
            cs: 1,
        },
        WeightLayout::InOut => Mat {
            data: w,
            rs: 1,
            cs: d_out,
        },
    }
}

/// `y = x W (+ bias)` for `x` `[N, in]`, `y` `[N, out]` (overwritten), `weight` in `layout`,
/// optional `bias` `[out]`. The bias is written first and the product accumulated onto it, so
/// no scratch is needed.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    y: &mut [f32],
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    layout: WeightLayout,
    rows: usize,
    d_in: usize,
    d_out: usize,
) {
    linear_forward_pitched(y, d_out, x, weight, bias, layout, rows, d_in, d_out)
}

/// [`linear_forward`] writing `y` in rows `pitch` elements apart (`y` is `[N, pitch]`, of
/// which each row's first `out` elements are written and the rest left alone).
#[allow(clippy::too_many_arguments)]
pub fn linear_forward_pitched(
    y: &mut [f32],
    pitch: usize,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    layout: WeightLayout,
    rows: usize,
    d_in: usize,
    d_out: usize,
) {
    assert_eq!(x.len(), rows * d_in, "linear: x is not [N, in]");
    assert!(pitch >= d_out, "linear: pitch {pitch} is shorter than out");
    assert_eq!(y.len(), rows * pitch, "linear: y is not [N, pitch]");
    assert_eq!(weight.len(), d_in * d_out, "linear: weight is not in * out");
    if pitch != d_out {
        let lhs = Mat {
            data: x,
            rs: d_in,
            cs: 1,
        };
        let rhs = as_in_out(layout, weight, d_in, d_out);
        if let Some(b) = bias {
            assert_eq!(b.len(), d_out, "linear: bias is not [out]");
            y.par_chunks_mut(pitch)
                .with_min_len(ROW_GRAIN)
                .for_each(|row| row[..d_out].copy_from_slice(b));
        }
        matmul_pitched(y, pitch, lhs, rhs, rows, d_out, d_in, bias.is_some());
        return;
    }
    let lhs = Mat {
        data: x,
        rs: d_in,
        cs: 1,
    };
    let rhs = as_in_out(layout, weight, d_in, d_out);
    match bias {
        Some(b) => {
            assert_eq!(b.len(), d_out, "linear: bias is not [out]");
            if d_out > 0 {
                y.par_chunks_mut(d_out)
                    .with_min_len(ROW_GRAIN)
                    .for_each(|row| row.copy_from_slice(b));
            }
            matmul(y, lhs, rhs, rows, d_out, d_in, true);
        }
        None => matmul(y, lhs, rhs, rows, d_out, d_in, false),
    }
}

/// Backward of [`linear_forward`]: `dx = dy W^T` (overwritten); `dweight` (same layout as the
/// weight) `= dy^T x` or `x^T dy`, and `dbias = sum over rows of dy`, both overwritten unless
/// `accumulate` (tied weights, gradient accumulation). Pass `None` for a gradient not wanted
/// (e.g. `dx` of the first layer, or a layer without bias).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dx: Option<&mut [f32]>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    weight: &[f32],
    layout: WeightLayout,
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate: bool,
) {
    linear_backward_pitched(
        dx, dweight, dbias, dy, d_out, x, weight, layout, rows, d_in, d_out, accumulate,
    )
}

/// [`linear_backward`] reading `dy` in rows `dy_pitch` elements apart (`dy` is
/// `[N, dy_pitch]`, of which each row's first `out` elements are read).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_pitched(
    dx: Option<&mut [f32]>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dy: &[f32],
    dy_pitch: usize,
    x: &[f32],
    weight: &[f32],
    layout: WeightLayout,
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate: bool,
) {
    assert_eq!(x.len(), rows * d_in, "linear_backward: x is not [N, in]");
    assert!(
        dy_pitch >= d_out,
        "linear_backward: pitch {dy_pitch} is shorter than out"
    );
    assert_eq!(
        dy.len(),
        rows * dy_pitch,
        "linear_backward: dy is not [N, pitch]"
    );
    assert_eq!(
        weight.len(),
        d_in * d_out,
        "linear_backward: weight is not in * out"
    );
    assert_eq!(
        dweight.len(),
        d_in * d_out,
        "linear_backward: dweight is not in * out"
    );
    if let Some(dx) = dx {
        let lhs = Mat {
            data: dy,
            rs: dy_pitch,
            cs: 1,
        };
        let rhs = as_out_in(layout, weight, d_in, d_out);
        matmul(dx, lhs, rhs, rows, d_in, d_out, false);
    }
    match layout {
        // dW [out, in] = dy^T [out, N] x [N, in]
        WeightLayout::OutIn => matmul(
            dweight,
            Mat {
                data: dy,
                rs: 1,
                cs: dy_pitch,
            },
            Mat {
                data: x,
                rs: d_in,
                cs: 1,
            },
            d_out,
            d_in,
            rows,
            accumulate,
        ),
        // dW [in, out] = x^T [in, N] dy [N, out]
        WeightLayout::InOut => matmul(
            dweight,
            Mat {
                data: x,
                rs: 1,
                cs: d_in,
            },
            Mat {
                data: dy,
                rs: dy_pitch,
                cs: 1,
            },
            d_in,
            d_out,
            rows,
            accumulate,
        ),
    }
    if let Some(db) = dbias {
        assert_eq!(db.len(), d_out, "linear_backward: dbias is not [out]");
        reduce_rows(
            db,
            rows,
            accumulate,
            #[inline(always)]
            |row, c0, block| {
                let s = row * dy_pitch + c0;
                for (b, &g) in block.iter_mut().zip(&dy[s..]) {
                    *b += g;
                }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, bits, check_grad, Rng};

    const N: usize = 6;
    const IN: usize = 5;
    const OUT: usize = 7;

    /// `W[j][i]` (out j, in i) stored in `layout`.
    fn at(w: &[f32], layout: WeightLayout, j: usize, i: usize) -> f32 {
        match layout {
            WeightLayout::OutIn => w[j * IN + i],
            WeightLayout::InOut => w[i * OUT + j],
        }
    }

    fn fwd(x: &[f32], w: &[f32], b: Option<&[f32]>, layout: WeightLayout) -> Vec<f32> {
        let mut y = vec![f32::NAN; N * OUT];
        linear_forward(&mut y, x, w, b, layout, N, IN, OUT);
        y
    }

    #[test]
    fn forward_matches_naive_product_for_both_layouts() {
        let mut rng = Rng::new(20);
        let (x, w, b) = (rng.vec(N * IN), rng.vec(IN * OUT), rng.vec(OUT));
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for bias in [None, Some(&b[..])] {
                let mut want = vec![0.0f64; N * OUT];
                for n in 0..N {
                    for j in 0..OUT {
                        let mut acc = bias.map_or(0.0, |b| b[j] as f64);
                        for i in 0..IN {
                            acc += x[n * IN + i] as f64 * at(&w, layout, j, i) as f64;
                        }
                        want[n * OUT + j] = acc;
                    }
                }
                assert_close("linear", &fwd(&x, &w, bias, layout), &want, 1e-6);
            }
        }
    }

    #[test]
    fn gradients_for_both_layouts_with_and_without_bias() {
        let mut rng = Rng::new(21);
        let (x, w, b, cot) = (
            rng.vec(N * IN),
            rng.vec(IN * OUT),
            rng.vec(OUT),
            rng.vec(N * OUT),
        );
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for with_bias in [false, true] {
                let bias = with_bias.then_some(&b[..]);
                let (mut dx, mut dw, mut db) = (
                    vec![f32::NAN; N * IN],
                    vec![f32::NAN; IN * OUT],
                    vec![f32::NAN; OUT],
                );
                let dbias = if with_bias { Some(&mut db[..]) } else { None };
                linear_backward(
                    Some(&mut dx),
                    &mut dw,
                    dbias,
                    &cot,
                    &x,
                    &w,
                    layout,
                    N,
                    IN,
                    OUT,
                    false,
                );
                let name = format!("{layout:?} bias={with_bias}");
                check_grad(
                    &format!("{name} dx"),
                    &x,
                    &dx,
                    |x| fwd(x, &w, bias, layout),
                    &cot,
                );
                check_grad(
                    &format!("{name} dW"),
                    &w,
                    &dw,
                    |w| fwd(&x, w, bias, layout),
                    &cot,
                );
                if with_bias {
                    check_grad(
                        &format!("{name} db"),
                        &b,
                        &db,
                        |b| fwd(&x, &w, Some(b), layout),
                        &cot,
                    );
                }
            }
        }
    }

    #[test]
    fn accumulate_adds_weight_gradients_and_backward_is_deterministic() {
        let mut rng = Rng::new(22);
        // Big enough that gemm actually splits the work over threads.
        let (n, i, o) = (256, 96, 160);
        let (x, w, dy) = (rng.vec(n * i), rng.vec(i * o), rng.vec(n * o));
        let run = || {
            let (mut dx, mut dw, mut db) = (vec![0.0; n * i], vec![0.0; i * o], vec![0.0; o]);
            linear_backward(
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &dy,
                &x,
                &w,
                WeightLayout::InOut,
                n,
                i,
                o,
                false,
            );
            (dx, dw, db)
        };
        let (dx1, dw1, db1) = run();
        let (dx2, dw2, db2) = run();
        assert_eq!(
            (bits(&dx1), bits(&dw1), bits(&db1)),
            (bits(&dx2), bits(&dw2), bits(&db2))
        );
        let (mut dw, mut db) = (dw1.clone(), db1.clone());
        linear_backward(
            None,
            &mut dw,
            Some(&mut db),
            &dy,
            &x,
            &w,
            WeightLayout::InOut,
            n,
            i,
            o,
            true,
        );
        let twice: Vec<f64> = dw1.iter().map(|&v| 2.0 * v as f64).collect();
        assert_close("accumulated dW", &dw, &twice, 1e-5);
        let twice: Vec<f64> = db1.iter().map(|&v| 2.0 * v as f64).collect();
        assert_close("accumulated db", &db, &twice, 1e-5);
    }
}
