//! Host kernels: every forward and backward op kind and AdamW, in f32 (bf16 storage is
//! widened before and rounded after them: [`storage`]).
//!
//! One file per op family; every `*_forward` has its `*_backward` beside it (llm.c style).
//! Kernels take plain slices and explicit dimensions, allocate nothing, and panic only on
//! shape mismatches, which a verified schedule rules out; data-dependent failures (token ids
//! out of range) are errors. Backward kernels overwrite activation gradients; parameter
//! gradients take `accumulate` (tied embeddings, gradient accumulation).
//!
//! Determinism: every result is the same bits run after run for a given thread count. Row
//! kernels give each row to one task; reductions over rows run per column block in row order;
//! attention sums over keys and heads in a fixed order; matmuls are gemm's, whose reduction
//! order depends only on the shapes and the thread count. None of them uses atomics or
//! `rayon`'s `sum`/`reduce` (whose association depends on work stealing).

pub mod activation;
pub mod adamw;
pub mod add;
pub mod attention;
pub mod cast;
pub mod cross_entropy;
pub mod embedding;
pub mod linear;
mod math;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod share;
pub mod storage;

#[cfg(test)]
mod testutil;

pub use activation::{
    geglu_backward, geglu_forward, gelu_backward, gelu_forward, packed_swiglu_backward,
    packed_swiglu_forward, relu_backward, relu_forward, scale_forward, silu_backward, silu_forward,
    softcap_backward, softcap_forward, swiglu_backward, swiglu_forward,
};
pub use adamw::{
    adamw_step, adamw_step_fused, adamw_steps_beside, adamw_steps_fused, adamw_steps_in_turn, bf16,
    clip_coef, f16, grad_norm_sq, scale, skips_step, to_bf16, unscale_coef, AdamWConfig, AdamWStep,
    Grad, Low, ADAMW_BLOCK, SKIP_STEP,
};
pub use add::{
    add_assign, add_assign_bf16, add_assign_f16, add_backward, add_forward, bias_add_assign,
};
pub use attention::{
    attention_backward, attention_backward_packed, attention_backward_packed_rounded,
    attention_backward_rounded, attention_forward, attention_forward_packed,
    attention_forward_packed_rounded, attention_forward_rounded, AttentionDims,
};
pub use cast::{cast_bf16, cast_f16, CAST_BLOCK};
pub use cross_entropy::{
    cross_entropy_backward, cross_entropy_backward_pitched, cross_entropy_forward,
    cross_entropy_forward_pitched,
};
pub use embedding::{
    check_tokens, embedding_backward, embedding_forward, position_embedding_backward,
    position_embedding_forward, TokenId,
};
pub use linear::{
    linear_backward, linear_backward_pitched, linear_forward, linear_forward_pitched, WeightLayout,
};
pub use math::ISA_CAP_VAR;
pub use moe::{
    grouped_linear_backward, grouped_linear_forward, moe_aux_loss, moe_aux_loss_backward,
    moe_combine, moe_combine_backward, moe_dispatch, moe_dispatch_backward, moe_route,
    moe_route_backward,
};
pub use norm::{layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward};
pub use rope::{
    partial_rope_backward, partial_rope_forward, rope_backward, rope_forward, rope_inv_freq,
    RopeDims, RopeScaling,
};
pub use storage::{narrow, narrow_f16, widen, widen_f16, Rounding};
