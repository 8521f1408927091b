//! Where each piece of a kernel's scratch lies in the workspace the memory plan gives its op.
//!
//! One layout for every consumer: [`OpKind::workspace_bytes`] (what the planner reserves and
//! the verifier checks) is its size, the host kernels (`runtime/src/dispatch.rs`) and the CUDA
//! launch plan (`runtime/src/cuda/launch.rs`) take their sub-buffers from it. Every part starts
//! at a multiple of [`WORKSPACE_ALIGN`] bytes from the workspace's start, so an f32 or f64
//! part after a bf16 one is aligned whatever the shapes (the planner places the workspace
//! itself at an aligned offset). It says where scratch lies, not what a kernel computes there.

use crate::op::{grad_norm_partials, reduction_chunks, OpKind, QkvLayout};
use crate::types::{DType, TensorType};

/// Every part of a workspace starts at a multiple of this many bytes: enough for f64 partials
/// and for the 16-byte vector loads a kernel may use.
pub const WORKSPACE_ALIGN: u64 = 16;

/// Most bytes of one f32 score matrix batch `[heads, T, T]` of attention on the CUDA backend,
/// which runs its products as strided-batched GEMMs over a batch of KV heads at a time: the
/// batch is as many heads as fit in this (at least one), so the workspace stays bounded
/// whatever the model (FlashAttention's memory behaviour, by head batches rather than tiles).
pub const ATTENTION_SCORE_BYTES: u64 = 64 << 20;

/// KV heads per GEMM batch of attention over sequences of `t` with `kv_heads` KV heads: as
/// many as keep `[heads, t, t]` f32 scores within [`ATTENTION_SCORE_BYTES`], at least 1.
pub fn attention_head_batch(kv_heads: u64, t: u64) -> u64 {
    let per_head = 4 * t * t;
    (ATTENTION_SCORE_BYTES / per_head.max(1)).clamp(1, kv_heads.max(1))
}

/// Head dimensions the CUDA backend's flash attention kernels are built for.
pub const FLASH_ATTENTION_HEAD_DIMS: [u64; 3] = [64, 128, 256];

/// Whether the CUDA backend runs attention over activations of `dtype` with heads of
/// `head_dim` as flash attention on tensor cores (bf16 or f16, a head dimension of
/// [`FLASH_ATTENTION_HEAD_DIMS`]; GPUs of compute capability 8.0 and newer), which needs no
/// score workspace, rather than as GEMMs over [`Scratch::Scores`].
pub fn attention_runs_flash(dtype: DType, head_dim: u64) -> bool {
    matches!(dtype, DType::BF16 | DType::F16) && FLASH_ATTENTION_HEAD_DIMS.contains(&head_dim)
}

/// One part of a workspace: `bytes` bytes at `offset` from the workspace's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Bytes from the workspace's start; a multiple of [`WORKSPACE_ALIGN`].
    pub offset: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

impl Region {
    /// The first byte after the part.
    pub fn end(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// What a part of a workspace holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scratch {
    /// A norm's per-row mean (f32 `[rows]`; layer norm only).
    Mean,
    /// A norm's per-row reciprocal deviation (f32 `[rows]`).
    Rstd,
    /// Column-sum partials of a norm's weight gradient (f32 `[chunks, C]`).
    WeightPartials,
    /// Column-sum partials of a bias gradient (f32 `[chunks, cols]`; a fused linear's are
    /// reused by each projection in turn, so they are as wide as the widest).
    BiasPartials,
    /// A fused linear backward's gradient of kept projection `i` (the activations' dtype).
    ProjectionGrad(u32),
    /// A fused linear backward's input-gradient contribution of the projections after the
    /// last one issued (one `dx`'s worth, in x's dtype).
    Contribution,
    /// Cross-entropy's per-row losses (f32 `[B*T]`).
    RowLoss,
    /// Attention backward's `sum(dout * out)` per query row (f32 `[B, H, T]`).
    Delta,
    /// Attention's scores of one batch of heads (f32 `[heads, T, T]`, [`attention_head_batch`]
    /// heads), overwritten in place by the probabilities in the activations' dtype.
    Scores,
    /// Attention backward's probability gradients of one batch of heads (f32
    /// `[heads, T, T]`), overwritten in place by the score gradients in the activations' dtype.
    ScoreGrads,
    /// The token embedding backward's first and last position of each token id (i32 `[V, 2]`).
    TokenSpan,
    /// A gradient's squared-norm partial sums (f64, [`grad_norm_partials`] of them).
    NormPartials,
    /// The load-balancing loss gradient's per-expert coefficient (f32 `[E]`): the CUDA
    /// backend's first backward kernel writes it from the counts, the second reads it for
    /// every row.
    AuxGrads,
}

/// The oldest compute capability the flash attention kernels run on: their `mma.sync`
/// m16n8k16 products with bf16 operands need sm_80 (Ampere); built for an older GPU they trap,
/// so the CUDA backend runs attention as GEMMs there ([`WorkspaceLayout::for_device`]).
pub const FLASH_MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Whether a GPU of compute capability `cc` runs the flash attention kernels
/// ([`FLASH_MIN_COMPUTE_CAPABILITY`] and newer).
pub fn flash_attention_supported(cc: (i32, i32)) -> bool {
    cc >= FLASH_MIN_COMPUTE_CAPABILITY
}

/// Bytes of one batch of f32 attention scores for `q` `[B, T, *]`: [`attention_head_batch`]
/// matrices of `[T, T]`; none when the attention runs as flash attention
/// ([`attention_runs_flash`] on a GPU that has it, `flash`).
fn attention_scores(
    kv_heads: u64,
    head_dim: u64,
    q: Option<&TensorType>,
    flash: bool,
) -> Option<u64> {
    let q = q?;
    if flash && attention_runs_flash(q.dtype, head_dim) {
        return None;
    }
    let t = q.shape.get(1).copied().unwrap_or(0);
    Some(4 * attention_head_batch(kv_heads, t) * t * t)
}

/// The parts of one op's workspace, in address order. See the module doc.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceLayout {
    parts: Vec<(Scratch, Region)>,
}

