//! Operations: kinds with their attributes and phases; their type rules are in `infer.rs`.

mod infer;
mod moe;
mod movement;

pub use moe::MAX_EXPERTS;

pub use movement::Movement;

use crate::error::{IrError, Result};
use crate::ids::{BlockId, ValueId};
use crate::types::{DType, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a linear layer's weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightLayout {
    /// `[out, in]`, `y = x W^T` (PyTorch `nn.Linear`).
    OutIn,
    /// `[in, out]`, `y = x W` (GPT-2's `Conv1D`).
    InOut,
}

/// How rotary position frequencies are rescaled for long contexts (transformers' `rope_scaling`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (transformers' `linear`).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// LLaMA 3's frequency-dependent scaling (transformers' `llama3`).
    Llama3 {
        /// Scale applied to low frequencies.
        factor: f64,
        /// Wavelength threshold (in units of the original context) for low frequencies.
        low_freq_factor: f64,
        /// Wavelength threshold for high frequencies.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: u64,
    },
    /// Phi-3's LongRoPE (transformers' `longrope`), for one sequence length: every inverse
    /// frequency divided by its own factor (the config's `short_factor` up to
    /// `original_max_position_embeddings`, `long_factor` beyond), and cos and sin multiplied
    /// by `attention_factor`.
    LongRope {
        /// One divisor per rotated pair (`rotary_dim / 2` of them).
        factors: Vec<f64>,
        /// The multiplier of cos and sin.
        attention_factor: f64,
    },
    /// YaRN (transformers' `yarn`): each inverse frequency blended between itself and itself
    /// divided by `factor`, by a linear ramp over the pairs between the correction dimensions
    /// of `beta_fast` and `beta_slow` rotations in `original_max_position_embeddings` tokens;
    /// cos and sin multiplied by `attention_factor`.
    Yarn {
        /// The context extension factor.
        factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: u64,
        /// Rotations that bound the extrapolated (unscaled) pairs.
        beta_fast: f64,
        /// Rotations that bound the interpolated (scaled) pairs.
        beta_slow: f64,
        /// Whether the ramp's ends are rounded out to whole pairs (floor and ceil).
        truncate: bool,
        /// The multiplier of cos and sin.
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// What cos and sin are multiplied by (transformers' `attention_scaling`): 1 but for
    /// LongRoPE.
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::LongRope {
                attention_factor, ..
            }
            | RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            RopeScaling::None | RopeScaling::Linear { .. } | RopeScaling::Llama3 { .. } => 1.0,
        }
    }

    /// The printed form (`linear(4)`, `llama3(...)`, `longrope(...)`); `None` for plain RoPE.
    pub fn describe(&self) -> Option<String> {
        match self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => Some(format!("linear({factor})")),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(format!(
                "llama3({factor},{low_freq_factor},{high_freq_factor},{original_max_position_embeddings})"
            )),
            RopeScaling::LongRope {
                factors,
                attention_factor,
            } => {
                let factors: Vec<String> = factors.iter().map(|f| format!("{f}")).collect();
                Some(format!("longrope([{}],{attention_factor})", factors.join(",")))
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => Some(format!(
                "yarn({factor},{original_max_position_embeddings},{beta_fast},{beta_slow},\
                 {truncate},{attention_factor})"
            )),
        }
    }
}

/// How the query, key and value projections reach an attention op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkvLayout {
    /// Three inputs: q `[B,T,H*D]`, k and v `[B,T,KV*D]`.
    Separate,
    /// One input `[B,T,(H+2*KV)*D]`, q then k then v along the last dimension (GPT-2's `c_attn`).
    Packed,
}

/// Rows per chunk of the two-pass column sums of bias and norm-weight gradients; see
/// [`OpKind::workspace_bytes`]. The order of every such sum, and so its bits, depends only on
/// the shape.
pub const REDUCTION_ROWS: u64 = 256;

/// Chunks (rows of partial sums) of a column sum over `rows` rows.
pub fn reduction_chunks(rows: u64) -> u64 {
    rows.div_ceil(REDUCTION_ROWS).max(1)
}

/// Partial sums (f64) of a gradient's squared norm over `n` elements: one per 4096 elements,
/// at least 1 and at most 1024, a function of `n` alone.
pub fn grad_norm_partials(n: u64) -> u64 {
    n.div_ceil(256 * 16).clamp(1, 1024)
}

/// Most projections one [`OpKind::FusedLinear`] computes.
pub const MAX_PROJECTIONS: u64 = 15;

/// What a [`OpKind::FusedLinear`] applies to its matmul results before writing its last
/// output (made by the fusion pass; the builders never use it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Epilogue {
    /// Nothing: `count >= 2` projections of one input, each its own output.
    None,
    /// GELU (tanh approximation) of the one projection; outputs `h`, `gelu(h)`.
    Gelu,
    /// ReLU of the one projection; outputs `h`, `relu(h)`.
    Relu,
    /// `silu(gate) * up` of two projections; outputs `gate`, `up`, `swiglu(gate, up)`.
    Swiglu,
    /// A residual input added to the one projection; output `r + (x W + b)`.
    Residual,
}

impl Epilogue {
    /// The printed name.
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::None => "none",
            Epilogue::Gelu => "gelu",
            Epilogue::Relu => "relu",
            Epilogue::Swiglu => "swiglu",
            Epilogue::Residual => "residual",
        }
    }

    /// How many projections the epilogue combines; `None` for any number from two.
    pub fn projections(self) -> Option<u64> {
        match self {
            Epilogue::None => None,
            Epilogue::Gelu | Epilogue::Relu | Epilogue::Residual => Some(1),
            Epilogue::Swiglu => Some(2),
        }
    }

    /// Whether the projections' results are outputs of the op (kept for the backward pass or
    /// read by later ops), before the epilogue's own output.
    pub fn keeps_projections(self) -> bool {
        !matches!(self, Epilogue::Residual)
    }

    /// Whether the epilogue writes an output of its own after the projections.
    pub fn has_output(self) -> bool {
        !matches!(self, Epilogue::None)
    }
}

/// The loss scale an fp16 run starts from: torch.cuda.amp.GradScaler's `init_scale`, 2^16.
pub const LOSS_SCALE_INIT: f64 = 65536.0;

/// Clean (overflow-free) steps after which an fp16 run doubles its loss scale:
/// GradScaler's `growth_interval`.
pub const LOSS_SCALE_GROWTH_INTERVAL: u64 = 2000;

