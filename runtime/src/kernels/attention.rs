//! Fused causal self-attention (flash-attention style) with grouped KV heads, an optional
//! sliding window, and separate or GPT-2-packed q/k/v.
//!
//! Nothing of size `[B, H, T, T]` is ever built: queries are processed in tiles of
//! [`Q_TILE`] rows against key blocks of [`K_TILE`], with an online softmax (flash-attention),
//! and only each row's logsumexp (`[B, H, T]`) is saved. The backward recomputes the
//! probabilities tile by tile from `q`, `k` and that logsumexp. Tile products are single-thread
//! gemm calls on a stack scratch tile.
//!
//! Parallelism and determinism: the forward runs one task per `(b, h)`, the backward one task
//! per `(b, kv head)`, which loops over the query heads of its group, then query tiles, then
//! key blocks, in order, so every sum (`dq` over keys, `dk` and `dv` over query heads and rows)
//! has one fixed order and the results are the same bits whatever the thread count. Tasks write
//! disjoint `(row, head)` segments of the outputs, through `RowsMut`.
//!
//! Storage rounding ([`Rounding`]). The CUDA backend runs attention as GEMMs around row
//! kernels and stores the probabilities (and in the backward the score gradients) in the
//! activations' dtype between them; with bf16 storage the kernels here round at the same
//! points: the forward normalises each row first (a second pass over the keys, with the row's
//! max and sum from the first) and rounds `P` before `P V`; the backward rounds `P` and `dS`
//! (computed from the unrounded `P`) before their products, and rounds `dk` and `dv` after
//! each query head of a group, where the CUDA GEMMs accumulate into bf16 outputs. The sums
//! themselves keep this module's order (tiles, online statistics), not cuBLAS's. With
//! [`Rounding::Exact`] nothing is rounded and the forward keeps its single online pass.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::math::{dot, exp, fast, gemm_raw, max, sum, Mat};
use super::storage::Rounding;

/// Query rows per tile.
pub const Q_TILE: usize = 64;
/// Keys per block; a `Q_TILE x K_TILE` score tile lives on the stack.
pub const K_TILE: usize = 64;

/// Single-threaded: the parallelism is over heads, and a fixed order keeps results exact.
const SERIAL: gemm::Parallelism = gemm::Parallelism::None;

/// The shape of a causal self-attention, and how its scores are made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// B.
    pub batch: usize,
    /// T.
    pub seq: usize,
    /// H, the number of query heads.
    pub n_heads: usize,
    /// KV, the number of key/value heads; divides `n_heads`. Query head `h` reads kv head
    /// `h / (n_heads / n_kv_heads)`, as `repeat_kv` in transformers.
    pub n_kv_heads: usize,
    /// D.
    pub head_dim: usize,
    /// Sliding window W (Mistral): query `t` attends keys `s` with `t - W < s <= t`, exactly
    /// transformers' `sliding_window_overlay` (`kv_idx > q_idx - sliding_window`, in
    /// `masking_utils.py`) combined with `causal_mask_function` (`kv_idx <= q_idx`). `None` is
    /// plain causal attention.
    pub window: Option<usize>,
    /// The score scale; `None` is `D^-0.5` (Gemma scales by `query_pre_attn_scalar^-0.5`).
    pub scale: Option<f32>,
    /// Soft-cap of the scaled scores, `c * tanh(s / c)`, before the mask and softmax (Gemma 2's
    /// `attn_logit_softcapping`, as its eager attention computes it).
    pub softcap: Option<f32>,
}

impl AttentionDims {
    /// These dimensions with the scores an attention op's attributes ask for.
    pub fn scored(self, scale: Option<f64>, softcap: Option<f64>) -> Self {
        AttentionDims {
            scale: scale.map(|s| s as f32),
            softcap: softcap.map(|c| c as f32),
            ..self
        }
    }

    /// The factor `q . k` is multiplied by.
    pub fn score_scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// Soft-caps the `nq x nk` scores of a tile with row stride `K_TILE` in place.
    fn cap_tile(&self, tile: &mut [f32; Q_TILE * K_TILE], nq: usize, nk: usize) {
        if let Some(c) = self.softcap {
            for row in tile.chunks_mut(K_TILE).take(nq) {
                row[..nk].iter_mut().for_each(|x| *x = c * (*x / c).tanh());
            }
        }
    }

    /// `H * D`: the width of `q` and of the output.
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// `KV * D`: the width of `k` and `v`.
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// `(H + 2 KV) * D`: the width of a packed `[q | k | v]` row (GPT-2's `c_attn` output).
    pub fn packed_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// `B * H * T`: the length of the saved logsumexp.
    pub fn lse_len(&self) -> usize {
        self.batch * self.n_heads * self.seq
    }

    /// The first key query `t` may attend.
    fn first_key(&self, t: usize) -> usize {
        self.window.map_or(0, |w| (t + 1).saturating_sub(w))
    }

    fn check(&self) {
        assert!(
            self.n_kv_heads > 0,
            "attention: n_kv_heads must be positive"
        );
        assert_eq!(
            self.n_heads % self.n_kv_heads,
            0,
            "attention: n_kv_heads must divide n_heads"
        );
        assert!(self.head_dim > 0, "attention: head_dim must be positive");
        assert_ne!(
            self.window,
            Some(0),
            "attention: a sliding window of 0 attends nothing"
        );
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Read-only `(b, t, head)` segments of a `[B, T, stride]` tensor whose heads start at
/// column `offset`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    stride: usize,
    offset: usize,
    head_dim: usize,
    seq: usize,
}

impl<'a> Rows<'a> {
    fn new(data: &'a [f32], dims: &AttentionDims, stride: usize, offset: usize) -> Self {
        assert_eq!(
            data.len(),
            dims.rows() * stride,
            "attention: input is not [B, T, {stride}]"
        );
        Rows {
            data,
            stride,
            offset,
            head_dim: dims.head_dim,
            seq: dims.seq,
        }
    }

    fn start(self, b: usize, t: usize, head: usize) -> usize {
        (b * self.seq + t) * self.stride + self.offset + head * self.head_dim
    }