/// `v` rounded up to a multiple of [`WORKSPACE_ALIGN`].
fn align_up(v: u64) -> u64 {
    v.div_ceil(WORKSPACE_ALIGN) * WORKSPACE_ALIGN
}

impl WorkspaceLayout {
    /// Appends a part of `bytes` bytes at the next aligned offset.
    fn push(&mut self, what: Scratch, bytes: u64) {
        let offset = align_up(self.bytes());
        self.parts.push((what, Region { offset, bytes }));
    }

    /// The layout of an op of `kind` with inputs of types `inputs`, as
    /// [`OpKind::workspace_bytes`] documents it per kind. Kinds that need no scratch have no
    /// parts.
    pub fn of(kind: &OpKind, inputs: &[&TensorType]) -> Self {
        Self::for_device(kind, inputs, true)
    }

    /// [`WorkspaceLayout::of`] on a GPU with (`flash`) or without the flash attention
    /// kernels ([`flash_attention_supported`]): without them, attention that would run as
    /// flash attention runs as GEMMs and has score parts. The compiler plans the layout of the
    /// target's GPU (the profile's compute capability); the CUDA backend asks the layout of
    /// the GPU it runs on and refuses a workspace too small for it (a schedule planned for
    /// flash attention, run on an older GPU).
    pub fn for_device(kind: &OpKind, inputs: &[&TensorType], flash: bool) -> Self {
        let partials = |rows: u64, cols: u64| 4 * reduction_chunks(rows) * cols;
        let x = |i: usize| inputs.get(i).copied();
        let rows = x(0).map_or(0, TensorType::rows);
        let cols = x(0).map_or(0, TensorType::last_dim);
        let mut l = WorkspaceLayout::default();
        match kind {
            OpKind::LayerNorm { .. } => {
                l.push(Scratch::Mean, 4 * rows);
                l.push(Scratch::Rstd, 4 * rows);
            }
            OpKind::RmsNorm { head_dim, .. } => {
                l.push(Scratch::Rstd, 4 * norm_rows(rows, cols, *head_dim))
            }
            OpKind::LayerNormBackward { .. } => {
                l.push(Scratch::Mean, 4 * rows);
                l.push(Scratch::Rstd, 4 * rows);
                l.push(Scratch::WeightPartials, partials(rows, cols));
                l.push(Scratch::BiasPartials, partials(rows, cols));
            }
            OpKind::RmsNormBackward { head_dim, .. } => {
                let groups = norm_rows(rows, cols, *head_dim);
                l.push(Scratch::Rstd, 4 * groups);
                l.push(
                    Scratch::WeightPartials,
                    partials(groups, head_dim.unwrap_or(cols)),
                );
            }
            OpKind::LinearBackward { bias: true, .. } => {
                l.push(
                    Scratch::BiasPartials,
                    partials(rows, x(2).map_or(0, TensorType::last_dim)),
                );
            }
            OpKind::FusedLinearBackward {
                count,
                bias,
                epilogue,
                ..
            } => {
                let n = *count as usize;
                if epilogue.has_output() && epilogue.keeps_projections() {
                    for (i, t) in inputs.iter().skip(1 + n).take(n).enumerate() {
                        l.push(Scratch::ProjectionGrad(i as u32), t.bytes());
                    }
                }
                if *count >= 2 {
                    l.push(Scratch::Contribution, x(0).map_or(0, TensorType::bytes));
                }
                if *bias {
                    let widest = inputs
                        .iter()
                        .skip(1)
                        .take(n)
                        .map(|w| w.numel() / cols.max(1))
                        .max()
                        .unwrap_or(0);
                    l.push(Scratch::BiasPartials, partials(rows, widest));
                }
            }
            OpKind::CrossEntropy => l.push(Scratch::RowLoss, 4 * rows),
            OpKind::Attention {
                kv_heads, head_dim, ..
            } => {
                if let Some(bytes) = attention_scores(*kv_heads, *head_dim, x(0), flash) {
                    l.push(Scratch::Scores, bytes);
                }
            }
            // The log-sum-exp input has the delta's shape `[B, H, T]`. The host kernels use
            // the delta only; the score parts are the CUDA backend's (see `Scratch::Scores`).
            OpKind::AttentionBackward {
                qkv,
                kv_heads,
                head_dim,
                ..
            } => {
                let lse = match qkv {
                    QkvLayout::Separate => x(4),
                    QkvLayout::Packed => x(2),
                };
                l.push(Scratch::Delta, lse.map_or(0, |t| 4 * t.numel()));
                if let Some(scores) = attention_scores(*kv_heads, *head_dim, x(0), flash) {
                    l.push(Scratch::Scores, scores);
                    l.push(Scratch::ScoreGrads, scores);
                }
            }
            OpKind::EmbeddingBackward { rows: vocab, .. } => l.push(Scratch::TokenSpan, 8 * vocab),
            OpKind::GradNormSq => l.push(
                Scratch::NormPartials,
                8 * grad_norm_partials(x(0).map_or(0, TensorType::numel)),
            ),
            OpKind::MoeAuxLossBackward { experts, .. } => l.push(Scratch::AuxGrads, 4 * experts),
            OpKind::LinearBackward { bias: false, .. }
            | OpKind::Embedding { .. }
            | OpKind::PositionEmbedding { .. }
            | OpKind::Linear { .. }
            | OpKind::Gelu
            | OpKind::Relu
            | OpKind::Silu
            | OpKind::Swiglu
            | OpKind::Add
            | OpKind::Rope { .. }
            | OpKind::FusedLinear { .. }
            | OpKind::PositionEmbeddingBackward { .. }
            | OpKind::GeluBackward
            | OpKind::ReluBackward
            | OpKind::SiluBackward
            | OpKind::SwigluBackward
            | OpKind::Scale { .. }
            | OpKind::Softcap { .. }
            | OpKind::Geglu
            | OpKind::SoftcapBackward { .. }
            | OpKind::GegluBackward
            | OpKind::MoeRoute { .. }
            | OpKind::MoeDispatch { .. }
            | OpKind::GroupedLinear { .. }
            | OpKind::MoeCombine { .. }
            | OpKind::MoeRouteBackward { .. }
            | OpKind::MoeDispatchBackward { .. }
            | OpKind::GroupedLinearBackward { .. }
            | OpKind::MoeCombineBackward { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::RopeBackward { .. }
            | OpKind::PartialRope { .. }
            | OpKind::PartialRopeBackward { .. }
            | OpKind::PackedSwiglu
            | OpKind::PackedSwigluBackward
            | OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. }
            | OpKind::AccumulateGrad
            | OpKind::ClipCoef { .. }
            | OpKind::UnscaleCoef { .. }
            | OpKind::AdamW { .. }
            | OpKind::MoveStart(_)
            | OpKind::MoveDone(_)
            | OpKind::Release { .. } => {}
        }
        l
    }

