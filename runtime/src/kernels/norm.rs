//! Row normalisations: `nn.LayerNorm` (GPT-2, OPT) and LLaMA's `RMSNorm`, in f32.

use rayon::prelude::*;

use super::math::{fast, reduce_rows, sum, ROW_GRAIN};

/// Layer norm over the last dimension: `out[r] = (x[r] - mean_r) * rstd_r * weight + bias`
/// with the biased variance, `rstd_r = 1 / sqrt(var_r + eps)`, as `nn.LayerNorm`. `x` and `out`
/// are `[N, C]`; `weight` and `bias` are `[C]`; `mean` and `rstd` (`[N]`) are saved for the
/// backward. All outputs are overwritten.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    channels: usize,
    eps: f32,
) {
    let c = channels;
    assert!(c > 0, "layer_norm: C must be positive");
    assert_eq!(x.len(), rows * c, "layer_norm: x is not [N, C]");
    assert_eq!(out.len(), rows * c, "layer_norm: out is not [N, C]");
    assert_eq!(
        (mean.len(), rstd.len()),
        (rows, rows),
        "layer_norm: mean/rstd are not [N]"
    );
    assert_eq!(weight.len(), c, "layer_norm: weight is not [C]");
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "layer_norm: bias is not [C]");
    }
    out.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .with_min_len(ROW_GRAIN)
        .for_each(|((o, xr), (m, s))| {
            fast(
                #[inline(always)]
                || {
                    let mu = sum(xr) / c as f32;
                    for (oi, &xi) in o.iter_mut().zip(xr) {
                        let d = xi - mu;
                        *oi = d * d;
                    }
                    let var = sum(o) / c as f32;
                    let r = 1.0 / (var + eps).sqrt();
                    for ((oi, &xi), &w) in o.iter_mut().zip(xr).zip(weight) {
                        *oi = (xi - mu) * r * w;
                    }
                    if let Some(b) = bias {
                        for (oi, &bi) in o.iter_mut().zip(b) {
                            *oi += bi;
                        }
                    }
                    *m = mu;
                    *s = r;
                },
            )
        });
}

/// Backward of [`layer_norm_forward`]. With `n = (x - mean) * rstd` and `g = dout * weight`:
/// `dx = (g - mean(g) - n * mean(g * n)) * rstd` (overwritten); `dweight = sum_r dout * n` and
/// `dbias = sum_r dout`, overwritten unless `accumulate`, reduced in row order per column.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    dx: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rows: usize,
    channels: usize,
    accumulate: bool,
) {
    let c = channels;
    assert!(c > 0, "layer_norm_backward: C must be positive");
    for (len, what) in [(dx.len(), "dx"), (dout.len(), "dout"), (x.len(), "x")] {
        assert_eq!(len, rows * c, "layer_norm_backward: {what} is not [N, C]");
    }
    assert_eq!(
        (mean.len(), rstd.len()),
        (rows, rows),
        "layer_norm_backward: mean/rstd not [N]"
    );
    assert_eq!(
        (weight.len(), dweight.len()),
        (c, c),
        "layer_norm_backward: weight not [C]"
    );
    dx.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(x.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .with_min_len(ROW_GRAIN)
        .for_each(|((dxr, (dor, xr)), (&mu, &r))| {
            fast(
                #[inline(always)]
                || {
                    let (mut g_sum, mut gn_sum) = (0.0f32, 0.0f32);
                    for ((&d, &xi), &w) in dor.iter().zip(xr).zip(weight) {
                        let g = d * w;
                        g_sum += g;
                        gn_sum += g * ((xi - mu) * r);
                    }
                    let (g_mean, gn_mean) = (g_sum / c as f32, gn_sum / c as f32);
                    for (((o, &d), &xi), &w) in dxr.iter_mut().zip(dor).zip(xr).zip(weight) {
                        let n = (xi - mu) * r;
                        *o = (d * w - g_mean - n * gn_mean) * r;
                    }
                },
            )
        });
    reduce_rows(
        dweight,
        rows,
        accumulate,
        #[inline(always)]
        |row, c0, block| {
            let (mu, r) = (mean[row], rstd[row]);
            let s = row * c + c0;
            for ((dw, &d), &xi) in block.iter_mut().zip(&dout[s..]).zip(&x[s..]) {
                *dw += d * ((xi - mu) * r);
            }
        },
    );
    if let Some(db) = dbias {
        assert_eq!(db.len(), c, "layer_norm_backward: dbias is not [C]");
        reduce_rows(
            db,
            rows,
            accumulate,
            #[inline(always)]
            |row, c0, block| {
                let s = row * c + c0;
                for (b, &d) in block.iter_mut().zip(&dout[s..]) {
                    *b += d;
                }
            },
        );
    }
}

/// RMS norm as LLaMA's `LlamaRMSNorm` in f32: `rstd_r = 1 / sqrt(mean(x[r]^2) + eps)`,
/// `out[r] = s * (x[r] * rstd_r)` with the scale `s = weight`, or `s = 1 + weight` when
/// `unit_offset` (Gemma's `RMSNorm`). `x`, `out` are `[N, C]`, `weight` is `[C]`; `rstd`
/// (`[N]`) is saved for the backward. Outputs are overwritten. A norm per head of width `D` is
/// this with `N` the number of heads in all rows and `C = D`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    weight: &[f32],
    rows: usize,
    channels: usize,
    eps: f32,
    unit_offset: bool,
) {
    let c = channels;
    assert!(c > 0, "rms_norm: C must be positive");
    assert_eq!(
        (x.len(), out.len()),
        (rows * c, rows * c),
        "rms_norm: x/out are not [N, C]"
    );
    assert_eq!(rstd.len(), rows, "rms_norm: rstd is not [N]");
    assert_eq!(weight.len(), c, "rms_norm: weight is not [C]");
    out.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter_mut())
        .with_min_len(ROW_GRAIN)
        .for_each(|((o, xr), s)| {
            fast(
                #[inline(always)]
                || {
                    for (oi, &xi) in o.iter_mut().zip(xr) {
                        *oi = xi * xi;
                    }
                    let r = 1.0 / (sum(o) / c as f32 + eps).sqrt();
                    for ((oi, &xi), &w) in o.iter_mut().zip(xr).zip(weight) {
                        *oi = scale(w, unit_offset) * (xi * r);
                    }
                    *s = r;
                },
            )
        });
}