    #[inline(always)]
    fn get(self, b: usize, t: usize, head: usize) -> &'a [f32] {
        let s = self.start(b, t, head);
        &self.data[s..s + self.head_dim]
    }

    /// Rows `t0..` of `head` as a `[rows, D]` gemm operand.
    fn block(self, b: usize, t0: usize, head: usize) -> Mat<'a> {
        Mat {
            data: &self.data[self.start(b, t0, head)..],
            rs: self.stride,
            cs: 1,
        }
    }

    /// Rows `t0..` of `head`, transposed: a `[D, rows]` gemm operand.
    fn block_t(self, b: usize, t0: usize, head: usize) -> Mat<'a> {
        Mat {
            data: &self.data[self.start(b, t0, head)..],
            rs: 1,
            cs: self.stride,
        }
    }
}

/// Writable `(b, t, head)` segments of a `[B, T, stride]` tensor, shared by parallel tasks that
/// each write a disjoint set of segments.
#[derive(Clone, Copy)]
struct RowsMut<'a> {
    ptr: *mut f32,
    len: usize,
    stride: usize,
    offset: usize,
    head_dim: usize,
    seq: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a RowsMut is only a way to hand out disjoint segments of one exclusive borrow to
// several threads; `get`'s contract makes the segments in use at any time disjoint.
unsafe impl Send for RowsMut<'_> {}
unsafe impl Sync for RowsMut<'_> {}

impl<'a> RowsMut<'a> {
    fn new(data: &'a mut [f32], dims: &AttentionDims, stride: usize, offset: usize) -> Self {
        assert_eq!(
            data.len(),
            dims.rows() * stride,
            "attention: output is not [B, T, {stride}]"
        );
        RowsMut {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            stride,
            offset,
            head_dim: dims.head_dim,
            seq: dims.seq,
            _borrow: PhantomData,
        }
    }

    /// The segment of row `(b, t)` for `head`.
    ///
    /// # Safety
    /// While the returned slice is alive, no other reference to the same segment may exist: in
    /// this module each `(b, head)` (forward) or `(b, kv head)` (backward) task is the only one
    /// to touch its segments, and holds at most one reference to each at a time.
    #[inline(always)]
    unsafe fn get(self, b: usize, t: usize, head: usize) -> &'a mut [f32] {
        let s = (b * self.seq + t) * self.stride + self.offset + head * self.head_dim;
        assert!(s + self.head_dim <= self.len);
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(s), self.head_dim) }
    }

    /// `dst += lhs * rhs` into rows `t0..t0 + rows` of `head` (`[rows, D]`); `k` is the inner size.
    ///
    /// # Safety
    /// As [`RowsMut::get`], for every segment of the block: no reference to any of them may be
    /// alive during the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_product(
        self,
        b: usize,
        t0: usize,
        head: usize,
        rows: usize,
        lhs: Mat<'_>,
        rhs: Mat<'_>,
        k: usize,
    ) {
        let s = (b * self.seq + t0) * self.stride + self.offset + head * self.head_dim;
        assert!(rows > 0 && s + (rows - 1) * self.stride + self.head_dim <= self.len);
        // SAFETY: the block is in bounds (checked above); exclusivity is the caller's contract.
        unsafe {
            gemm_raw(
                self.ptr.add(s),
                self.stride,
                lhs,
                rhs,
                (rows, self.head_dim, k),
                true,
                1.0,
                SERIAL,
            )
        }
    }
}

/// `tile[.., ..nk] = scale * q_block k_block^T` for an `nq x nk` tile with row stride `K_TILE`.
fn scores(
    tile: &mut [f32; Q_TILE * K_TILE],
    q: Mat<'_>,
    k_t: Mat<'_>,
    (nq, nk, d): (usize, usize, usize),
    scale: f32,
) {
    // SAFETY: `tile` is an exclusive borrow holding nq rows of K_TILE >= nk elements.
    unsafe {
        gemm_raw(
            tile.as_mut_ptr(),
            K_TILE,
            q,
            k_t,
            (nq, nk, d),
            false,
            scale,
            SERIAL,
        )
    }
}

/// The keys `lo..hi` of block `s0..s0 + nk` that query `t` may see, relative to `s0`; empty
/// (`lo == hi`, both within the block) when it sees none of them.
fn visible(dims: &AttentionDims, t: usize, s0: usize, nk: usize) -> (usize, usize) {
    // A block wholly before `t`'s window gives `lo = nk`: the backward slices rows with it.
    let lo = (dims.first_key(t).max(s0) - s0).min(nk);
    let hi = (t + 1).min(s0 + nk).saturating_sub(s0);
    (lo, hi.max(lo))
}

/// Causal self-attention, `q` `[B, T, H*D]`, `k` and `v` `[B, T, KV*D]`, into `out`
/// `[B, T, H*D]`: `out[t] = softmax_s(q_t . k_s / sqrt(D)) v_s` over the keys `dims` allows;
/// also writes the logsumexp of every row's scaled scores to `lse` `[B, H, T]` for the
/// backward. Both outputs are overwritten.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttentionDims,
) {
    attention_forward_rounded(out, lse, q, k, v, dims, Rounding::Exact);
}

/// [`attention_forward`] with the probabilities stored as `rounding` says between the
/// softmax and their product with `v` (see the module doc).
pub fn attention_forward_rounded(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttentionDims,
    rounding: Rounding,
) {
    dims.check();
    let (qw, kw) = (dims.q_width(), dims.kv_width());
    forward_impl(
        RowsMut::new(out, &dims, qw, 0),
        lse,
        Rows::new(q, &dims, qw, 0),
        Rows::new(k, &dims, kw, 0),
        Rows::new(v, &dims, kw, 0),
        &dims,
        rounding,
    );
}

/// [`attention_forward`] with `q`, `k` and `v` packed in one `[B, T, (H + 2 KV) * D]` tensor,
/// split in q, k, v order along the last dimension (GPT-2's `c_attn` output, `split(C, dim=2)`).
pub fn attention_forward_packed(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    dims: AttentionDims,
) {
    attention_forward_packed_rounded(out, lse, qkv, dims, Rounding::Exact);
}