/// What an op computes, with its attributes.
///
/// The forward kinds cover GPT-2, LLaMA, Mistral and OPT. Activations are `[B,T,C]`; token ids
/// are `i32[B,T]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Token embedding lookup: `tokens i32[B,T]`, `table [V,C]` -> `[B,T,C]`.
    Embedding {
        /// A row that receives no gradient from lookups (PyTorch's `padding_idx`; OPT's pad
        /// token).
        padding_idx: Option<u64>,
    },
    /// Learned absolute positions: `tokens i32[B,T]` (for its shape), `table [P,C]` ->
    /// `[B,T,C]`, rows `offset..offset+T` (OPT offsets by 2).
    PositionEmbedding {
        /// First row used.
        offset: u64,
    },
    /// Layer normalisation over the last dimension: `x`, `weight [C]`, `bias [C]`.
    LayerNorm {
        /// Added to the variance.
        eps: f64,
    },
    /// Root-mean-square normalisation over the last dimension: `x`, `weight [C]`; or, with
    /// `head_dim`, over each group of `head_dim` elements of the last dimension separately,
    /// with `weight [head_dim]` shared by the groups (Qwen3's and Gemma 3's `q_norm`/`k_norm`).
    RmsNorm {
        /// Added to the mean square.
        eps: f64,
        /// Width of each separately normalised group; `None` normalises the whole last
        /// dimension.
        #[serde(default)]
        head_dim: Option<u64>,
        /// Scale by `1 + weight` (computed in f32) instead of `weight` (Gemma's `RMSNorm`).
        #[serde(default)]
        unit_offset: bool,
    },
    /// `x [..,in]`, `weight`, optional `bias [out]` -> `[..,out]`.
    Linear {
        /// Whether a bias input follows the weight.
        bias: bool,
        /// How the weight is stored.
        layout: WeightLayout,
    },
    /// GELU, tanh approximation (transformers' `gelu_new`).
    Gelu,
    /// `max(x, 0)`.
    Relu,
    /// `x * sigmoid(x)`.
    Silu,
    /// `silu(gate) * up`: inputs `gate`, `up`.
    Swiglu,
    /// Elementwise sum of two tensors of one type.
    Add,
    /// Rotate-half rotary embedding of `x [B,T,heads*head_dim]`, per head.
    Rope {
        /// Width of one head.
        head_dim: u64,
        /// Base of the frequencies.
        theta: f64,
        /// Long-context rescaling.
        scaling: RopeScaling,
    },
    /// Fused causal self-attention with grouped KV heads -> output `[B,T,heads*head_dim]` and
    /// the log-sum-exp of each query row `f32[B,heads,T]`, which the backward pass reuses.
    Attention {
        /// Query heads.
        heads: u64,
        /// Key/value heads; `heads` is a multiple of it.
        kv_heads: u64,
        /// Width of one head.
        head_dim: u64,
        /// A query at `t` sees keys `s` with `t - window < s <= t` when set (Mistral).
        window: Option<u64>,
        /// How q, k and v arrive.
        qkv: QkvLayout,
        /// The score scale when it is not `head_dim^-0.5` (Gemma's `query_pre_attn_scalar^-0.5`).
        scale: Option<f64>,
        /// Scores soft-capped to `cap * tanh(s / cap)` before the mask and softmax (Gemma 2's
        /// `attn_logit_softcapping`).
        softcap: Option<f64>,
    },
    /// Mean cross-entropy: `logits [B,T,V]`, `targets i32[B,T]` -> loss `f32[]` and the
    /// log-sum-exp of each row `f32[B,T]`, which the backward pass reuses.
    CrossEntropy,
    /// `count` linear projections of one input with an epilogue, made by the fusion pass:
    /// inputs `x`, `w_1..w_count`, then `b_1..b_count` when `bias`, then the residual when the
    /// epilogue is [`Epilogue::Residual`]. Outputs: the projections `h_1..h_count` when the
    /// epilogue keeps them, then the epilogue's result when it has one. Each projection is
    /// computed exactly as [`OpKind::Linear`] computes it, and the epilogue as its own kind
    /// would, so fusing changes no bit of the result.
    FusedLinear {
        /// Projections of `x`.
        count: u64,
        /// Whether each projection has a bias.
        bias: bool,
        /// How the weights are stored.
        layout: WeightLayout,
        /// What is applied to the projections.
        epilogue: Epilogue,
    },

    // Backward kinds: one per forward kind that has a vector-Jacobian product. Each takes the
    // forward values it saved and the output gradient, and writes input gradients.
    /// `tokens`, `dy` -> `dtable [rows,C]`; tokens equal to `padding_idx` contribute nothing.
    EmbeddingBackward {
        /// Rows of the table.
        rows: u64,
        /// The forward op's padding row.
        padding_idx: Option<u64>,
    },
    /// `tokens`, `dy` -> `dtable [rows,C]`, summed over the batch.
    PositionEmbeddingBackward {
        /// Rows of the table.
        rows: u64,
        /// First row the forward op used.
        offset: u64,
    },
    /// `x`, `weight`, `dy` -> `dx`, `dweight`, `dbias`.
    LayerNormBackward {
        /// The forward op's epsilon.
        eps: f64,
    },
    /// `x`, `weight`, `dy` -> `dx`, `dweight`.
    RmsNormBackward {
        /// The forward op's epsilon.
        eps: f64,
        /// The forward op's group width.
        #[serde(default)]
        head_dim: Option<u64>,
        /// Whether the forward op scaled by `1 + weight`.
        #[serde(default)]
        unit_offset: bool,
    },
    /// `x`, `weight`, `dy` -> `dx`, `dweight`, and `dbias` when the forward op had a bias.
    LinearBackward {
        /// Whether the forward op had a bias.
        bias: bool,
        /// How the weight is stored.
        layout: WeightLayout,
    },
    /// `x`, `dy` -> `dx`.
    GeluBackward,
    /// `x`, `dy` -> `dx`.
    ReluBackward,
    /// `x`, `dy` -> `dx`.
    SiluBackward,
    /// `gate`, `up`, `dy` -> `dgate`, `dup`.
    SwigluBackward,
    /// `dy` -> `dx` (the inverse rotation).
    RopeBackward {
        /// Width of one head.
        head_dim: u64,
        /// Base of the frequencies.
        theta: f64,
        /// Long-context rescaling.
        scaling: RopeScaling,
    },
    /// The forward inputs (`q`, `k`, `v`, or packed `qkv`), `out`, `lse`, `dout` -> the
    /// gradients of the forward inputs.
    AttentionBackward {
        /// Query heads.
        heads: u64,
        /// Key/value heads.
        kv_heads: u64,
        /// Width of one head.
        head_dim: u64,
        /// The forward op's window.
        window: Option<u64>,
        /// How q, k and v arrived.
        qkv: QkvLayout,
        /// The forward op's score scale.
        scale: Option<f64>,
        /// The forward op's soft-cap.
        softcap: Option<f64>,
    },
    /// `logits`, `targets`, `lse` -> `dlogits`, for a loss gradient of 1.
    CrossEntropyBackward,
    /// The backward of [`OpKind::FusedLinear`]. Inputs: `x`, `w_1..w_count`, the kept
    /// projections when the epilogue has an output and keeps them, then the output gradients
    /// (`dh_1..dh_count` without an epilogue, else the gradient of the epilogue's output).
    /// Outputs: `dx`, `dw_1..dw_count`, then `db_1..db_count` when `bias`. A residual's
    /// gradient is the output gradient itself and is not an output. `dx` sums the projections'
    /// contributions last projection first, as separate ops would.
    FusedLinearBackward {
        /// Projections of `x`.
        count: u64,
        /// Whether each projection has a bias.
        bias: bool,
        /// How the weights are stored.
        layout: WeightLayout,
        /// The forward op's epilogue.
        epilogue: Epilogue,
    },

    // Optimizer kinds.
    /// Sum of the squares of one gradient -> `f32[]` (accumulated in f64, then rounded).
    GradNormSq,
    /// Every gradient's `grad_norm_sq` -> `f32[]` gradient scale
    /// `min(1, max_norm / (sqrt(sum) + 1e-6))`, as `torch.nn.utils.clip_grad_norm_` computes it;
    /// the partial sums are added in f64 in input order.
    ClipCoef {
        /// The largest gradient norm allowed.
        max_norm: f64,
    },
    /// One AdamW update in place, as `torch.optim.AdamW`: `param`, `grad`, `m`, `v`, and the
    /// clip coefficient when `clipped`. Writes `param`, `m` and `v`; has no outputs. The step
    /// number for bias correction comes from the runtime.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the root of the second moment.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
        /// Whether a clip coefficient input follows `v`.
        clipped: bool,
    },
    /// The issue point of a copy between memories (see [`Movement`]): each input's copy in
    /// flight, one output per input. Inserted by placement; never in a schedule's graph.
    MoveStart(Movement),
    /// The completion of the copy its inputs (a [`OpKind::MoveStart`]'s outputs) are in
    /// flight in: the copies a reader may use, one output per input.
    MoveDone(Movement),
    /// The end of a chunk's tenancy of a device slot: reads every copy the slot's gather
    /// wrote, after which no op reads them and the slot may take another chunk.
    Release {
        /// The chunk leaving the slot.
        chunk: crate::ids::ChunkId,
        /// The slot.
        slot: u32,
    },

    // Gradient accumulation (appended last, so schedules without it keep their encoding).
    /// [`OpKind::CrossEntropyBackward`] for a loss gradient of `1 / micro_batches`: with
    /// gradient accumulation the step's loss is the mean of `micro_batches` micro-batch
    /// losses, so each micro-batch's backward pass starts from that share (PyTorch's
    /// `(loss / K).backward()`).
    CrossEntropyBackwardScaled {
        /// Micro-batches per step (at least 2).
        micro_batches: u64,
    },
    /// `acc`, `grad`: `acc += grad` in place, elementwise, in `acc`'s type (each sum computed
    /// in f32 and rounded once). No outputs. A step sums its micro-batches' gradients into
    /// `acc` in micro-batch order, from zero.
    AccumulateGrad,

    // fp16 dynamic loss scaling (appended last, so schedules without it keep their encoding).
    /// [`OpKind::CrossEntropyBackward`] for a loss gradient of `loss_scale / micro_batches`:
    /// torch.cuda.amp.GradScaler's `scaler.scale(loss / K).backward()`, so that small fp16
    /// gradients do not flush to zero. `loss_scale` is the compiled initial scale; the runtime
    /// launches the op with each step's scale, as it does AdamW with each step's rate.
    CrossEntropyBackwardLossScaled {
        /// Micro-batches per step (1 without accumulation).
        micro_batches: u64,
        /// The loss scale (a power of two).
        loss_scale: f64,
    },
    /// Every (loss-scaled) gradient's `grad_norm_sq` -> `f32[]` coefficient AdamW multiplies
    /// each gradient by: GradScaler's `unscale_` then `clip_grad_norm_` in one factor,
    /// `min(1, max_norm / (norm + 1e-6)) / loss_scale` with `norm = sqrt(sum) / loss_scale`
    /// the unscaled global norm (just `1 / loss_scale` without clipping). When the sum is
    /// not finite (a gradient overflowed, or is NaN) the coefficient is NaN, and an AdamW op
    /// reading a NaN coefficient changes nothing: the step is skipped. (An ordinary
    /// [`OpKind::ClipCoef`] never yields NaN: `min(1, NaN)` is 1.)
    UnscaleCoef {
        /// The largest unscaled gradient norm allowed, when clipping.
        max_norm: Option<f64>,
        /// The loss scale the gradients carry (launched with each step's).
        loss_scale: f64,
    },

    // Gemma's elementwise kinds (appended last, so schedules without them keep their encoding).
    /// `x * factor`, elementwise, with `factor` first rounded to `x`'s dtype (Gemma's embedding
    /// scale `sqrt(hidden_size)`, which transformers makes a tensor of the activations' dtype).
    /// Linear, so its backward is the same kind applied to the output gradient.
    Scale {
        /// The multiplier.
        factor: f64,
    },
    /// `cap * tanh(x / cap)`, elementwise (Gemma 2's `final_logit_softcapping`).
    Softcap {
        /// The bound of the output's magnitude.
        cap: f64,
    },
    /// `gelu_tanh(gate) * up` (GeGLU with `gelu_pytorch_tanh`, the formula of
    /// [`OpKind::Gelu`]): inputs `gate`, `up`.
    Geglu,
    /// `y`, `dy` -> `dx = dy * (1 - (y / cap)^2)`, from the forward's output (which the loss
    /// keeps anyway), not its input.
    SoftcapBackward {
        /// The forward op's cap.
        cap: f64,
    },
    /// `gate`, `up`, `dy` -> `dgate`, `dup`.
    GegluBackward,

    // Mixture of experts (appended last, so schedules without it keep their encoding); see
    // `op/moe.rs` for how a static schedule holds data-dependent routing.
    /// Top-k routing of router logits `[B,T,E]`: the softmax in f32, the `top_k` largest
    /// probabilities (ties to the lower expert, as `torch.topk`), divided by their sum when
    /// `normalize`. Outputs: `weights f32[B,T,k]`, the chosen `experts i32[B,T,k]`, `rows
    /// i32[B*T*k]` (for each packed row, grouped by expert and by token within a group, the
    /// slot `t*k + j` it holds), `slots i32[B,T,k]` (each slot's packed row) and `offsets
    /// i32[E+1]` (where each expert's group starts; the last is `B*T*k`).
    MoeRoute {
        /// Experts of the layer.
        experts: u64,
        /// Experts each token is sent to.
        top_k: u64,
        /// Whether the chosen probabilities are divided by their sum.
        normalize: bool,
    },
    /// `x [B,T,C]`, `rows`, `slots` -> the packed `[B*T*k, C]`: row `r` is token
    /// `rows[r] / k`. `slots` is read by the backward only.
    MoeDispatch {
        /// Experts each token is sent to.
        top_k: u64,
    },
    /// The experts' matmul over a packed buffer: `xs [R,in]`, `offsets i32[E+1]`, then the
    /// `experts` weights `[out,in]` -> `[R,out]`, rows `offsets[e]..offsets[e+1]` times
    /// expert `e`'s weight transposed, each row as [`OpKind::Linear`] computes it.
    GroupedLinear {
        /// Experts (weights).
        experts: u64,
    },
    /// `ys [B*T*k, C]`, `weights`, `slots` -> `[B,T,C]`: each token's expert outputs times
    /// their weights, summed in slot order.
    MoeCombine {
        /// Experts each token is sent to.
        top_k: u64,
    },
    /// `logits`, the chosen `experts`, `dweights` -> `dlogits`: the gradient through the
    /// chosen (renormalised) probabilities and the softmax; the choice is not differentiated.
    MoeRouteBackward {
        /// Experts of the layer.
        experts: u64,
        /// Experts each token is sent to.
        top_k: u64,
        /// Whether the forward op renormalised.
        normalize: bool,
    },
    /// `slots`, `dxs [B*T*k, C]` -> `dx [B,T,C]`: each token's packed-row gradients summed in
    /// slot order.
    MoeDispatchBackward {
        /// Experts each token is sent to.
        top_k: u64,
    },
    /// `xs`, `offsets`, the weights, `dys` -> `dxs` and each expert's weight gradient (zero for
    /// an expert no token chose).
    GroupedLinearBackward {
        /// Experts (weights).
        experts: u64,
    },
    /// `ys`, `weights`, `slots`, `dout` -> `dys`, `dweights`.
    MoeCombineBackward {
        /// Experts each token is sent to.
        top_k: u64,
    },
    // Phi-3's kinds (appended last, so schedules without them keep their encoding).
    /// Rotary embedding of part of `x [B,T,N*head_dim]`: in each of the first `heads` heads
    /// the first `rotary_dim` elements are rotated (rotate-half within them, as
    /// [`OpKind::Rope`] rotates a whole head); every other element is copied. Rotates q and k
    /// inside Phi-3's packed `qkv_proj` output (v's heads copied), and the rotary part of a
    /// head under `partial_rotary_factor`.
    PartialRope {
        /// Width of one head.
        head_dim: u64,
        /// Rotated width of each rotated head (even, at most `head_dim`).
        rotary_dim: u64,
        /// Rotated heads, counted from the first.
        heads: u64,
        /// Base of the frequencies.
        theta: f64,
        /// Long-context rescaling.
        scaling: RopeScaling,
    },
    /// `dy` -> `dx` (the inverse rotation of the rotated part, the rest copied).
    PartialRopeBackward {
        /// Width of one head.
        head_dim: u64,
        /// Rotated width of each rotated head.
        rotary_dim: u64,
        /// Rotated heads, counted from the first.
        heads: u64,
        /// Base of the frequencies.
        theta: f64,
        /// Long-context rescaling.
        scaling: RopeScaling,
    },
    /// `x [..,2I]` -> `silu(gate) * up` `[..,I]` with `gate` the first half of the last
    /// dimension and `up` the second (Phi-3's `gate_up_proj` output, `chunk(2, dim=-1)`).
    PackedSwiglu,
    /// `x`, `dy` -> `dx [..,2I]`: `dgate` in the first half, `dup` in the second.
    PackedSwigluBackward,

    // The load-balancing loss (appended last, so schedules without it keep their encoding).
    /// The cross-entropy `loss f32[]`, then the router logits `[B,T,E]` of each of `layers`
    /// sparse layers -> `loss + coef * aux f32[]`, with `aux` transformers'
    /// `load_balancing_loss_func`: over all `R = layers * B * T` rows, `E * sum_e (c_e / R)
    /// (p_e / R)` where `c_e` counts the rows whose top-k (of the softmax in f32, chosen as
    /// [`OpKind::MoeRoute`] chooses) holds expert `e` and `p_e` sums expert `e`'s
    /// probability. Sums run in f64: row `g` of all layers' rows (in layer, then row order)
    /// adds to partial sum `g mod 256`, and the 256 partials are added in order, so that one
    /// thread per partial computes the same bits.
    MoeAuxLoss {
        /// Experts of each sparse layer.
        experts: u64,
        /// Experts each token is sent to.
        top_k: u64,
        /// Sparse layers (logits inputs).
        layers: u64,
        /// The weight of the auxiliary loss (`router_aux_loss_coef`).
        coef: f64,
    },
    /// Each layer's router logits -> their gradients from [`OpKind::MoeAuxLoss`]'s auxiliary
    /// term (the counts are not differentiated), for a loss gradient of
    /// `loss_scale / micro_batches` as [`OpKind::CrossEntropyBackwardLossScaled`] seeds it
    /// (`1 / micro_batches` without loss scaling). The cross-entropy input's gradient is the
    /// cross-entropy backward's own seed.
    MoeAuxLossBackward {
        /// Experts of each sparse layer.
        experts: u64,
        /// Experts each token is sent to.
        top_k: u64,
        /// Sparse layers (logits inputs).
        layers: u64,
        /// The weight of the auxiliary loss.
        coef: f64,
        /// Micro-batches per step (1 without accumulation).
        micro_batches: u64,
        /// The loss scale (fp16 training), launched with each step's as the cross-entropy
        /// backward's is.
        loss_scale: Option<f64>,
    },
}

