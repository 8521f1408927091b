//! Mean cross-entropy over all positions (`F.cross_entropy(logits, targets)`), fused backward.

use rayon::prelude::*;

use super::embedding::{check_tokens, TokenId};
use super::math::{exp, fast, max};
use crate::error::Result;

/// `loss = mean over n of (logsumexp(logits[n]) - logits[n, targets[n]])` for `logits`
/// `[N, V]` and `targets` `[N]`; writes each row's logsumexp to `lse` `[N]` (saved for the
/// backward) and returns the loss. Row losses are summed in row order in f64, so the result does
/// not depend on the thread count. Every position counts (no ignore index). Fails, writing
/// nothing, if a target is out of `0..V`.
pub fn cross_entropy_forward<T: TokenId>(
    lse: &mut [f32],
    logits: &[f32],
    targets: &[T],
    vocab: usize,
) -> Result<f32> {
    cross_entropy_forward_pitched(lse, logits, vocab, targets, vocab)
}

/// [`cross_entropy_forward`] reading `logits` in rows `pitch` elements apart (`logits` is
/// `[N, pitch]`, of which each row's first `V` elements are read).
pub fn cross_entropy_forward_pitched<T: TokenId>(
    lse: &mut [f32],
    logits: &[f32],
    pitch: usize,
    targets: &[T],
    vocab: usize,
) -> Result<f32> {
    let rows = targets.len();
    assert!(vocab > 0, "cross_entropy: V must be positive");
    assert!(pitch >= vocab, "cross_entropy: pitch is shorter than V");
    assert_eq!(
        logits.len(),
        rows * pitch,
        "cross_entropy: logits are not [N, pitch]"
    );
    assert_eq!(lse.len(), rows, "cross_entropy: lse is not [N]");
    check_tokens(targets, vocab)?;
    lse.par_iter_mut()
        .zip(logits.par_chunks(pitch))
        .for_each(|(l, row)| {
            let row = &row[..vocab];
            *l = fast(
                #[inline(always)]
                || {
                    let m = max(row);
                    let mut acc = [0.0f32; 8];
                    let chunks = row.chunks_exact(8);
                    let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - m)).sum();
                    for c in chunks {
                        for i in 0..8 {
                            acc[i] += exp(c[i] - m);
                        }
                    }
                    let z = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
                        + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                    m + (z + tail).ln()
                },
            );
        });
    let total: f64 = lse
        .iter()
        .zip(targets)
        .enumerate()
        .map(|(n, (&l, t))| l as f64 - logits[n * pitch + t.index().unwrap_or(0)] as f64)
        .sum();
    Ok((total / rows.max(1) as f64) as f32)
}

/// Backward of [`cross_entropy_forward`]: `dlogits[n] = (softmax(logits[n]) - onehot(targets[n]))
/// * dloss / N`, computed from the saved `lse` without a softmax tensor; overwrites `dlogits`
/// `[N, V]`. `targets` must have passed the forward's check.
pub fn cross_entropy_backward<T: TokenId>(
    dlogits: &mut [f32],
    logits: &[f32],
    lse: &[f32],
    targets: &[T],
    vocab: usize,
    dloss: f32,
) {
    cross_entropy_backward_pitched(dlogits, logits, vocab, lse, targets, vocab, dloss)
}

/// [`cross_entropy_backward`] with `logits` and `dlogits` in rows `pitch` elements apart
/// (both `[N, pitch]`, of which each row's first `V` elements are read and written).
pub fn cross_entropy_backward_pitched<T: TokenId>(
    dlogits: &mut [f32],
    logits: &[f32],
    pitch: usize,
    lse: &[f32],
    targets: &[T],
    vocab: usize,
    dloss: f32,
) {
    let rows = targets.len();
    assert!(vocab > 0, "cross_entropy_backward: V must be positive");
    assert!(
        pitch >= vocab,
        "cross_entropy_backward: pitch is shorter than V"
    );
    assert_eq!(
        logits.len(),
        rows * pitch,
        "cross_entropy_backward: logits are not [N, pitch]"
    );
    assert_eq!(
        dlogits.len(),
        rows * pitch,
        "cross_entropy_backward: dlogits are not [N, pitch]"
    );
    assert_eq!(lse.len(), rows, "cross_entropy_backward: lse is not [N]");
    let g = dloss / rows.max(1) as f32;
    dlogits
        .par_chunks_mut(pitch)
        .zip(logits.par_chunks(pitch))
        .zip(lse.par_iter().zip(targets.par_iter()))
        .for_each(|((d, x), (&l, t))| {
            let (d, x) = (&mut d[..vocab], &x[..vocab]);
            fast(
                #[inline(always)]
                || {
                    for (d, &x) in d.iter_mut().zip(x) {
                        *d = exp(x - l) * g;
                    }
                },
            );
            if let Some(i) = t.index().filter(|&i| i < vocab) {
                d[i] = (exp(x[i] - l) - 1.0) * g;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{check_grad_scalar, Rng};

    #[test]
    fn loss_matches_naive_f64_and_rejects_bad_targets() {
        let (n, v) = (6, 37);
        let mut rng = Rng::new(80);
        let logits: Vec<f32> = rng.vec(n * v).iter().map(|x| 5.0 * x).collect();
        let targets: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
        let mut lse = vec![f32::NAN; n];
        let loss = cross_entropy_forward(&mut lse, &logits, &targets, v).unwrap();
        let mut want = 0.0f64;
        for r in 0..n {
            let row = &logits[r * v..(r + 1) * v];
            let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
            assert!((lse[r] as f64 - z.ln()).abs() < 2e-6, "lse[{r}]");
            want += z.ln() - row[targets[r] as usize] as f64;
        }
        want /= n as f64;
        assert!(
            (loss as f64 - want).abs() < 1e-6 * want.abs(),
            "{loss} vs {want}"
        );
        let mut bad = targets.iter().map(|&t| t as i32).collect::<Vec<_>>();
        bad[4] = v as i32;
        let err = cross_entropy_forward(&mut lse, &logits, &bad, v).unwrap_err();
        assert!(err.to_string().contains("position 4"), "{err}");
    }

    #[test]
    fn backward_is_the_gradient_of_the_mean_loss() {
        let (n, v) = (4, 11);
        let mut rng = Rng::new(81);
        let logits: Vec<f32> = rng.vec(n * v).iter().map(|x| 3.0 * x).collect();
        // A repeated target and a target in the last column.
        let targets = [3i32, 10, 3, 0];
        let dloss = 1.7f32;
        let mut lse = vec![0.0; n];
        cross_entropy_forward(&mut lse, &logits, &targets, v).unwrap();
        let mut d = vec![f32::NAN; n * v];
        cross_entropy_backward(&mut d, &logits, &lse, &targets, v, dloss);
        check_grad_scalar("dlogits", &logits, &d, |x| {
            let mut l = vec![0.0; n];
            dloss as f64 * cross_entropy_forward(&mut l, x, &targets, v).unwrap() as f64
        });
        // Each row of (softmax - onehot) sums to zero.
        for r in 0..n {
            assert!(d[r * v..(r + 1) * v].iter().sum::<f32>().abs() < 1e-6);
        }
    }
}