/// [`attention_forward_packed`] with the probabilities stored as `rounding` says.
pub fn attention_forward_packed_rounded(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    dims: AttentionDims,
    rounding: Rounding,
) {
    dims.check();
    let (qw, kw, pw) = (dims.q_width(), dims.kv_width(), dims.packed_width());
    forward_impl(
        RowsMut::new(out, &dims, qw, 0),
        lse,
        Rows::new(qkv, &dims, pw, 0),
        Rows::new(qkv, &dims, pw, qw),
        Rows::new(qkv, &dims, pw, qw + kw),
        &dims,
        rounding,
    );
}

fn forward_impl(
    out: RowsMut<'_>,
    lse: &mut [f32],
    q: Rows<'_>,
    k: Rows<'_>,
    v: Rows<'_>,
    dims: &AttentionDims,
    rounding: Rounding,
) {
    assert_eq!(lse.len(), dims.lse_len(), "attention: lse is not [B, H, T]");
    let (t_len, h_len, d) = (dims.seq, dims.n_heads, dims.head_dim);
    if t_len == 0 || h_len == 0 {
        return;
    }
    if rounding.rounds() {
        return forward_normalised(out, lse, q, k, v, dims, rounding);
    }
    let group = h_len / dims.n_kv_heads;
    let scale = dims.score_scale();
    lse.par_chunks_mut(t_len)
        .enumerate()
        .for_each(|(bh, lse_row)| {
            fast(
                #[inline(always)]
                || {
                    let (b, h) = (bh / h_len, bh % h_len);
                    let kvh = h / group;
                    let mut tile = [0.0f32; Q_TILE * K_TILE];
                    for t0 in (0..t_len).step_by(Q_TILE) {
                        let nq = (t_len - t0).min(Q_TILE);
                        let (mut m, mut l) = ([f32::NEG_INFINITY; Q_TILE], [0.0f32; Q_TILE]);
                        for t in t0..t0 + nq {
                            // SAFETY: only this (b, h) task touches out[b, :, h]; the slice is dropped
                            // at once.
                            unsafe { out.get(b, t, h) }.fill(0.0);
                        }
                        let mut s0 = dims.first_key(t0) / K_TILE * K_TILE;
                        while s0 < t0 + nq {
                            let nk = (t0 + nq - s0).min(K_TILE);
                            scores(
                                &mut tile,
                                q.block(b, t0, h),
                                k.block_t(b, s0, kvh),
                                (nq, nk, d),
                                scale,
                            );
                            dims.cap_tile(&mut tile, nq, nk);
                            for i in 0..nq {
                                let row = &mut tile[i * K_TILE..i * K_TILE + nk];
                                let (lo, hi) = visible(dims, t0 + i, s0, nk);
                                if lo == hi {
                                    row.fill(0.0);
                                    continue;
                                }
                                let m_new = m[i].max(max(&row[lo..hi]));
                                // Rescale what earlier blocks accumulated (exp(-inf) = 0 on the first).
                                let corr = exp(m[i] - m_new);
                                row[..lo].fill(0.0);
                                row[hi..].fill(0.0);
                                row[lo..hi].iter_mut().for_each(|x| *x = exp(*x - m_new));
                                l[i] = l[i] * corr + sum(&row[lo..hi]);
                                m[i] = m_new;
                                if corr != 1.0 {
                                    // SAFETY: as above.
                                    unsafe { out.get(b, t0 + i, h) }
                                        .iter_mut()
                                        .for_each(|x| *x *= corr);
                                }
                            }
                            let p = Mat {
                                data: &tile,
                                rs: K_TILE,
                                cs: 1,
                            };
                            // SAFETY: only this task writes these rows; no slice of them is alive.
                            unsafe { out.add_product(b, t0, h, nq, p, v.block(b, s0, kvh), nk) };
                            s0 += nk;
                        }
                        for i in 0..nq {
                            let inv = 1.0 / l[i];
                            // SAFETY: as above.
                            unsafe { out.get(b, t0 + i, h) }
                                .iter_mut()
                                .for_each(|x| *x *= inv);
                            lse_row[t0 + i] = m[i] + l[i].ln();
                        }
                    }
                },
            )
        });
}