    /// Bytes the workspace needs: the end of its last part (0 without parts).
    pub fn bytes(&self) -> u64 {
        self.parts.last().map_or(0, |(_, r)| r.end())
    }

    /// Where `what` lies, if the layout has it.
    pub fn get(&self, what: Scratch) -> Option<Region> {
        self.parts.iter().find(|(s, _)| *s == what).map(|(_, r)| *r)
    }

    /// Every part, in address order.
    pub fn parts(&self) -> &[(Scratch, Region)] {
        &self.parts
    }
}

/// The rows an RMS norm normalises: the rows of its input, or with `head_dim` every group of
/// `head_dim` elements of each row (a zero `head_dim`, which the type rules refuse, counts
/// whole rows).
pub fn norm_rows(rows: u64, cols: u64, head_dim: Option<u64>) -> u64 {
    match head_dim {
        Some(d) if d > 0 => rows * (cols / d),
        _ => rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Epilogue, WeightLayout};
    use crate::types::DType;

    fn t(shape: &[u64], dtype: DType) -> TensorType {
        TensorType::new(shape.to_vec(), dtype)
    }

    /// Parts are aligned, in address order, and overlap nothing.
    fn check_well_formed(l: &WorkspaceLayout) {
        let mut end = 0;
        for (what, r) in l.parts() {
            assert_eq!(r.offset % WORKSPACE_ALIGN, 0, "{what:?} at {}", r.offset);
            assert!(r.offset >= end, "{what:?} overlaps the part before");
            end = r.end();
        }
        assert_eq!(l.bytes(), end);
    }

    #[test]
    fn fused_linear_backward_in_bf16_with_odd_rows_aligns_its_f32_partials() {
        // 3 rows (B=1, T=3), d_in 5, two projections of 7 (a SwiGLU MLP's gate and up) with
        // biases: the kept gradients take 2 * 3 * 14 = 84 bytes and the contribution
        // 2 * 3 * 5 = 30, so packed end to end the f32 bias partials would start at byte 114,
        // which no f32 load may read from.
        let (x, w) = (t(&[1, 3, 5], DType::BF16), t(&[7, 5], DType::BF16));
        let h = t(&[1, 3, 7], DType::BF16);
        let kind = OpKind::FusedLinearBackward {
            count: 2,
            bias: true,
            layout: WeightLayout::OutIn,
            epilogue: Epilogue::Swiglu,
        };
        let inputs = [&x, &w, &w, &h, &h, &h];
        let l = WorkspaceLayout::of(&kind, &inputs);
        check_well_formed(&l);
        let at = |s| l.get(s).expect("present").offset;
        assert_eq!(at(Scratch::ProjectionGrad(0)), 0);
        assert_eq!(at(Scratch::ProjectionGrad(1)), 48);
        assert_eq!(at(Scratch::Contribution), 48 + 48);
        assert_eq!(at(Scratch::BiasPartials), 96 + 32);
        assert_eq!(l.get(Scratch::BiasPartials).unwrap().bytes, 4 * 7);
        assert_eq!(kind.workspace_bytes(&inputs), 128 + 28);
    }

    #[test]
    fn norm_statistics_with_odd_rows_are_aligned() {
        let (x, w) = (t(&[1, 3, 8], DType::BF16), t(&[8], DType::BF16));
        let kind = OpKind::LayerNormBackward { eps: 1e-5 };
        let l = WorkspaceLayout::of(&kind, &[&x, &w, &x]);
        check_well_formed(&l);
        let parts: Vec<Scratch> = l.parts().iter().map(|(s, _)| *s).collect();
        assert_eq!(
            parts,
            [
                Scratch::Mean,
                Scratch::Rstd,
                Scratch::WeightPartials,
                Scratch::BiasPartials
            ]
        );
        assert_eq!(l.get(Scratch::Rstd).unwrap().offset, 16);
        assert_eq!(l.get(Scratch::WeightPartials).unwrap().offset, 32);
    }

    #[test]
    fn kinds_without_scratch_have_no_parts_and_no_bytes() {
        let x = t(&[2, 4], DType::F32);
        for kind in [
            OpKind::Gelu,
            OpKind::Add,
            OpKind::LinearBackward {
                bias: false,
                layout: WeightLayout::OutIn,
            },
        ] {
            let l = WorkspaceLayout::of(&kind, &[&x, &x, &x]);
            assert!(l.parts().is_empty(), "{kind:?}");
            assert_eq!(kind.workspace_bytes(&[&x, &x, &x]), 0);
        }
    }

    #[test]
    fn flash_attention_plans_no_scores() {
        // bf16 and f16 with a flash head dimension: the backward's delta only, nothing in the
        // forward; f32, or another head dimension, keeps the GEMM path's score batches.
        let lse = t(&[2, 4, 100], DType::F32);
        for (dtype, head_dim, flash) in [
            (DType::BF16, 64, true),
            (DType::F16, 128, true),
            (DType::BF16, 256, true),
            (DType::F32, 64, false),
            (DType::BF16, 80, false),
        ] {
            let q = t(&[2, 100, 4 * head_dim], dtype);
            let kv = t(&[2, 100, 2 * head_dim], dtype);
            let (heads, kv_heads, window, qkv) = (4, 2, None, QkvLayout::Separate);
            let fwd = OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale: None,
                softcap: None,
            };
            let bwd = OpKind::AttentionBackward {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale: None,
                softcap: None,
            };
            assert_eq!(attention_runs_flash(dtype, head_dim), flash);
            let f = WorkspaceLayout::of(&fwd, &[&q, &kv, &kv]);
            let b = WorkspaceLayout::of(&bwd, &[&q, &kv, &kv, &q, &lse, &q]);
            // Without the flash kernels (before sm_80) every attention has the GEMM path's
            // scores, whatever its dtype and head dimension.
            let old_f = WorkspaceLayout::for_device(&fwd, &[&q, &kv, &kv], false);
            let old_b = WorkspaceLayout::for_device(&bwd, &[&q, &kv, &kv, &q, &lse, &q], false);
            assert!(old_f.get(Scratch::Scores).is_some(), "{dtype:?} {head_dim}");
            assert!(
                old_b.get(Scratch::ScoreGrads).is_some(),
                "{dtype:?} {head_dim}"
            );
            assert_eq!(WorkspaceLayout::for_device(&fwd, &[&q, &kv, &kv], true), f);
            assert!(flash_attention_supported((8, 0)) && flash_attention_supported((9, 0)));
            assert!(!flash_attention_supported((7, 5)) && !flash_attention_supported((7, 0)));
            assert_eq!(
                f.get(Scratch::Scores).is_none(),
                flash,
                "{dtype:?} {head_dim}"
            );
            assert_eq!(
                b.get(Scratch::ScoreGrads).is_none(),
                flash,
                "{dtype:?} {head_dim}"
            );
            assert_eq!(
                b.get(Scratch::Delta).map(|r| r.bytes),
                Some(4 * 2 * 4 * 100)
            );
            let scores = 4 * 2 * 100 * 100;
            assert_eq!(
                fwd.workspace_bytes(&[&q, &kv, &kv]),
                if flash { 0 } else { scores }
            );
        }
    }

    #[test]
    fn attention_scores_follow_the_delta_and_stay_within_the_cap() {
        // GQA, bf16, odd T: the delta [1, 4, 5] f32 is 80 bytes; the scores of both KV heads
        // (2 * 5 * 5 f32 = 200 bytes) follow it aligned, the gradients after them.
        let (q, kv) = (t(&[1, 5, 12], DType::BF16), t(&[1, 5, 6], DType::BF16));
        let lse = t(&[1, 4, 5], DType::F32);
        let attn = |backward: bool| {
            let (heads, kv_heads, head_dim, window, qkv) = (4, 2, 3, None, QkvLayout::Separate);
            if backward {
                OpKind::AttentionBackward {
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                    qkv,
                    scale: None,
                    softcap: None,
                }
            } else {
                OpKind::Attention {
                    heads,
                    kv_heads,
                    head_dim,
                    window,
                    qkv,
                    scale: None,
                    softcap: None,
                }
            }
        };
        let l = WorkspaceLayout::of(&attn(true), &[&q, &kv, &kv, &q, &lse, &q]);
        check_well_formed(&l);
        assert_eq!(
            l.get(Scratch::Delta),
            Some(Region {
                offset: 0,
                bytes: 80
            })
        );
        assert_eq!(
            l.get(Scratch::Scores),
            Some(Region {
                offset: 80,
                bytes: 200
            })
        );
        assert_eq!(
            l.get(Scratch::ScoreGrads),
            Some(Region {
                offset: 288,
                bytes: 200
            })
        );
        let f = WorkspaceLayout::of(&attn(false), &[&q, &kv, &kv]);
        assert_eq!(
            f.parts(),
            &[(
                Scratch::Scores,
                Region {
                    offset: 0,
                    bytes: 200
                }
            )]
        );
        // A batch never exceeds the cap unless one head does; there is always one head.
        assert_eq!(attention_head_batch(32, 1024), 16);
        assert_eq!(attention_head_batch(8, 8192), 1);
        assert_eq!(attention_head_batch(3, 1), 3);
        assert_eq!(attention_head_batch(0, 0), 1);
    }

    #[test]
    fn aligned_shapes_keep_their_packed_sizes() {
        // Rows a multiple of 4: no padding, so such schedules keep their planned sizes.
        let (x, w) = (t(&[2, 8, 64], DType::F32), t(&[64], DType::F32));
        let l = WorkspaceLayout::of(&OpKind::LayerNormBackward { eps: 1e-5 }, &[&x, &w, &x]);
        assert_eq!(l.bytes(), 8 * 16 + 2 * 4 * 64);
    }
}
