//! LLaMA and the families built like it (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Olmo2ForCausalLM`): RMSNorm, q/k/v projections with
//! rotate-half RoPE on q and k, grouped KV heads, a SwiGLU MLP; Mistral's and Qwen's sliding
//! windows, Qwen2's q/k/v biases, Qwen3's per-head and OLMo 2's whole-projection q/k norms, and
//! OLMo 2's norms after (not before) attention and MLP.

use super::moe::{self, Experts};
use super::{Blocks, Builder, Linear, Norm};
use crate::config::{LlamaLayout, ModelConfig, MoeLayout, QkNorm};
use crate::error::Result;
use protrain_ir::{BlockId, OpKind, QkvLayout, ValueId, WeightLayout};

/// One `model.layers.{i}` block's parameters.
struct Layer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's and OLMo 2's `self_attn.q_norm` and `self_attn.k_norm`.
    qk_norm: Option<(Norm, Norm)>,
    mlp: Mlp,
    /// The norm before attention (`input_layernorm`), or OLMo 2's after it
    /// (`post_attention_layernorm`).
    attention_norm: Norm,
    /// The norm before the MLP (`post_attention_layernorm`), or OLMo 2's after it
    /// (`post_feedforward_layernorm`).
    mlp_norm: Norm,
}

/// A layer's MLP: dense SwiGLU, or (Mixtral, Qwen3-MoE) a mixture of SwiGLU experts.
enum Mlp {
    Dense {
        gate_proj: Linear,
        up_proj: Linear,
        down_proj: Linear,
    },
    Sparse(Experts),
}

/// Declares the parameters of a LLaMA-like model and emits its forward ops; with `moe`, the
/// layers it marks sparse have mixtures of experts as MLPs.
pub(super) fn build(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &LlamaLayout,
    moe: Option<&MoeLayout>,
) -> Result<()> {
    let c = config.hidden_size;
    let (tokens, targets) = b.inputs();
    if let Some(m) = moe {
        moe::start_aux_loss(b, m);
    }
    let blocks = b.blocks(
        "model.embed_tokens",
        "model.layers",
        config.num_layers,
        "lm_head",
    );

    // Parameters, in `named_parameters()` order: a layer's attention and MLP before its norms.
    let embed = b.embed_tokens(config, &blocks);
    let layers: Vec<Layer> = blocks
        .layers
        .iter()
        .enumerate()
        .map(|(i, &block)| layer_params(b, config, layout, moe, i, block))
        .collect();
    let norm = b.norm_params("model.norm", c, false, blocks.head);
    let lm_head = b.lm_head(config, embed, &blocks);

    // Forward.
    b.enter(blocks.embedding);
    let mut x = b.op(
        OpKind::Embedding {
            padding_idx: config.padding_idx,
        },
        &[tokens, embed.value],
        "embed_tokens".into(),
    )?;
    let eps = config.norm_eps;
    for (i, layer) in layers.iter().enumerate() {
        x = decoder_layer(b, config, layout, &blocks, i, layer, x)?;
    }
    b.enter(blocks.head);
    let x = b.norm(x, &norm, eps, "norm".into())?;
    b.logits_and_loss(x, lm_head, targets)
}

/// Declares `model.layers.{i}`'s parameters, in `named_parameters()` order.
fn layer_params(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &LlamaLayout,
    moe: Option<&MoeLayout>,
    i: usize,
    block: BlockId,
) -> Layer {
    let c = config.hidden_size;
    let q_width = config.num_heads * config.head_dim;
    let kv_width = config.num_kv_heads * config.head_dim;
    let inner = config.intermediate_size;
    let p = format!("model.layers.{i}");
    let linear = WeightLayout::OutIn;
    let (qkv_bias, o_bias) = (
        layout.attention_bias || layout.qkv_bias,
        layout.attention_bias,
    );
    let mlp_bias = layout.mlp_bias;
    let mut proj = |name: &str, input: u64, output: u64, bias: bool| {
        b.linear_params(&format!("{p}.{name}"), input, output, bias, linear, block)
    };
    let q_proj = proj("self_attn.q_proj", c, q_width, qkv_bias);
    let k_proj = proj("self_attn.k_proj", c, kv_width, qkv_bias);
    let v_proj = proj("self_attn.v_proj", c, kv_width, qkv_bias);
    let o_proj = proj("self_attn.o_proj", q_width, c, o_bias);
    let qk_width = match layout.qk_norm {
        QkNorm::None => None,
        QkNorm::PerHead => Some((config.head_dim, config.head_dim)),
        QkNorm::Whole => Some((q_width, kv_width)),
    };
    let qk_norm = qk_width.map(|(q, k)| {
        (
            b.norm_params(&format!("{p}.self_attn.q_norm"), q, false, block),
            b.norm_params(&format!("{p}.self_attn.k_norm"), k, false, block),
        )
    });
    let mut proj = |name: &str, input: u64, output: u64| {
        b.linear_params(
            &format!("{p}.{name}"),
            input,
            output,
            mlp_bias,
            linear,
            block,
        )
    };
    let mlp = match moe.filter(|m| m.is_sparse(i)) {
        Some(m) => {
            // Mixtral's Hub checkpoints call the sparse block `block_sparse_moe` and its
            // experts' projections w1 (gate), w2 (down) and w3 (up).
            let names = match config.model_type() {
                "mixtral" => moe::Names::MIXTRAL,
                _ => moe::Names::QWEN,
            };
            Mlp::Sparse(moe::expert_params(b, &p, names, c, m, block))
        }
        None => Mlp::Dense {
            gate_proj: proj("mlp.gate_proj", c, inner),
            up_proj: proj("mlp.up_proj", c, inner),
            down_proj: proj("mlp.down_proj", inner, c),
        },
    };
    let (first, second) = match layout.post_norm {
        false => ("input_layernorm", "post_attention_layernorm"),
        true => ("post_attention_layernorm", "post_feedforward_layernorm"),
    };
    Layer {
        q_proj,
        k_proj,
        v_proj,
        o_proj,
        qk_norm,
        mlp,
        attention_norm: b.norm_params(&format!("{p}.{first}"), c, false, block),
        mlp_norm: b.norm_params(&format!("{p}.{second}"), c, false, block),
    }
}

