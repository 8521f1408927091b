//! LLaMA and Mistral (`LlamaForCausalLM`, `MistralForCausalLM`): RMSNorm, q/k/v projections with
//! rotate-half RoPE on q and k, grouped KV heads, Mistral's sliding window, a SwiGLU MLP.

use super::{Builder, Linear, Norm, Weight};
use crate::config::{LlamaLayout, ModelConfig};
use crate::error::Result;
use protrain_ir::{OpKind, QkvLayout, WeightLayout};

/// One `model.layers.{i}` block's parameters.
struct Layer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
}

/// Declares LLaMA's (or Mistral's) parameters and emits its forward ops.
pub(super) fn build(b: &mut Builder, config: &ModelConfig, layout: &LlamaLayout) -> Result<()> {
    let (c, v) = (config.hidden_size, config.vocab_size);
    let q_width = config.num_heads * config.head_dim;
    let kv_width = config.num_kv_heads * config.head_dim;
    let inner = config.intermediate_size;
    let (tokens, targets) = b.inputs();
    let blocks = b.blocks(
        "model.embed_tokens",
        "model.layers",
        config.num_layers,
        "lm_head",
    );

    // Parameters, in `named_parameters()` order: a layer's attention and MLP before its norms.
    let embed = b.param(
        "model.embed_tokens.weight".into(),
        &[v, c],
        blocks.embedding,
    );
    if config.tie_word_embeddings {
        b.alias(embed, "lm_head.weight".into());
    }
    let linear = WeightLayout::OutIn;
    let (attn_bias, mlp_bias) = (layout.attention_bias, layout.mlp_bias);
    let layers: Vec<Layer> = blocks
        .layers
        .iter()
        .enumerate()
        .map(|(i, &block)| {
            let p = format!("model.layers.{i}");
            Layer {
                q_proj: b.linear_params(
                    &format!("{p}.self_attn.q_proj"),
                    c,
                    q_width,
                    attn_bias,
                    linear,
                    block,
                ),
                k_proj: b.linear_params(
                    &format!("{p}.self_attn.k_proj"),
                    c,
                    kv_width,
                    attn_bias,
                    linear,
                    block,
                ),
                v_proj: b.linear_params(
                    &format!("{p}.self_attn.v_proj"),
                    c,
                    kv_width,
                    attn_bias,
                    linear,
                    block,
                ),
                o_proj: b.linear_params(
                    &format!("{p}.self_attn.o_proj"),
                    q_width,
                    c,
                    attn_bias,
                    linear,
                    block,
                ),
                gate_proj: b.linear_params(
                    &format!("{p}.mlp.gate_proj"),
                    c,
                    inner,
                    mlp_bias,
                    linear,
                    block,
                ),
                up_proj: b.linear_params(
                    &format!("{p}.mlp.up_proj"),
                    c,
                    inner,
                    mlp_bias,
                    linear,
                    block,
                ),
                down_proj: b.linear_params(
                    &format!("{p}.mlp.down_proj"),
                    inner,
                    c,
                    mlp_bias,
                    linear,
                    block,
                ),
                input_layernorm: b.norm_params(&format!("{p}.input_layernorm"), c, false, block),
                post_attention_layernorm: b.norm_params(
                    &format!("{p}.post_attention_layernorm"),
                    c,
                    false,
                    block,
                ),
            }
        })
        .collect();
    let norm = b.norm_params("model.norm", c, false, blocks.head);
    let lm_head: Weight = if config.tie_word_embeddings {
        embed
    } else {
        b.param("lm_head.weight".into(), &[v, c], blocks.head)
    };

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
    let rope = OpKind::Rope {
        head_dim: config.head_dim,
        theta: layout.rope_theta,
        scaling: layout.rope_scaling,
    };
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: layout.sliding_window,
        qkv: QkvLayout::Separate,
        scale: None,
        softcap: None,
    };
    for (i, (layer, &block)) in layers.iter().zip(&blocks.layers).enumerate() {
        b.enter(block);
        let n = |what: &str| format!("layers.{i}.{what}");
        let h = b.norm(x, &layer.input_layernorm, eps, n("input_layernorm"))?;
        let q = b.linear(h, &layer.q_proj, n("attn.q"))?;
        let k = b.linear(h, &layer.k_proj, n("attn.k"))?;
        let v = b.linear(h, &layer.v_proj, n("attn.v"))?;
        let q = b.op(rope.clone(), &[q], n("attn.q_rope"))?;
        let k = b.op(rope.clone(), &[k], n("attn.k_rope"))?;
        let att = b.op(attention.clone(), &[q, k, v], n("attn.core"))?;
        let att = b.linear(att, &layer.o_proj, n("attn.out"))?;
        x = b.add(x, att, n("attn.residual"))?;
        let h = b.norm(
            x,
            &layer.post_attention_layernorm,
            eps,
            n("post_attention_layernorm"),
        )?;
        let gate = b.linear(h, &layer.gate_proj, n("mlp.gate"))?;
        let up = b.linear(h, &layer.up_proj, n("mlp.up"))?;
        let h = b.op(OpKind::Swiglu, &[gate, up], n("mlp.act"))?;
        let h = b.linear(h, &layer.down_proj, n("mlp.out"))?;
        x = b.add(x, h, n("out"))?;
    }
    b.enter(blocks.head);
    let x = b.norm(x, &norm, eps, "norm".into())?;
    b.logits_and_loss(x, lm_head, targets)
}