impl OpKind {
    /// Whether this is the one coefficient every AdamW of a step reads: the gradient clip's
    /// ([`OpKind::ClipCoef`]) or the loss-scale unscaling's ([`OpKind::UnscaleCoef`]).
    pub fn is_grad_coef(&self) -> bool {
        matches!(self, OpKind::ClipCoef { .. } | OpKind::UnscaleCoef { .. })
    }

    /// The operands whose rows this kind's kernels read or write at a row pitch
    /// ([`RowPitch`](crate::RowPitch)) on every backend: (input positions, output positions).
    /// A plain linear writes its output at a pitch (the GEMM's `ldc`) and its backward reads
    /// `dy` at one (`lda`/`ldb`); cross-entropy reads its logits at one, and its backward
    /// reads the logits and writes their gradient at one. Every other operand, and every
    /// operand of other kinds, is dense.
    pub fn pitched_operands(&self) -> (&'static [usize], &'static [usize]) {
        match self {
            OpKind::Linear { .. } => (&[], &[0]),
            OpKind::LinearBackward { .. } => (&[2], &[]),
            OpKind::CrossEntropy => (&[0], &[]),
            OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. } => (&[0], &[0]),
            _ => (&[], &[]),
        }
    }

    /// The printed mnemonic.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            OpKind::Embedding { .. } => "embedding",
            OpKind::PositionEmbedding { .. } => "position_embedding",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::RmsNorm { .. } => "rms_norm",
            OpKind::Linear { .. } => "linear",
            OpKind::Gelu => "gelu",
            OpKind::Relu => "relu",
            OpKind::Silu => "silu",
            OpKind::Swiglu => "swiglu",
            OpKind::Add => "add",
            OpKind::Rope { .. } => "rope",
            OpKind::Attention { .. } => "attention",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::FusedLinear { .. } => "fused_linear",
            OpKind::EmbeddingBackward { .. } => "embedding_backward",
            OpKind::PositionEmbeddingBackward { .. } => "position_embedding_backward",
            OpKind::LayerNormBackward { .. } => "layer_norm_backward",
            OpKind::RmsNormBackward { .. } => "rms_norm_backward",
            OpKind::LinearBackward { .. } => "linear_backward",
            OpKind::GeluBackward => "gelu_backward",
            OpKind::ReluBackward => "relu_backward",
            OpKind::SiluBackward => "silu_backward",
            OpKind::SwigluBackward => "swiglu_backward",
            OpKind::RopeBackward { .. } => "rope_backward",
            OpKind::AttentionBackward { .. } => "attention_backward",
            OpKind::CrossEntropyBackward => "cross_entropy_backward",
            OpKind::FusedLinearBackward { .. } => "fused_linear_backward",
            OpKind::GradNormSq => "grad_norm_sq",
            OpKind::ClipCoef { .. } => "clip_coef",
            OpKind::AdamW { .. } => "adamw",
            OpKind::MoveStart(m) => m.mnemonics().0,
            OpKind::MoveDone(m) => m.mnemonics().1,
            OpKind::Release { .. } => "release",
            OpKind::CrossEntropyBackwardScaled { .. } => "cross_entropy_backward",
            OpKind::AccumulateGrad => "accumulate_grad",
            OpKind::CrossEntropyBackwardLossScaled { .. } => "cross_entropy_backward",
            OpKind::UnscaleCoef { .. } => "unscale_coef",
            OpKind::Scale { .. } => "scale",
            OpKind::Softcap { .. } => "softcap",
            OpKind::Geglu => "geglu",
            OpKind::SoftcapBackward { .. } => "softcap_backward",
            OpKind::GegluBackward => "geglu_backward",
            OpKind::MoeRoute { .. } => "moe_route",
            OpKind::MoeDispatch { .. } => "moe_dispatch",
            OpKind::GroupedLinear { .. } => "grouped_linear",
            OpKind::MoeCombine { .. } => "moe_combine",
            OpKind::MoeRouteBackward { .. } => "moe_route_backward",
            OpKind::MoeDispatchBackward { .. } => "moe_dispatch_backward",
            OpKind::GroupedLinearBackward { .. } => "grouped_linear_backward",
            OpKind::MoeCombineBackward { .. } => "moe_combine_backward",
            OpKind::PartialRope { .. } => "partial_rope",
            OpKind::PartialRopeBackward { .. } => "partial_rope_backward",
            OpKind::PackedSwiglu => "packed_swiglu",
            OpKind::PackedSwigluBackward => "packed_swiglu_backward",
            OpKind::MoeAuxLoss { .. } => "moe_aux_loss",
            OpKind::MoeAuxLossBackward { .. } => "moe_aux_loss_backward",
        }
    }

    /// Attributes as `key=value` pairs, in a fixed order, for the printer.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut attrs = match self.forward_of() {
            Some(forward) => forward.forward_attributes(),
            None => self.forward_attributes(),
        };
        match self {
            OpKind::EmbeddingBackward { rows, .. }
            | OpKind::PositionEmbeddingBackward { rows, .. } => {
                attrs.insert(0, ("rows", rows.to_string()));
            }
            OpKind::LinearBackward { bias: false, .. } => attrs.push(("bias", "false".into())),
            OpKind::FusedLinearBackward { bias: true, .. } => attrs.push(("bias", "true".into())),
            OpKind::ClipCoef { max_norm } => attrs.push(("max_norm", format!("{max_norm}"))),
            OpKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                clipped,
            } => {
                attrs.extend([
                    ("lr", format!("{lr}")),
                    ("betas", format!("({beta1},{beta2})")),
                    ("eps", format!("{eps:e}")),
                    ("weight_decay", format!("{weight_decay}")),
                ]);
                if *clipped {
                    attrs.push(("clipped", "true".into()));
                }
            }
            OpKind::MoveStart(m) | OpKind::MoveDone(m) => attrs.extend(m.attributes()),
            OpKind::Release { chunk, slot } => {
                attrs.extend([("chunk", chunk.0.to_string()), ("slot", slot.to_string())])
            }
            OpKind::CrossEntropyBackwardScaled { micro_batches } => {
                attrs.push(("micro_batches", micro_batches.to_string()))
            }
            OpKind::CrossEntropyBackwardLossScaled {
                micro_batches,
                loss_scale,
            } => {
                if *micro_batches > 1 {
                    attrs.push(("micro_batches", micro_batches.to_string()));
                }
                attrs.push(("loss_scale", format!("{loss_scale}")));
            }
            OpKind::MoeAuxLossBackward {
                micro_batches,
                loss_scale,
                ..
            } => {
                if *micro_batches > 1 {
                    attrs.push(("micro_batches", micro_batches.to_string()));
                }
                if let Some(loss_scale) = loss_scale {
                    attrs.push(("loss_scale", format!("{loss_scale}")));
                }
            }
            OpKind::UnscaleCoef {
                max_norm,
                loss_scale,
            } => {
                if let Some(max_norm) = max_norm {
                    attrs.push(("max_norm", format!("{max_norm}")));
                }
                attrs.push(("loss_scale", format!("{loss_scale}")));
            }
            _ => {}
        }
        attrs
    }

    /// For a backward kind, the forward kind it differentiates.
    pub fn forward_of(&self) -> Option<OpKind> {
        Some(match self.clone() {
            OpKind::EmbeddingBackward { padding_idx, .. } => OpKind::Embedding { padding_idx },
            OpKind::PositionEmbeddingBackward { offset, .. } => {
                OpKind::PositionEmbedding { offset }
            }
            OpKind::LayerNormBackward { eps } => OpKind::LayerNorm { eps },
            OpKind::RmsNormBackward {
                eps,
                head_dim,
                unit_offset,
            } => OpKind::RmsNorm {
                eps,
                head_dim,
                unit_offset,
            },
            OpKind::LinearBackward { bias, layout } => OpKind::Linear { bias, layout },
            OpKind::GeluBackward => OpKind::Gelu,
            OpKind::ReluBackward => OpKind::Relu,
            OpKind::SiluBackward => OpKind::Silu,
            OpKind::SwigluBackward => OpKind::Swiglu,
            OpKind::RopeBackward {
                head_dim,
                theta,
                scaling,
            } => OpKind::Rope {
                head_dim,
                theta,
                scaling,
            },
            OpKind::AttentionBackward {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale,
                softcap,
            } => OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale,
                softcap,
            },
            OpKind::SoftcapBackward { cap } => OpKind::Softcap { cap },
            OpKind::GegluBackward => OpKind::Geglu,
            OpKind::MoeRouteBackward {
                experts,
                top_k,
                normalize,
            } => OpKind::MoeRoute {
                experts,
                top_k,
                normalize,
            },
            OpKind::MoeDispatchBackward { top_k } => OpKind::MoeDispatch { top_k },
            OpKind::GroupedLinearBackward { experts } => OpKind::GroupedLinear { experts },
            OpKind::MoeCombineBackward { top_k } => OpKind::MoeCombine { top_k },
            OpKind::MoeAuxLossBackward {
                experts,
                top_k,
                layers,
                coef,
                ..
            } => OpKind::MoeAuxLoss {
                experts,
                top_k,
                layers,
                coef,
            },
            OpKind::PartialRopeBackward {
                head_dim,
                rotary_dim,
                heads,
                theta,
                scaling,
            } => OpKind::PartialRope {
                head_dim,
                rotary_dim,
                heads,
                theta,
                scaling,
            },
            OpKind::PackedSwigluBackward => OpKind::PackedSwiglu,
            OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. } => OpKind::CrossEntropy,
            OpKind::FusedLinearBackward {
                count,
                bias,
                layout,
                epilogue,
            } => OpKind::FusedLinear {
                count,
                bias,
                layout,
                epilogue,
            },
            _ => return None,
        })
    }

    /// Bytes of scratch memory a kernel of this kind needs, beyond its inputs and outputs. The
    /// memory planner gives every kernel exactly this much and kernels allocate nothing, so
    /// the planned peak is every backend's peak. Each kind's layout, in order:
    ///
    /// - norms: the per-row statistics (f32; layer norm's mean then reciprocal deviation), then
    ///   for the backward the column-sum partials of the weight (and bias) gradient;
    /// - a linear backward with a bias: the column-sum partials of the bias gradient;
    /// - a fused linear backward: the gradients of the kept projections, then one input
    ///   gradient's worth for the contributions after the first (both in the activations'
    ///   dtype, as the unfused ops would hold them as values), then bias partials;
    /// - attention: one batch of f32 score matrices `[heads, T, T]` (the CUDA backend's GEMM
    ///   path; [`attention_head_batch`](crate::workspace::attention_head_batch) KV heads, at
    ///   most [`ATTENTION_SCORE_BYTES`](crate::workspace::ATTENTION_SCORE_BYTES) unless one
    ///   head needs more); attention backward: each query row's `sum(dout * out)` (f32
    ///   `[B, H, T]`), then the scores and the probability gradients, each as the forward's;
    ///   no scores where the CUDA backend runs flash attention
    ///   ([`attention_runs_flash`](crate::workspace::attention_runs_flash): bf16 and f16 with a
    ///   head dimension of 64, 128 or 256), which keeps nothing of size `[T, T]`;
    /// - cross-entropy: each row's loss (f32); token embedding backward: the first and last
    ///   position of each token id in the sorted order (i32 `[V, 2]`); a gradient's squared
    ///   norm: [`grad_norm_partials`] f64 partial sums; the load-balancing loss backward:
    ///   each expert's coefficient (f32 `[E]`).
    ///
    /// Column sums run in two deterministic passes over chunks of [`REDUCTION_ROWS`] rows
    /// ([`reduction_chunks`] f32 rows per summed parameter). Every part starts at a multiple
    /// of [`WORKSPACE_ALIGN`](crate::workspace::WORKSPACE_ALIGN) bytes; where each lies is
    /// [`WorkspaceLayout`](crate::workspace::WorkspaceLayout), which the host and CUDA kernels
    /// read their sub-buffers from. The host kernels use some of the parts (the statistics,
    /// the fused gradients); the CUDA kernels use all of them.
    pub fn workspace_bytes(&self, inputs: &[&TensorType]) -> u64 {
        crate::workspace::WorkspaceLayout::of(self, inputs).bytes()
    }

    /// [`OpKind::workspace_bytes`] on a GPU with (`flash`) or without the flash attention
    /// kernels ([`WorkspaceLayout::for_device`](crate::workspace::WorkspaceLayout::for_device)):
    /// without them attention runs as GEMMs and needs its score parts. The compiler plans
    /// this for the target's GPU; a larger workspace than [`OpKind::workspace_bytes`] is
    /// always valid.
    pub fn workspace_bytes_for(&self, inputs: &[&TensorType], flash: bool) -> u64 {
        crate::workspace::WorkspaceLayout::for_device(self, inputs, flash).bytes()
    }

    /// Whether ops of this kind update some of their inputs in place (the optimizer).
    pub fn writes_inputs(&self) -> &'static [usize] {
        match self {
            OpKind::AdamW { .. } => &[0, 2, 3],
            OpKind::AccumulateGrad => &[0],
            _ => &[],
        }
    }

    /// Labels of the outputs, in order; the graph names extra outputs after them.
    pub fn output_labels(&self) -> &'static [&'static str] {
        match self {
            OpKind::Attention { .. } => &["out", "lse"],
            OpKind::CrossEntropy => &["loss", "lse"],
            OpKind::LayerNormBackward { .. } => &["dx", "dweight", "dbias"],
            OpKind::RmsNormBackward { .. } => &["dx", "dweight"],
            OpKind::LinearBackward { bias: true, .. } => &["dx", "dweight", "dbias"],
            OpKind::LinearBackward { bias: false, .. } => &["dx", "dweight"],
            OpKind::SwigluBackward | OpKind::GegluBackward => &["dgate", "dup"],
            OpKind::MoeRoute { .. } => moe::ROUTE_LABELS,
            OpKind::MoeRouteBackward { .. } => &["dlogits"],
            OpKind::MoeAuxLoss { .. } => &["loss"],
            OpKind::MoeCombineBackward { .. } => &["dys", "dweights"],
            // The weight gradients are named with `Graph::add_op_multi`.
            OpKind::GroupedLinearBackward { .. } => &["dxs"],
            OpKind::AttentionBackward {
                qkv: QkvLayout::Separate,
                ..
            } => &["dq", "dk", "dv"],
            OpKind::AttentionBackward {
                qkv: QkvLayout::Packed,
                ..
            } => &["dqkv"],
            OpKind::AdamW { .. } | OpKind::AccumulateGrad => &[],
            OpKind::FusedLinear {
                count, epilogue, ..
            } => match epilogue {
                Epilogue::None => {
                    const H: &[&str] = &["h1", "h2", "h3", "h4", "h5", "h6", "h7", "h8"];
                    &H[..(*count as usize).min(H.len())]
                }
                Epilogue::Gelu | Epilogue::Relu => &["h", "out"],
                Epilogue::Swiglu => &["gate", "up", "out"],
                Epilogue::Residual => &["out"],
            },
            OpKind::FusedLinearBackward { count, bias, .. } => match (count, bias) {
                (1, false) => &["dx", "dweight"],
                (1, true) => &["dx", "dweight", "dbias"],
                (2, false) => &["dx", "dweight1", "dweight2"],
                (2, true) => &["dx", "dweight1", "dweight2", "dbias1", "dbias2"],
                (3, false) => &["dx", "dweight1", "dweight2", "dweight3"],
                (3, true) => &[
                    "dx", "dweight1", "dweight2", "dweight3", "dbias1", "dbias2", "dbias3",
                ],
                // Larger groups name their outputs with `Graph::add_op_multi`.
                _ => &["dx"],
            },
            _ => &["out"],
        }
    }
    fn forward_attributes(&self) -> Vec<(&'static str, String)> {
        match self {
            OpKind::Embedding {
                padding_idx: Some(pad),
            } => vec![("padding_idx", pad.to_string())],
            OpKind::PositionEmbedding { offset } if *offset != 0 => {
                vec![("offset", offset.to_string())]
            }
            OpKind::LayerNorm { eps } => vec![("eps", format!("{eps:e}"))],
            OpKind::RmsNorm {
                eps,
                head_dim,
                unit_offset,
            } => {
                let mut attrs = vec![("eps", format!("{eps:e}"))];
                if let Some(d) = head_dim {
                    attrs.push(("head_dim", d.to_string()));
                }
                if *unit_offset {
                    attrs.push(("unit_offset", "true".into()));
                }
                attrs
            }
            OpKind::Linear { layout, .. } => match layout {
                WeightLayout::OutIn => vec![],
                WeightLayout::InOut => vec![("weight", "in_out".into())],
            },
            OpKind::FusedLinear {
                count,
                layout,
                epilogue,
                ..
            } => {
                let mut attrs = vec![("count", count.to_string())];
                if *epilogue != Epilogue::None {
                    attrs.push(("epilogue", epilogue.name().into()));
                }
                if *layout == WeightLayout::InOut {
                    attrs.push(("weight", "in_out".into()));
                }
                attrs
            }
            OpKind::Rope {
                head_dim,
                theta,
                scaling,
            } => {
                let mut attrs = vec![
                    ("head_dim", head_dim.to_string()),
                    ("theta", format!("{theta}")),
                ];
                if let Some(scaling) = scaling.describe() {
                    attrs.push(("scaling", scaling));
                }
                attrs
            }
            OpKind::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                qkv,
                scale,
                softcap,
            } => {
                let mut attrs = vec![
                    ("heads", heads.to_string()),
                    ("kv_heads", kv_heads.to_string()),
                    ("head_dim", head_dim.to_string()),
                ];
                if let Some(w) = window {
                    attrs.push(("window", w.to_string()));
                }
                if let Some(s) = scale {
                    attrs.push(("scale", format!("{s}")));
                }
                if let Some(c) = softcap {
                    attrs.push(("softcap", format!("{c}")));
                }
                if *qkv == QkvLayout::Packed {
                    attrs.push(("qkv", "packed".into()));
                }
                attrs
            }
            OpKind::Scale { factor } => vec![("factor", format!("{factor}"))],
            OpKind::Softcap { cap } => vec![("cap", format!("{cap}"))],
            kind if kind.is_moe() => kind.moe_attributes(),
            OpKind::PartialRope {
                head_dim,
                rotary_dim,
                heads,
                theta,
                scaling,
            } => {
                let mut attrs = vec![
                    ("head_dim", head_dim.to_string()),
                    ("rotary_dim", rotary_dim.to_string()),
                    ("heads", heads.to_string()),
                    ("theta", format!("{theta}")),
                ];
                if let Some(scaling) = scaling.describe() {
                    attrs.push(("scaling", scaling));
                }
                attrs
            }
            _ => vec![],
        }
    }

    /// How many inputs the kind takes; `None` for any number (at least one).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            OpKind::Embedding { .. } | OpKind::PositionEmbedding { .. } => 2,
            OpKind::LayerNorm { .. } => 3,
            OpKind::RmsNorm { .. } => 2,
            OpKind::Linear { bias, .. } => 2 + usize::from(*bias),
            OpKind::Gelu
            | OpKind::Relu
            | OpKind::Silu
            | OpKind::Rope { .. }
            | OpKind::PartialRope { .. }
            | OpKind::PartialRopeBackward { .. }
            | OpKind::PackedSwiglu
            | OpKind::Scale { .. }
            | OpKind::Softcap { .. } => 1,
            OpKind::PackedSwigluBackward => 2,
            OpKind::Swiglu | OpKind::Geglu | OpKind::Add | OpKind::CrossEntropy => 2,
            OpKind::SoftcapBackward { .. } => 2,
            OpKind::GegluBackward => 3,
            OpKind::Attention { qkv, .. } => match qkv {
                QkvLayout::Separate => 3,
                QkvLayout::Packed => 1,
            },
            OpKind::EmbeddingBackward { .. } | OpKind::PositionEmbeddingBackward { .. } => 2,
            OpKind::LayerNormBackward { .. } | OpKind::RmsNormBackward { .. } => 3,
            OpKind::LinearBackward { .. } => 3,
            OpKind::GeluBackward | OpKind::ReluBackward | OpKind::SiluBackward => 2,
            OpKind::SwigluBackward => 3,
            OpKind::RopeBackward { .. } => 1,
            OpKind::AttentionBackward { qkv, .. } => match qkv {
                QkvLayout::Separate => 6,
                QkvLayout::Packed => 4,
            },
            OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. } => 3,
            OpKind::AccumulateGrad => 2,
            OpKind::MoveStart(m) | OpKind::MoveDone(m) => return m.arity(),
            OpKind::Release { .. } => return None,
            OpKind::FusedLinear {
                count,
                bias,
                epilogue,
                ..
            } => {
                let n = *count as usize;
                1 + n * (1 + usize::from(*bias)) + usize::from(*epilogue == Epilogue::Residual)
            }
            OpKind::FusedLinearBackward {
                count, epilogue, ..
            } => {
                let n = *count as usize;
                let kept = if epilogue.has_output() && epilogue.keeps_projections() {
                    n
                } else {
                    0
                };
                let grads = if epilogue.has_output() { 1 } else { n };
                1 + n + kept + grads
            }
            OpKind::GradNormSq => 1,
            OpKind::ClipCoef { .. } | OpKind::UnscaleCoef { .. } => return None,
            OpKind::AdamW { clipped, .. } => 4 + usize::from(*clipped),
            OpKind::MoeRoute { .. }
            | OpKind::MoeDispatch { .. }
            | OpKind::GroupedLinear { .. }
            | OpKind::MoeCombine { .. }
            | OpKind::MoeRouteBackward { .. }
            | OpKind::MoeDispatchBackward { .. }
            | OpKind::GroupedLinearBackward { .. }
            | OpKind::MoeCombineBackward { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::MoeAuxLossBackward { .. } => self.moe_arity(),
        })
    }

    /// Floating-point operations one execution performs, counting a multiply-add as two.
    ///
    /// Matmuls and attention dominate; elementwise kinds count a few per element. Used by the
    /// cost model and the CLI's TFLOP/s figures.
    pub fn flops(&self, inputs: &[&TensorType], outputs: &[&TensorType]) -> u64 {
        let out: u64 = outputs.iter().map(|t| t.numel()).sum();
        let attention_pairs = |t: u64, window: &Option<u64>| match window {
            Some(w) if *w < t => (0..t).map(|q| (q + 1).min(*w)).sum::<u64>(),
            _ => t * (t + 1) / 2,
        };
        match self {
            OpKind::Linear { .. } => 2 * inputs[0].numel() * outputs[0].last_dim(),
            // dx = dy W and dW = x^T dy: twice the forward.
            OpKind::LinearBackward { .. } => 4 * inputs[0].numel() * inputs[2].last_dim(),
            OpKind::Attention {
                heads,
                head_dim,
                window,
                ..
            } => {
                let (b, t) = (outputs[0].shape[0], outputs[0].shape[1]);
                // QK^T and PV over the unmasked (query, key) pairs.
                4 * b * heads * head_dim * attention_pairs(t, window)
            }
            OpKind::AttentionBackward {
                heads,
                head_dim,
                window,
                ..
            } => {
                let (b, t) = (inputs[0].shape[0], inputs[0].shape[1]);
                // QK^T recomputed, then dV, dP, dQ and dK: five matmuls.
                10 * b * heads * head_dim * attention_pairs(t, window)
            }
            OpKind::LayerNorm { .. } => 8 * out,
            // `1 + weight` costs one more per element.
            OpKind::RmsNorm { unit_offset, .. } => (8 + u64::from(*unit_offset)) * out,
            OpKind::LayerNormBackward { .. } => 12 * inputs[0].numel(),
            OpKind::RmsNormBackward { unit_offset, .. } => {
                (12 + u64::from(*unit_offset)) * inputs[0].numel()
            }
            OpKind::CrossEntropy
            | OpKind::CrossEntropyBackward
            | OpKind::CrossEntropyBackwardScaled { .. }
            | OpKind::CrossEntropyBackwardLossScaled { .. } => 4 * inputs[0].numel(),
            OpKind::AccumulateGrad => inputs[0].numel(),
            OpKind::Gelu => 10 * out,
            OpKind::GeluBackward => 16 * out,
            OpKind::Geglu => 11 * out,
            OpKind::GegluBackward => 9 * out,
            OpKind::Softcap { .. } => 6 * out,
            OpKind::SoftcapBackward { .. } => 4 * out,
            OpKind::Scale { .. } => out,
            OpKind::Silu
            | OpKind::Swiglu
            | OpKind::PackedSwiglu
            | OpKind::Rope { .. }
            | OpKind::RopeBackward { .. }
            | OpKind::PartialRope { .. }
            | OpKind::PartialRopeBackward { .. } => 5 * out,
            OpKind::SiluBackward | OpKind::SwigluBackward => 8 * out,
            // Per element of `dx`: both halves' derivatives come from one `dy`.
            OpKind::PackedSwigluBackward => 4 * out,
            OpKind::Relu | OpKind::Add | OpKind::ReluBackward => out,
            OpKind::FusedLinear {
                count, epilogue, ..
            } => {
                let n = *count as usize;
                let rows = inputs[0].rows();
                let d_in = inputs[0].last_dim();
                let widths: u64 = match epilogue {
                    Epilogue::Residual => outputs[0].last_dim(),
                    _ => outputs.iter().take(n).map(|t| t.last_dim()).sum(),
                };
                let last = outputs.last().map_or(0, |t| t.numel());
                let epilogue_flops = match epilogue {
                    Epilogue::None => 0,
                    Epilogue::Gelu => 10 * last,
                    Epilogue::Relu | Epilogue::Residual => last,
                    Epilogue::Swiglu => 5 * last,
                };
                2 * rows * d_in * widths + epilogue_flops
            }
            OpKind::FusedLinearBackward {
                count, epilogue, ..
            } => {
                let n = *count as usize;
                let x = inputs[0].numel();
                let dy = inputs.last().map_or(0, |t| t.numel());
                let widths: u64 = match epilogue {
                    Epilogue::None => inputs.iter().skip(1 + n).map(|t| t.last_dim()).sum(),
                    Epilogue::Residual => inputs[2].last_dim(),
                    Epilogue::Gelu | Epilogue::Relu | Epilogue::Swiglu => inputs
                        .iter()
                        .skip(1 + n)
                        .take(n)
                        .map(|t| t.last_dim())
                        .sum(),
                };
                let epilogue_flops = match epilogue {
                    Epilogue::None | Epilogue::Residual => 0,
                    Epilogue::Gelu => 16 * dy,
                    Epilogue::Relu => dy,
                    Epilogue::Swiglu => 8 * dy,
                };
                4 * inputs[0].rows() * inputs[0].last_dim() * widths
                    + epilogue_flops
                    + (*count).saturating_sub(1) * x
            }
            OpKind::GradNormSq => 2 * inputs[0].numel(),
            OpKind::AdamW { .. } => 12 * inputs[0].numel(),
            OpKind::MoveStart(_) | OpKind::MoveDone(_) | OpKind::Release { .. } => 0,
            OpKind::Embedding { .. }
            | OpKind::PositionEmbedding { .. }
            | OpKind::EmbeddingBackward { .. }
            | OpKind::PositionEmbeddingBackward { .. }
            | OpKind::ClipCoef { .. }
            | OpKind::UnscaleCoef { .. } => out,
            OpKind::MoeRoute { .. }
            | OpKind::MoeDispatch { .. }
            | OpKind::GroupedLinear { .. }
            | OpKind::MoeCombine { .. }
            | OpKind::MoeRouteBackward { .. }
            | OpKind::MoeDispatchBackward { .. }
            | OpKind::GroupedLinearBackward { .. }
            | OpKind::MoeCombineBackward { .. }
            | OpKind::MoeAuxLoss { .. }
            | OpKind::MoeAuxLossBackward { .. } => self.moe_flops(inputs, outputs),
        }
    }
}