/// Emits layer `i`'s forward ops on the residual stream `x`; returns the new stream.
fn decoder_layer(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &LlamaLayout,
    blocks: &Blocks,
    i: usize,
    layer: &Layer,
    x: ValueId,
) -> Result<ValueId> {
    let eps = config.norm_eps;
    b.enter(blocks.layers[i]);
    let n = |what: &str| format!("layers.{i}.{what}");
    // Pre-norm: x + attn(norm(x)); OLMo 2's post-norm: x + norm(attn(x)). The same for the MLP.
    let h = match layout.post_norm {
        false => b.norm(x, &layer.attention_norm, eps, n("input_layernorm"))?,
        true => x,
    };
    let att = attention(b, config, layout, i as u64, layer, h)?;
    let att = match layout.post_norm {
        false => att,
        true => b.norm(
            att,
            &layer.attention_norm,
            eps,
            n("post_attention_layernorm"),
        )?,
    };
    let x = b.add(x, att, n("attn.residual"))?;
    let h = match layout.post_norm {
        false => b.norm(x, &layer.mlp_norm, eps, n("post_attention_layernorm"))?,
        true => x,
    };
    let h = match &layer.mlp {
        Mlp::Dense {
            gate_proj,
            up_proj,
            down_proj,
        } => {
            let gate = b.linear(h, gate_proj, n("mlp.gate"))?;
            let up = b.linear(h, up_proj, n("mlp.up"))?;
            let h = b.op(OpKind::Swiglu, &[gate, up], n("mlp.act"))?;
            b.linear(h, down_proj, n("mlp.out"))?
        }
        Mlp::Sparse(experts) => moe::forward(b, experts, h, &n("mlp"))?,
    };
    let h = match layout.post_norm {
        false => h,
        true => b.norm(h, &layer.mlp_norm, eps, n("post_feedforward_layernorm"))?,
    };
    b.add(x, h, n("out"))
}

/// Emits layer `layer_index`'s attention on the normalised stream `h`, up to `o_proj`.
fn attention(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &LlamaLayout,
    layer_index: u64,
    layer: &Layer,
    h: ValueId,
) -> Result<ValueId> {
    let i = layer_index;
    let n = |what: &str| format!("layers.{i}.{what}");
    let mut q = b.linear(h, &layer.q_proj, n("attn.q"))?;
    let mut k = b.linear(h, &layer.k_proj, n("attn.k"))?;
    let v = b.linear(h, &layer.v_proj, n("attn.v"))?;
    if let Some((q_norm, k_norm)) = &layer.qk_norm {
        let head_dim = (layout.qk_norm == QkNorm::PerHead).then_some(config.head_dim);
        let norm = OpKind::RmsNorm {
            eps: config.norm_eps,
            head_dim,
            unit_offset: false,
        };
        q = b.op(norm.clone(), &[q, q_norm.weight.value], n("attn.q_norm"))?;
        k = b.op(norm, &[k, k_norm.weight.value], n("attn.k_norm"))?;
    }
    let rope = OpKind::Rope {
        head_dim: config.head_dim,
        theta: layout.rope_theta,
        scaling: layout.rope_scaling.clone(),
    };
    let q = b.op(rope.clone(), &[q], n("attn.q_rope"))?;
    let k = b.op(rope, &[k], n("attn.k_rope"))?;
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: layout.window_of(layer_index),
        qkv: QkvLayout::Separate,
        scale: None,
        softcap: None,
    };
    let att = b.op(attention, &[q, k, v], n("attn.core"))?;
    b.linear(att, &layer.o_proj, n("attn.out"))
}