/// The forward in two passes over the keys, as the CUDA backend's softmax kernel computes
/// it: each query tile's row max and sum of exponentials first (online, as
/// [`forward_impl`]), then `P = exp(s - max) / sum` rounded to the storage type, and
/// `out = P v` accumulated in f32.
fn forward_normalised(
    out: RowsMut<'_>,
    lse: &mut [f32],
    q: Rows<'_>,
    k: Rows<'_>,
    v: Rows<'_>,
    dims: &AttentionDims,
    rounding: Rounding,
) {
    let (t_len, h_len, d) = (dims.seq, dims.n_heads, dims.head_dim);
    let group = h_len / dims.n_kv_heads;
    let scale = dims.score_scale();
    lse.par_chunks_mut(t_len)
        .enumerate()
        .for_each(|(bh, lse_row)| {
            fast(
                #[inline(always)]
                || {
                    let (b, h) = (bh / h_len, bh % h_len);
                    let kvh = h / group;
                    let mut tile = [0.0f32; Q_TILE * K_TILE];
                    for t0 in (0..t_len).step_by(Q_TILE) {
                        let nq = (t_len - t0).min(Q_TILE);
                        let (mut m, mut l) = ([f32::NEG_INFINITY; Q_TILE], [0.0f32; Q_TILE]);
                        let first = dims.first_key(t0) / K_TILE * K_TILE;
                        // Pass 1: each row's max and sum of exponentials.
                        let mut s0 = first;
                        while s0 < t0 + nq {
                            let nk = (t0 + nq - s0).min(K_TILE);
                            scores(
                                &mut tile,
                                q.block(b, t0, h),
                                k.block_t(b, s0, kvh),
                                (nq, nk, d),
                                scale,
                            );
                            dims.cap_tile(&mut tile, nq, nk);
                            for i in 0..nq {
                                let row = &mut tile[i * K_TILE..i * K_TILE + nk];
                                let (lo, hi) = visible(dims, t0 + i, s0, nk);
                                if lo == hi {
                                    continue;
                                }
                                let m_new = m[i].max(max(&row[lo..hi]));
                                let corr = exp(m[i] - m_new);
                                row[lo..hi].iter_mut().for_each(|x| *x = exp(*x - m_new));
                                l[i] = l[i] * corr + sum(&row[lo..hi]);
                                m[i] = m_new;
                            }
                            s0 += nk;
                        }
                        // Pass 2: the stored probabilities, and their product with v.
                        for t in t0..t0 + nq {
                            // SAFETY: only this (b, h) task touches out[b, :, h]; the slice is
                            // dropped at once.
                            unsafe { out.get(b, t, h) }.fill(0.0);
                        }
                        let mut s0 = first;
                        while s0 < t0 + nq {
                            let nk = (t0 + nq - s0).min(K_TILE);
                            scores(
                                &mut tile,
                                q.block(b, t0, h),
                                k.block_t(b, s0, kvh),
                                (nq, nk, d),
                                scale,
                            );
                            dims.cap_tile(&mut tile, nq, nk);
                            for i in 0..nq {
                                let row = &mut tile[i * K_TILE..i * K_TILE + nk];
                                let (lo, hi) = visible(dims, t0 + i, s0, nk);
                                if lo == hi {
                                    row.fill(0.0);
                                    continue;
                                }
                                let (mi, li) = (m[i], l[i]);
                                row[lo..hi]
                                    .iter_mut()
                                    .for_each(|x| *x = rounding.round(exp(*x - mi) / li));
                                row[..lo].fill(0.0);
                                row[hi..].fill(0.0);
                            }
                            let p = Mat {
                                data: &tile,
                                rs: K_TILE,
                                cs: 1,
                            };
                            // SAFETY: only this task writes these rows; no slice of them is alive.
                            unsafe { out.add_product(b, t0, h, nq, p, v.block(b, s0, kvh), nk) };
                            s0 += nk;
                        }
                        for i in 0..nq {
                            lse_row[t0 + i] = m[i] + l[i].ln();
                        }
                    }
                },
            )
        });
}

/// Backward of [`attention_forward`]. Takes the forward's inputs, its output `out` and `lse`,
/// and `dout` `[B, T, H*D]`; overwrites `dq` `[B, T, H*D]`, `dk` and `dv` `[B, T, KV*D]`.
/// With `p = exp(q.k * scale - lse)` and `delta_t = dout_t . out_t`:
/// `dv_s = sum_t p dout_t`, `ds = p (dout_t . v_s - delta_t)`, `dq_t = scale sum_s ds k_s`,
/// `dk_s = scale sum_t ds q_t`, summed over the query heads sharing a kv head.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dims: AttentionDims,
) {
    attention_backward_rounded(dq, dk, dv, dout, q, k, v, out, lse, dims, Rounding::Exact);
}

/// [`attention_backward`] with `p`, `ds` and the per-head sums of `dk` and `dv` stored as
/// `rounding` says (see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_rounded(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dims: AttentionDims,
    rounding: Rounding,
) {
    dims.check();
    let (qw, kw) = (dims.q_width(), dims.kv_width());
    backward_impl(
        [
            RowsMut::new(dq, &dims, qw, 0),
            RowsMut::new(dk, &dims, kw, 0),
            RowsMut::new(dv, &dims, kw, 0),
        ],
        Rows::new(dout, &dims, qw, 0),
        [
            Rows::new(q, &dims, qw, 0),
            Rows::new(k, &dims, kw, 0),
            Rows::new(v, &dims, kw, 0),
        ],
        Rows::new(out, &dims, qw, 0),
        lse,
        &dims,
        rounding,
    );
}

/// Backward of [`attention_forward_packed`]: overwrites `dqkv` `[B, T, (H + 2 KV) * D]`, the
/// gradient of the packed input, laid out like it.
pub fn attention_backward_packed(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dims: AttentionDims,
) {
    attention_backward_packed_rounded(dqkv, dout, qkv, out, lse, dims, Rounding::Exact);
}

/// [`attention_backward_packed`] with the intermediates stored as `rounding` says.
pub fn attention_backward_packed_rounded(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dims: AttentionDims,
    rounding: Rounding,
) {
    dims.check();
    let (qw, kw, pw) = (dims.q_width(), dims.kv_width(), dims.packed_width());
    let dq = RowsMut::new(dqkv, &dims, pw, 0);
    // The three views split one exclusive borrow by columns: q, k and v never overlap.
    let dk = RowsMut { offset: qw, ..dq };
    let dv = RowsMut {
        offset: qw + kw,
        ..dq
    };
    backward_impl(
        [dq, dk, dv],
        Rows::new(dout, &dims, qw, 0),
        [
            Rows::new(qkv, &dims, pw, 0),
            Rows::new(qkv, &dims, pw, qw),
            Rows::new(qkv, &dims, pw, qw + kw),
        ],
        Rows::new(out, &dims, qw, 0),
        lse,
        &dims,
        rounding,
    );
}

