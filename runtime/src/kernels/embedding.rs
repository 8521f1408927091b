//! Token and learned position embeddings (`nn.Embedding` lookups) and their backward scatters.

use rayon::prelude::*;

use super::math::axpy;
use crate::error::{Result, RuntimeError};

/// An integer token id as it comes from the data loader (`u32` or `i32`).
pub trait TokenId: Copy + Send + Sync {
    /// The id as a row index, or `None` when it is negative.
    fn index(self) -> Option<usize>;
    /// The id widened for error messages.
    fn widen(self) -> i64;
}

impl TokenId for u32 {
    #[inline]
    fn index(self) -> Option<usize> {
        Some(self as usize)
    }
    fn widen(self) -> i64 {
        i64::from(self)
    }
}

impl TokenId for i32 {
    #[inline]
    fn index(self) -> Option<usize> {
        usize::try_from(self).ok()
    }
    fn widen(self) -> i64 {
        i64::from(self)
    }
}

/// Checks that every id is in `0..vocab`, naming the first one that is not.
pub fn check_tokens<T: TokenId>(tokens: &[T], vocab: usize) -> Result<()> {
    for (position, &tok) in tokens.iter().enumerate() {
        if tok.index().is_none_or(|i| i >= vocab) {
            return Err(RuntimeError::TokenOutOfRange {
                token: tok.widen(),
                position,
                vocab,
            });
        }
    }
    Ok(())
}

/// Token embedding: `out[n, :] = table[tokens[n], :]`; `tokens` is `[N]` (N = B*T), `table` is
/// `[V, C]`, `out` is `[N, C]` and is overwritten. Fails, writing nothing, if a token is out of
/// `0..V`.
pub fn embedding_forward<T: TokenId>(
    out: &mut [f32],
    tokens: &[T],
    table: &[f32],
    vocab: usize,
    channels: usize,
) -> Result<()> {
    assert_eq!(
        table.len(),
        vocab * channels,
        "embedding: table is not [V, C]"
    );
    assert_eq!(
        out.len(),
        tokens.len() * channels,
        "embedding: out is not [N, C]"
    );
    check_tokens(tokens, vocab)?;
    if channels == 0 {
        return Ok(());
    }
    out.par_chunks_mut(channels)
        .zip(tokens.par_iter())
        .with_min_len(super::math::ROW_GRAIN)
        .for_each(|(row, tok)| {
            let v = tok.index().unwrap_or(0);
            row.copy_from_slice(&table[v * channels..(v + 1) * channels]);
        });
    Ok(())
}

/// Backward of [`embedding_forward`]: `dtable[v, :] (+)= sum over n with tokens[n] == v of
/// dout[n, :]`, summed in increasing `n` for every row, so repeated tokens give the same bits
/// whatever the thread count. Overwrites `dtable` (rows of tokens that do not occur become
/// zero) unless `accumulate`, which adds, as a tied embedding's second use needs. Tasks own
/// disjoint blocks of vocabulary rows and each scans all tokens, so nothing races. Tokens must
/// have passed [`embedding_forward`]'s check (an out-of-range one is ignored here).
pub fn embedding_backward<T: TokenId>(
    dtable: &mut [f32],
    dout: &[f32],
    tokens: &[T],
    vocab: usize,
    channels: usize,
    accumulate: bool,
) {
    assert_eq!(
        dtable.len(),
        vocab * channels,
        "embedding_backward: dtable is not [V, C]"
    );
    assert_eq!(
        dout.len(),
        tokens.len() * channels,
        "embedding_backward: dout is not [N, C]"
    );
    if channels == 0 || vocab == 0 {
        return;
    }
    // The partition changes only which task does a row, never the order of its sum.
    let rows_per_task = vocab.div_ceil(4 * rayon::current_num_threads()).max(1);
    dtable
        .par_chunks_mut(rows_per_task * channels)
        .enumerate()
        .for_each(|(task, block)| {
            if !accumulate {
                block.fill(0.0);
            }
            let first = task * rows_per_task;
            let rows = block.len() / channels;
            for (n, tok) in tokens.iter().enumerate() {
                let Some(v) = tok.index() else { continue };
                if v >= first && v < first + rows {
                    let r = v - first;
                    axpy(
                        &mut block[r * channels..(r + 1) * channels],
                        1.0,
                        &dout[n * channels..(n + 1) * channels],
                    );
                }
            }
        });
}

/// Learned position embedding: `out[b, t, :] = table[offset + t, :]` for `t` in `0..T`,
/// broadcast over the batch. `table` is `[P, C]` with `offset + T <= P` (OPT's learned
/// positions use `offset = 2`; GPT-2 uses 0). `out` is `[B, T, C]` and is overwritten.
pub fn position_embedding_forward(
    out: &mut [f32],
    table: &[f32],
    batch: usize,
    seq: usize,
    channels: usize,
    offset: usize,
) {
    assert!(
        offset + seq <= table.len() / channels.max(1),
        "position_embedding: offset + T > P"
    );
    assert_eq!(
        table.len() % channels.max(1),
        0,
        "position_embedding: table is not [P, C]"
    );
    assert_eq!(
        out.len(),
        batch * seq * channels,
        "position_embedding: out is not [B, T, C]"
    );
    let rows = &table[offset * channels..(offset + seq) * channels];
    if rows.is_empty() {
        return;
    }
    out.par_chunks_mut(seq * channels)
        .for_each(|b| b.copy_from_slice(rows));
}