/// Which part of a training step an op belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
    /// Forward ops cloned into the backward pass to recompute a checkpointed block.
    Recompute,
    /// Parameter updates.
    Optimizer,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Optimizer => "optimizer",
        })
    }
}

/// One operation: its kind, the values it reads and writes, its block and phase.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// What it computes.
    pub kind: OpKind,
    /// Values read, in the order the kind defines.
    pub inputs: Vec<ValueId>,
    /// Values written.
    pub outputs: Vec<ValueId>,
    /// The block it belongs to.
    pub block: BlockId,
    /// The part of the step it runs in.
    pub phase: Phase,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rms(head_dim: Option<u64>, unit_offset: bool) -> OpKind {
        OpKind::RmsNorm {
            eps: 1e-6,
            head_dim,
            unit_offset,
        }
    }

    #[test]
    fn rms_norm_per_head_takes_a_head_wide_weight_and_prints_its_attributes() {
        let x = TensorType::new([2, 3, 24], DType::F32);
        let (head, whole) = (
            TensorType::new([8], DType::F32),
            TensorType::new([24], DType::F32),
        );
        assert!(rms(Some(8), true).infer(&[&x, &head]).is_ok());
        assert!(rms(None, false).infer(&[&x, &whole]).is_ok());
        assert!(rms(Some(8), false).infer(&[&x, &whole]).is_err());
        let err = rms(Some(5), false).infer(&[&x, &head]).unwrap_err();
        assert!(err.to_string().contains("head_dim 5"), "{err}");
        assert_eq!(
            rms(Some(8), true).attributes(),
            [
                ("eps", "1e-6".to_string()),
                ("head_dim", "8".into()),
                ("unit_offset", "true".into())
            ]
        );
        assert_eq!(rms(None, false).attributes(), [("eps", "1e-6".to_string())]);
        // The backward kind carries both and differentiates the same forward.
        let backward = OpKind::RmsNormBackward {
            eps: 1e-6,
            head_dim: Some(8),
            unit_offset: true,
        };
        assert_eq!(backward.forward_of(), Some(rms(Some(8), true)));
        assert_eq!(backward.infer(&[&x, &head, &x]).unwrap().len(), 2);
        // Older files, without the new fields, read as whole-row norms scaled by the weight.
        let old: OpKind = serde_json::from_str(r#"{"rms_norm":{"eps":1e-6}}"#).unwrap();
        assert_eq!(old, rms(None, false));
    }
}