fn backward_impl(
    [dq, dk, dv]: [RowsMut<'_>; 3],
    dout: Rows<'_>,
    [q, k, v]: [Rows<'_>; 3],
    out: Rows<'_>,
    lse: &[f32],
    dims: &AttentionDims,
    rounding: Rounding,
) {
    assert_eq!(
        lse.len(),
        dims.lse_len(),
        "attention_backward: lse is not [B, H, T]"
    );
    let (t_len, h_len, kv_len, d) = (dims.seq, dims.n_heads, dims.n_kv_heads, dims.head_dim);
    let group = h_len / kv_len;
    let scale = dims.score_scale();
    (0..dims.batch * kv_len).into_par_iter().for_each(|task| {
        fast(
            #[inline(always)]
            || {
                let (b, kvh) = (task / kv_len, task % kv_len);
                for s in 0..t_len {
                    // SAFETY: only this (b, kv head) task touches dk[b, :, kvh] and dv[b, :, kvh]; the
                    // slices are dropped at once.
                    unsafe {
                        dk.get(b, s, kvh).fill(0.0);
                        dv.get(b, s, kvh).fill(0.0);
                    }
                }
                let mut p = [0.0f32; Q_TILE * K_TILE];
                let mut ds = [0.0f32; Q_TILE * K_TILE];
                for h in kvh * group..(kvh + 1) * group {
                    let lse_h = &lse[(b * h_len + h) * t_len..(b * h_len + h + 1) * t_len];
                    for t0 in (0..t_len).step_by(Q_TILE) {
                        let nq = (t_len - t0).min(Q_TILE);
                        let mut delta = [0.0f32; Q_TILE];
                        for (i, di) in delta[..nq].iter_mut().enumerate() {
                            *di = dot(dout.get(b, t0 + i, h), out.get(b, t0 + i, h));
                            // SAFETY: query head h is in this task's group; only it touches dq[b, :, h].
                            unsafe { dq.get(b, t0 + i, h) }.fill(0.0);
                        }
                        let mut s0 = dims.first_key(t0) / K_TILE * K_TILE;
                        while s0 < t0 + nq {
                            let nk = (t0 + nq - s0).min(K_TILE);
                            scores(
                                &mut p,
                                q.block(b, t0, h),
                                k.block_t(b, s0, kvh),
                                (nq, nk, d),
                                scale,
                            );
                            // dP = dO V^T, into ds.
                            scores(
                                &mut ds,
                                dout.block(b, t0, h),
                                v.block_t(b, s0, kvh),
                                (nq, nk, d),
                                1.0,
                            );
                            for i in 0..nq {
                                let (lo, hi) = visible(dims, t0 + i, s0, nk);
                                let pr = &mut p[i * K_TILE..i * K_TILE + nk];
                                let dr = &mut ds[i * K_TILE..i * K_TILE + nk];
                                let (l, di) = (lse_h[t0 + i], delta[i]);
                                match dims.softcap {
                                    None => {
                                        for (x, y) in pr[lo..hi].iter_mut().zip(&mut dr[lo..hi]) {
                                            *x = exp(*x - l);
                                            *y = *x * (*y - di) * scale;
                                        }
                                    }
                                    // Through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2.
                                    Some(c) => {
                                        for (x, y) in pr[lo..hi].iter_mut().zip(&mut dr[lo..hi]) {
                                            let t = (*x / c).tanh();
                                            *x = exp(c * t - l);
                                            *y = *x * (*y - di) * (1.0 - t * t) * scale;
                                        }
                                    }
                                }
                                pr[..lo].fill(0.0);
                                pr[hi..].fill(0.0);
                                dr[..lo].fill(0.0);
                                dr[hi..].fill(0.0);
                                if rounding.rounds() {
                                    // Stored before their products; ds from the unrounded p.
                                    for (x, y) in pr[lo..hi].iter_mut().zip(&mut dr[lo..hi]) {
                                        *x = rounding.round(*x);
                                        *y = rounding.round(*y);
                                    }
                                }
                            }
                            let ds_m = Mat {
                                data: &ds,
                                rs: K_TILE,
                                cs: 1,
                            };
                            let ds_t = Mat {
                                data: &ds,
                                rs: 1,
                                cs: K_TILE,
                            };
                            let p_t = Mat {
                                data: &p,
                                rs: 1,
                                cs: K_TILE,
                            };
                            // SAFETY: these blocks belong to this task and no slice of them is alive.
                            unsafe {
                                dq.add_product(b, t0, h, nq, ds_m, k.block(b, s0, kvh), nk);
                                dk.add_product(b, s0, kvh, nk, ds_t, q.block(b, t0, h), nq);
                                dv.add_product(b, s0, kvh, nk, p_t, dout.block(b, t0, h), nq);
                            }
                            s0 += nk;
                        }
                    }
                    if rounding.rounds() {
                        // The running dk and dv are stored after each query head of the group.
                        for s in 0..t_len {
                            // SAFETY: as above; each slice is dropped before the next is made.
                            unsafe {
                                dk.get(b, s, kvh)
                                    .iter_mut()
                                    .for_each(|x| *x = rounding.round(*x));
                                dv.get(b, s, kvh)
                                    .iter_mut()
                                    .for_each(|x| *x = rounding.round(*x));
                            }
                        }
                    }
                }
            },
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, bits, check_grad, check_grad_directional, Rng};

    fn dims(
        batch: usize,
        seq: usize,
        h: usize,
        kv: usize,
        d: usize,
        w: Option<usize>,
    ) -> AttentionDims {
        AttentionDims {
            batch,
            seq,
            n_heads: h,
            n_kv_heads: kv,
            head_dim: d,
            window: w,
            scale: None,
            softcap: None,
        }
    }

    /// Materialised softmax(q k^T / sqrt(D) + mask) v and the row logsumexps, in f64.
    fn naive(q: &[f32], k: &[f32], v: &[f32], d: &AttentionDims) -> (Vec<f64>, Vec<f64>) {
        let (t_len, hd) = (d.seq, d.head_dim);
        let (qw, kw) = (d.q_width(), d.kv_width());
        let mut out = vec![0.0; d.rows() * qw];
        let mut lse = vec![0.0; d.lse_len()];
        for b in 0..d.batch {
            for h in 0..d.n_heads {
                let kvh = h / (d.n_heads / d.n_kv_heads);
                for t in 0..t_len {
                    let qi = (b * t_len + t) * qw + h * hd;
                    let mut scores = vec![f64::NEG_INFINITY; t_len];
                    for (s, sc) in scores.iter_mut().enumerate() {
                        let visible =
                            s <= t && d.window.is_none_or(|w| s as i64 > t as i64 - w as i64);
                        if visible {
                            let ki = (b * t_len + s) * kw + kvh * hd;
                            let qk: f64 =
                                (0..hd).map(|i| q[qi + i] as f64 * k[ki + i] as f64).sum();
                            let scaled = match d.scale {
                                Some(scale) => qk * f64::from(scale),
                                None => qk / (hd as f64).sqrt(),
                            };
                            *sc = match d.softcap.map(f64::from) {
                                Some(c) => c * (scaled / c).tanh(),
                                None => scaled,
                            };
                        }
                    }
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    lse[(b * d.n_heads + h) * t_len + t] = m + z.ln();
                    for (s, sc) in scores.iter().enumerate() {
                        let p = (sc - m).exp() / z;
                        let vi = (b * t_len + s) * kw + kvh * hd;
                        for i in 0..hd {
                            out[qi + i] += p * v[vi + i] as f64;
                        }
                    }
                }
            }
        }
        (out, lse)
    }

    fn fwd(q: &[f32], k: &[f32], v: &[f32], d: AttentionDims) -> (Vec<f32>, Vec<f32>) {
        let (mut out, mut lse) = (
            vec![f32::NAN; d.rows() * d.q_width()],
            vec![f32::NAN; d.lse_len()],
        );
        attention_forward(&mut out, &mut lse, q, k, v, d);
        (out, lse)
    }

    fn inputs(d: &AttentionDims, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        // Scaled up so the softmax is far from uniform and masking mistakes show.
        let mut big = |n| rng.vec(n).iter().map(|x| 2.0 * x).collect::<Vec<f32>>();
        (
            big(d.rows() * d.q_width()),
            big(d.rows() * d.kv_width()),
            big(d.rows() * d.kv_width()),
        )
    }

    /// Packs separate q, k, v into `[B, T, q | k | v]`.
    fn pack(q: &[f32], k: &[f32], v: &[f32], d: &AttentionDims) -> Vec<f32> {
        let (qw, kw) = (d.q_width(), d.kv_width());
        (0..d.rows())
            .flat_map(|r| {
                q[r * qw..(r + 1) * qw]
                    .iter()
                    .chain(&k[r * kw..(r + 1) * kw])
                    .chain(&v[r * kw..(r + 1) * kw])
                    .copied()
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn forward_matches_naive_masked_softmax() {
        // T = 150 spans three query tiles and key blocks, so the online rescaling is exercised.
        for d in [
            dims(2, 7, 4, 2, 4, None),
            dims(2, 7, 4, 2, 4, Some(3)),
            dims(1, 150, 2, 1, 8, None),
            dims(1, 150, 4, 2, 8, Some(70)),
            dims(1, 150, 2, 2, 8, Some(150)),
        ] {
            let (q, k, v) = inputs(&d, 60);
            let (out, lse) = fwd(&q, &k, &v, d);
            let (want_out, want_lse) = naive(&q, &k, &v, &d);
            assert_close(&format!("{d:?} out"), &out, &want_out, 2e-6);
            assert_close(&format!("{d:?} lse"), &lse, &want_lse, 2e-6);
        }
    }

    /// Gemma's scores: a scale other than `D^-0.5` and a soft-cap small enough to bend them
    /// (the inputs' scores reach several units), in both forwards and the backward. Without
    /// the cap in the backward's chain rule the gradient check fails.
    #[test]
    fn scale_and_softcap_forward_and_gradients() {
        for w in [None, Some(3)] {
            let d = AttentionDims {
                scale: Some(0.7),
                softcap: Some(1.5),
                ..dims(2, 7, 4, 2, 4, w)
            };
            let (q, k, v) = inputs(&d, 80);
            let (out, lse) = fwd(&q, &k, &v, d);
            let (want_out, want_lse) = naive(&q, &k, &v, &d);
            assert_close(&format!("{d:?} out"), &out, &want_out, 2e-6);
            assert_close(&format!("{d:?} lse"), &lse, &want_lse, 2e-6);
            // The two-pass forward (bf16 storage) computes the same scores.
            let (mut o3, mut l3) = (vec![0.0; out.len()], vec![0.0; lse.len()]);
            attention_forward_rounded(&mut o3, &mut l3, &q, &k, &v, d, Rounding::Bf16);
            assert_close("bf16 lse", &l3, &want_lse, 2e-6);
            let cot = Rng::new(81).vec(q.len());
            let [dq, dk, dv] = bwd(&q, &k, &v, &cot, d);
            check_grad("capped dq", &q, &dq, |q| fwd(q, &k, &v, d).0, &cot);
            check_grad("capped dk", &k, &dk, |k| fwd(&q, k, &v, d).0, &cot);
            check_grad("capped dv", &v, &dv, |v| fwd(&q, &k, v, d).0, &cot);
        }
    }

    #[test]
    fn window_semantics_follow_transformers() {
        let d = dims(2, 9, 2, 1, 4, Some(1));
        let (q, k, v) = inputs(&d, 61);
        // W = 1: each query sees only itself, so the output is its own value row, exactly.
        let (out, _) = fwd(&q, &k, &v, d);
        for r in 0..d.rows() {
            for h in 0..2 {
                assert_eq!(&out[r * 8 + h * 4..r * 8 + h * 4 + 4], &v[r * 4..r * 4 + 4]);
            }
        }
        // W >= T changes nothing at all; W = T - 1 drops key 0 from the last query only.
        let full = fwd(&q, &k, &v, AttentionDims { window: None, ..d });
        let wide = fwd(
            &q,
            &k,
            &v,
            AttentionDims {
                window: Some(9),
                ..d
            },
        );
        assert_eq!(
            (bits(&full.0), bits(&full.1)),
            (bits(&wide.0), bits(&wide.1))
        );
        let (narrow, _) = fwd(
            &q,
            &k,
            &v,
            AttentionDims {
                window: Some(8),
                ..d
            },
        );
        let row = |o: &Vec<f32>, t: usize| o[t * 8..(t + 1) * 8].to_vec();
        assert_eq!(row(&narrow, 7), row(&full.0, 7));
        assert_ne!(row(&narrow, 8), row(&full.0, 8));
    }

    #[test]
    fn packed_forward_equals_separate() {
        let d = dims(2, 11, 4, 4, 8, None);
        let (q, k, v) = inputs(&d, 62);
        let (out, lse) = fwd(&q, &k, &v, d);
        let qkv = pack(&q, &k, &v, &d);
        let (mut pout, mut plse) = (vec![0.0; out.len()], vec![0.0; lse.len()]);
        attention_forward_packed(&mut pout, &mut plse, &qkv, d);
        assert_eq!((bits(&out), bits(&lse)), (bits(&pout), bits(&plse)));
    }

    fn bwd(q: &[f32], k: &[f32], v: &[f32], cot: &[f32], d: AttentionDims) -> [Vec<f32>; 3] {
        let (out, lse) = fwd(q, k, v, d);
        let mut g = [
            vec![f32::NAN; q.len()],
            vec![f32::NAN; k.len()],
            vec![f32::NAN; v.len()],
        ];
        let [dq, dk, dv] = &mut g;
        attention_backward(dq, dk, dv, cot, q, k, v, &out, &lse, d);
        g
    }

    #[test]
    fn gradients_with_gqa_with_and_without_window() {
        for d in [dims(2, 6, 4, 2, 4, None), dims(2, 6, 4, 2, 4, Some(3))] {
            let (q, k, v) = inputs(&d, 63);
            let cot = Rng::new(64).vec(q.len());
            let [dq, dk, dv] = bwd(&q, &k, &v, &cot, d);
            let name = format!("{d:?}");
            check_grad(
                &format!("{name} dq"),
                &q,
                &dq,
                |q| fwd(q, &k, &v, d).0,
                &cot,
            );
            check_grad(
                &format!("{name} dk"),
                &k,
                &dk,
                |k| fwd(&q, k, &v, d).0,
                &cot,
            );
            check_grad(
                &format!("{name} dv"),
                &v,
                &dv,
                |v| fwd(&q, &k, v, d).0,
                &cot,
            );
        }
    }

    /// Windows over several key blocks; with the narrow one, a query tile's first key block
    /// lies wholly before the window of its last rows (which the backward once sliced past
    /// the block's end for).
    #[test]
    fn gradients_across_key_blocks() {
        for d in [
            dims(1, 140, 2, 1, 4, Some(100)),
            dims(1, 150, 2, 1, 4, Some(20)),
        ] {
            gradients_across_key_blocks_of(d);
        }
    }

    fn gradients_across_key_blocks_of(d: AttentionDims) {
        let (q, k, v) = inputs(&d, 65);
        let cot = Rng::new(66).vec(q.len());
        let [dq, dk, dv] = bwd(&q, &k, &v, &cot, d);
        let loss = |q: &[f32], k: &[f32], v: &[f32]| {
            crate::kernels::testutil::weighted(&fwd(q, k, v, d).0, &cot)
        };
        check_grad_directional("long dq", &q, &dq, |q| loss(q, &k, &v));
        check_grad_directional("long dk", &k, &dk, |k| loss(&q, k, &v));
        check_grad_directional("long dv", &v, &dv, |v| loss(&q, &k, v));
    }

    #[test]
    fn packed_gradient_is_the_packed_separate_gradients() {
        let d = dims(2, 6, 4, 4, 4, Some(4));
        let (q, k, v) = inputs(&d, 67);
        let cot = Rng::new(68).vec(q.len());
        let qkv = pack(&q, &k, &v, &d);
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; d.lse_len()]);
        attention_forward_packed(&mut out, &mut lse, &qkv, d);
        let mut dqkv = vec![f32::NAN; qkv.len()];
        attention_backward_packed(&mut dqkv, &cot, &qkv, &out, &lse, d);
        let [dq, dk, dv] = bwd(&q, &k, &v, &cot, d);
        assert_eq!(bits(&dqkv), bits(&pack(&dq, &dk, &dv, &d)));
        check_grad(
            "packed dqkv",
            &qkv,
            &dqkv,
            |x| {
                let (mut o, mut l) = (vec![0.0; q.len()], vec![0.0; d.lse_len()]);
                attention_forward_packed(&mut o, &mut l, x, d);
                o
            },
            &cot,
        );
    }

    /// The bf16 storage contract of the CUDA backend, in f64 from the same inputs: the
    /// forward's probabilities `exp(s - max) / sum` rounded before `P v` (when `round_p`), and
    /// in the backward `p = exp(s - lse)` and `ds = p (dp - delta) scale` rounded before their
    /// products, `dk` and `dv` rounded after each query head of a group (`per_head`; else once
    /// at the end). Returns out, dq, dk, dv, each rounded to bf16 as stored.
    #[allow(clippy::too_many_arguments)]
    fn naive_bf16(
        [q, k, v]: [&[f32]; 3],
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        d: &AttentionDims,
        round_p: bool,
        per_head: bool,
    ) -> [Vec<f32>; 4] {
        use crate::kernels::storage::round_bf16;
        let r = |x: f64| f64::from(round_bf16(x as f32));
        let (t_len, hd, group) = (d.seq, d.head_dim, d.n_heads / d.n_kv_heads);
        let (qw, kw) = (d.q_width(), d.kv_width());
        let scale = 1.0 / (hd as f64).sqrt();
        let seen =
            |t: usize, s: usize| s <= t && d.window.is_none_or(|w| s as i64 > t as i64 - w as i64);
        let dot = |a: &[f32], b: &[f32]| -> f64 {
            a.iter()
                .zip(b)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum()
        };
        // Head `h` of row `(b, t)` of a tensor of row width `w`.
        let row = |w: usize, b: usize, t: usize, h: usize| -> std::ops::Range<usize> {
            let at = (b * t_len + t) * w + h * hd;
            at..at + hd
        };
        let mut o = vec![0.0f64; out.len()];
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f64; q.len()],
            vec![0.0f64; k.len()],
            vec![0.0f64; v.len()],
        );
        for b in 0..d.batch {
            for kvh in 0..d.n_kv_heads {
                for h in kvh * group..(kvh + 1) * group {
                    let (mut gk, mut gv) = (vec![0.0f64; t_len * hd], vec![0.0f64; t_len * hd]);
                    for t in 0..t_len {
                        let qt = &q[row(qw, b, t, h)];
                        let sc: Vec<f64> = (0..t_len)
                            .map(|s| match seen(t, s) {
                                true => dot(qt, &k[row(kw, b, s, kvh)]) * scale,
                                false => f64::NEG_INFINITY,
                            })
                            .collect();
                        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                        let l = f64::from(lse[(b * d.n_heads + h) * t_len + t]);
                        let ot = row(qw, b, t, h);
                        let delta = dot(&dout[ot.clone()], &out[ot.clone()]);
                        for (s, &x) in sc.iter().enumerate().filter(|(s, _)| seen(t, *s)) {
                            let (ks, vs) = (row(kw, b, s, kvh), row(kw, b, s, kvh));
                            let pf = (x - m).exp() / z;
                            let pf = if round_p { r(pf) } else { pf };
                            let p = (x - l).exp();
                            let dp = dot(&dout[ot.clone()], &v[vs.clone()]);
                            let ds = r(p * (dp - delta) * scale);
                            let p = r(p);
                            for i in 0..hd {
                                o[ot.start + i] += pf * f64::from(v[vs.start + i]);
                                dq[row(qw, b, t, h).start + i] += ds * f64::from(k[ks.start + i]);
                                gk[s * hd + i] += ds * f64::from(qt[i]);
                                gv[s * hd + i] += p * f64::from(dout[ot.start + i]);
                            }
                        }
                    }
                    for s in 0..t_len {
                        let at = row(kw, b, s, kvh).start;
                        for i in 0..hd {
                            dk[at + i] += gk[s * hd + i];
                            dv[at + i] += gv[s * hd + i];
                            if per_head {
                                dk[at + i] = r(dk[at + i]);
                                dv[at + i] = r(dv[at + i]);
                            }
                        }
                    }
                }
            }
        }
        let stored = |x: Vec<f64>| x.into_iter().map(|x| round_bf16(x as f32)).collect();
        [stored(o), stored(dq), stored(dk), stored(dv)]
    }

    /// The fraction of elements whose bf16 values differ.
    fn mismatched(got: &[f32], want: &[f32]) -> f64 {
        use crate::kernels::storage::round_bf16;
        let n = got
            .iter()
            .zip(want)
            .filter(|(g, w)| round_bf16(**g).to_bits() != round_bf16(**w).to_bits())
            .count();
        n as f64 / got.len().max(1) as f64
    }

    /// With bf16 storage the kernels round where the CUDA backend stores bf16: the forward's
    /// normalised probabilities, the backward's `p` and `ds`, and `dk`, `dv` after each query
    /// head of a group. Against an f64 model of that contract almost every stored element is
    /// the same bf16 (a rare one differs where f32 and f64 round to different sides of a bf16
    /// halfway point); against the same model without the forward's rounding, or rounding
    /// `dk` and `dv` once at the end, many differ, so the check can fail. Measured: 0.06% of
    /// elements at most against the contract, 25% and more without one of its points.
    #[test]
    fn bf16_storage_rounds_where_the_cuda_backend_stores() {
        for d in [dims(2, 7, 4, 2, 4, None), dims(1, 150, 4, 2, 8, Some(70))] {
            let (q, k, v) = inputs(&d, 71);
            let round = |x: Vec<f32>| -> Vec<f32> {
                x.iter()
                    .map(|&x| crate::kernels::storage::round_bf16(x))
                    .collect()
            };
            let (q, k, v) = (round(q), round(k), round(v));
            let dout = round(Rng::new(72).vec(q.len()));
            let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; d.lse_len()]);
            attention_forward_rounded(&mut out, &mut lse, &q, &k, &v, d, Rounding::Bf16);
            let exact = fwd(&q, &k, &v, d);
            assert_eq!(bits(&lse), bits(&exact.1), "{d:?}: lse is the f32 kernel's");
            let out = round(out);
            let mut g = [vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]];
            {
                let [dq, dk, dv] = &mut g;
                let [q, k, v] = [&q[..], &k[..], &v[..]];
                attention_backward_rounded(
                    dq,
                    dk,
                    dv,
                    &dout,
                    q,
                    k,
                    v,
                    &out,
                    &lse,
                    d,
                    Rounding::Bf16,
                );
            }
            let model = |round_p, per_head| {
                naive_bf16([&q, &k, &v], &out, &lse, &dout, &d, round_p, per_head)
            };
            let contract = model(true, true);
            let got = [&out, &g[0], &g[1], &g[2]];
            for (name, (got, want)) in ["out", "dq", "dk", "dv"]
                .iter()
                .zip(got.iter().zip(&contract))
            {
                let wrong = mismatched(got, want);
                eprintln!(
                    "{d:?} {name}: {:.3}% of elements differ from the contract",
                    100.0 * wrong
                );
                assert!(wrong <= 2e-3, "{d:?} {name}: {:.3}% differ", 100.0 * wrong);
            }
            for v in g[1].iter().chain(&g[2]) {
                assert_eq!(
                    crate::kernels::storage::round_bf16(*v),
                    *v,
                    "dk, dv are stored"
                );
            }
            let unrounded_p = model(false, true);
            let once = model(true, false);
            let far = [
                ("out without rounding p", mismatched(&out, &unrounded_p[0])),
                ("dk rounded once", mismatched(&g[1], &once[2])),
                ("dv rounded once", mismatched(&g[2], &once[3])),
            ];
            for (what, wrong) in far {
                eprintln!("{d:?} against {what}: {:.3}% differ", 100.0 * wrong);
                assert!(
                    wrong >= 2e-2,
                    "{d:?}: {what} is indistinguishable ({wrong})"
                );
            }
        }
    }

    #[test]
    fn backward_is_bit_identical_across_runs_and_thread_counts() {
        let d = dims(2, 130, 4, 2, 16, Some(90));
        let (q, k, v) = inputs(&d, 69);
        let cot = Rng::new(70).vec(q.len());
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (out, lse) = fwd(&q, &k, &v, d);
                let g = bwd(&q, &k, &v, &cot, d);
                [out, lse, g[0].clone(), g[1].clone(), g[2].clone()].map(|x| bits(&x))
            })
        };
        let first = run(2);
        assert_eq!(first, run(2));
        assert_eq!(first, run(1));
        assert_eq!(first, run(3));
    }
}