/// Backward of [`position_embedding_forward`]: `dtable[offset + t, :] (+)= sum over b (in
/// order) of dout[b, t, :]`. Overwrites `dtable` (rows outside `offset..offset + T` become zero)
/// unless `accumulate`. Parallel over table rows.
pub fn position_embedding_backward(
    dtable: &mut [f32],
    dout: &[f32],
    batch: usize,
    seq: usize,
    channels: usize,
    offset: usize,
    accumulate: bool,
) {
    assert!(
        offset + seq <= dtable.len() / channels.max(1),
        "position_embedding_backward: offset + T > P"
    );
    assert_eq!(
        dout.len(),
        batch * seq * channels,
        "position_embedding_backward: dout is not [B, T, C]"
    );
    if channels == 0 {
        return;
    }
    dtable
        .par_chunks_mut(channels)
        .enumerate()
        .for_each(|(p, row)| {
            if !accumulate {
                row.fill(0.0);
            }
            if p < offset || p >= offset + seq {
                return;
            }
            let t = p - offset;
            for b in 0..batch {
                let s = (b * seq + t) * channels;
                axpy(row, 1.0, &dout[s..s + channels]);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{check_grad, Rng};

    #[test]
    fn embedding_gathers_rows_and_rejects_bad_tokens() {
        let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // V=4, C=3
        let mut out = vec![f32::NAN; 9];
        embedding_forward(&mut out, &[2u32, 0, 2], &table, 4, 3).unwrap();
        assert_eq!(out, [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
        let mut out2 = vec![0.0; 6];
        let err = embedding_forward(&mut out2, &[1i32, -1], &table, 4, 3).unwrap_err();
        assert!(out2.iter().all(|&x| x == 0.0), "nothing written on error");
        assert!(
            matches!(
                err,
                RuntimeError::TokenOutOfRange {
                    token: -1,
                    position: 1,
                    vocab: 4
                }
            ),
            "{err}"
        );
        let err = embedding_forward(&mut out[..3], &[4u32], &table, 4, 3).unwrap_err();
        assert!(
            err.to_string().contains("outside the vocabulary of 4"),
            "{err}"
        );
    }

    #[test]
    fn embedding_backward_sums_repeated_tokens() {
        let (v, c) = (7, 5);
        let tokens = [3u32, 1, 3, 6, 3, 0, 1];
        let mut rng = Rng::new(1);
        let table = rng.vec(v * c);
        let cot = rng.vec(tokens.len() * c);
        let mut dtable = vec![f32::NAN; v * c];
        embedding_backward(&mut dtable, &cot, &tokens, v, c, false);
        check_grad(
            "embedding dtable",
            &table,
            &dtable,
            |t| {
                let mut out = vec![0.0; tokens.len() * c];
                embedding_forward(&mut out, &tokens, t, v, c).unwrap();
                out
            },
            &cot,
        );
        // Rows of absent tokens are zero; accumulate adds on top.
        assert!(dtable[2 * c..3 * c].iter().all(|&x| x == 0.0));
        let once = dtable.clone();
        embedding_backward(&mut dtable, &cot, &tokens, v, c, true);
        let twice: Vec<f64> = once.iter().map(|&x| 2.0 * x as f64).collect();
        crate::kernels::testutil::assert_close("accumulated dtable", &dtable, &twice, 1e-6);
    }

    #[test]
    fn position_embedding_uses_offset_rows_and_sums_over_batch() {
        let (b, t, c, p, offset) = (3, 4, 2, 8, 2);
        let mut rng = Rng::new(2);
        let table = rng.vec(p * c);
        let mut out = vec![0.0; b * t * c];
        position_embedding_forward(&mut out, &table, b, t, c, offset);
        assert_eq!(&out[t * c..t * c + c], &table[offset * c..offset * c + c]);
        assert_eq!(
            &out[(2 * t + 3) * c..(2 * t + 4) * c],
            &table[(offset + 3) * c..(offset + 4) * c]
        );
        let cot = rng.vec(b * t * c);
        let mut dtable = vec![f32::NAN; p * c];
        position_embedding_backward(&mut dtable, &cot, b, t, c, offset, false);
        check_grad(
            "position dtable",
            &table,
            &dtable,
            |tab| {
                let mut o = vec![0.0; b * t * c];
                position_embedding_forward(&mut o, tab, b, t, c, offset);
                o
            },
            &cot,
        );
    }
}