/// The factor an RMS norm multiplies its normalised rows by: `weight`, or `1 + weight` in f32.
#[inline(always)]
fn scale(w: f32, unit_offset: bool) -> f32 {
    if unit_offset {
        1.0 + w
    } else {
        w
    }
}

/// Backward of [`rms_norm_forward`]. With `n = x * rstd` and `g = dout * s` (`s` the forward's
/// scale): `dx = (g - n * mean(g * n)) * rstd` (overwritten); `dweight = sum_r dout * n` (the
/// same with a unit offset: `ds/dweight = 1`), overwritten unless `accumulate`, reduced in row
/// order per column.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward(
    dx: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    rows: usize,
    channels: usize,
    unit_offset: bool,
    accumulate: bool,
) {
    let c = channels;
    assert!(c > 0, "rms_norm_backward: C must be positive");
    for (len, what) in [(dx.len(), "dx"), (dout.len(), "dout"), (x.len(), "x")] {
        assert_eq!(len, rows * c, "rms_norm_backward: {what} is not [N, C]");
    }
    assert_eq!(rstd.len(), rows, "rms_norm_backward: rstd is not [N]");
    assert_eq!(
        (weight.len(), dweight.len()),
        (c, c),
        "rms_norm_backward: weight not [C]"
    );
    dx.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(x.par_chunks(c)))
        .zip(rstd.par_iter())
        .with_min_len(ROW_GRAIN)
        .for_each(|((dxr, (dor, xr)), &r)| {
            fast(
                #[inline(always)]
                || {
                    let mut gn_sum = 0.0f32;
                    for ((&d, &xi), &w) in dor.iter().zip(xr).zip(weight) {
                        gn_sum += (d * scale(w, unit_offset)) * (xi * r);
                    }
                    let gn_mean = gn_sum / c as f32;
                    for (((o, &d), &xi), &w) in dxr.iter_mut().zip(dor).zip(xr).zip(weight) {
                        *o = (d * scale(w, unit_offset) - (xi * r) * gn_mean) * r;
                    }
                },
            )
        });
    reduce_rows(
        dweight,
        rows,
        accumulate,
        #[inline(always)]
        |row, c0, block| {
            let r = rstd[row];
            let s = row * c + c0;
            for ((dw, &d), &xi) in block.iter_mut().zip(&dout[s..]).zip(&x[s..]) {
                *dw += d * (xi * r);
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, check_grad, Rng};

    const N: usize = 5;
    const C: usize = 19; // not a multiple of 8 or of the column grain

    fn ln(x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
        let (mut out, mut m, mut r) = (vec![0.0; N * C], vec![0.0; N], vec![0.0; N]);
        layer_norm_forward(&mut out, &mut m, &mut r, x, w, b, N, C, 1e-5);
        out
    }

    fn rms(x: &[f32], w: &[f32], unit_offset: bool) -> Vec<f32> {
        let (mut out, mut r) = (vec![0.0; N * C], vec![0.0; N]);
        rms_norm_forward(&mut out, &mut r, x, w, N, C, 1e-6, unit_offset);
        out
    }

    #[test]
    fn layer_norm_forward_matches_f64_reference() {
        let mut rng = Rng::new(10);
        let (x, w, b) = (rng.vec(N * C), rng.vec(C), rng.vec(C));
        let mut want = vec![0.0f64; N * C];
        for r in 0..N {
            let row = &x[r * C..(r + 1) * C];
            let mu = row.iter().map(|&v| v as f64).sum::<f64>() / C as f64;
            let var = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / C as f64;
            for j in 0..C {
                want[r * C + j] =
                    (row[j] as f64 - mu) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64;
            }
        }
        assert_close("layer_norm", &ln(&x, &w, Some(&b)), &want, 2e-6);
    }

    #[test]
    fn layer_norm_gradients() {
        let mut rng = Rng::new(11);
        let (x, w, b, cot) = (rng.vec(N * C), rng.vec(C), rng.vec(C), rng.vec(N * C));
        let (mut out, mut m, mut r) = (vec![0.0; N * C], vec![0.0; N], vec![0.0; N]);
        layer_norm_forward(&mut out, &mut m, &mut r, &x, &w, Some(&b), N, C, 1e-5);
        let (mut dx, mut dw, mut db) =
            (vec![f32::NAN; N * C], vec![f32::NAN; C], vec![f32::NAN; C]);
        layer_norm_backward(
            &mut dx,
            &mut dw,
            Some(&mut db),
            &cot,
            &x,
            &w,
            &m,
            &r,
            N,
            C,
            false,
        );
        check_grad("layer_norm dx", &x, &dx, |x| ln(x, &w, Some(&b)), &cot);
        check_grad("layer_norm dweight", &w, &dw, |w| ln(&x, w, Some(&b)), &cot);
        check_grad("layer_norm dbias", &b, &db, |b| ln(&x, &w, Some(b)), &cot);
        // Accumulating adds exactly one more copy of each weight gradient.
        let (dw1, db1) = (dw.clone(), db.clone());
        layer_norm_backward(
            &mut dx,
            &mut dw,
            Some(&mut db),
            &cot,
            &x,
            &w,
            &m,
            &r,
            N,
            C,
            true,
        );
        let twice = |g: &[f32]| g.iter().map(|&v| 2.0 * v as f64).collect::<Vec<_>>();
        assert_close("accumulated dweight", &dw, &twice(&dw1), 1e-6);
        assert_close("accumulated dbias", &db, &twice(&db1), 1e-6);
    }

    #[test]
    fn rms_norm_forward_matches_llama_and_gemma_references() {
        let mut rng = Rng::new(12);
        let (x, w) = (rng.vec(N * C), rng.vec(C));
        for unit_offset in [false, true] {
            let mut want = vec![0.0f64; N * C];
            for r in 0..N {
                let row = &x[r * C..(r + 1) * C];
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / C as f64;
                for j in 0..C {
                    let s = w[j] as f64 + if unit_offset { 1.0 } else { 0.0 };
                    want[r * C + j] = s * (row[j] as f64 / (ms + 1e-6).sqrt());
                }
            }
            assert_close("rms_norm", &rms(&x, &w, unit_offset), &want, 2e-6);
        }
    }

    #[test]
    fn rms_norm_gradients() {
        let mut rng = Rng::new(13);
        let (x, w, cot) = (rng.vec(N * C), rng.vec(C), rng.vec(N * C));
        for unit_offset in [false, true] {
            let (mut out, mut r) = (vec![0.0; N * C], vec![0.0; N]);
            rms_norm_forward(&mut out, &mut r, &x, &w, N, C, 1e-6, unit_offset);
            let (mut dx, mut dw) = (vec![f32::NAN; N * C], vec![f32::NAN; C]);
            rms_norm_backward(&mut dx, &mut dw, &cot, &x, &w, &r, N, C, unit_offset, false);
            check_grad("rms_norm dx", &x, &dx, |x| rms(x, &w, unit_offset), &cot);
            check_grad(
                "rms_norm dweight",
                &w,
                &dw,
                |w| rms(&x, w, unit_offset),
                &cot,
            );
        }
    }
}
