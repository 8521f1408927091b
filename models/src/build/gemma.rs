//! Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): embeddings scaled by
//! `sqrt(hidden_size)`, RMSNorms that scale by `1 + weight`, a norm before and after each
//! attention and MLP block, q/k/v projections with RoPE (a base per layer type in Gemma 3, and
//! Gemma 3's per-head q/k norms before it), attention scaled by `query_pre_attn_scalar^-0.5`
//! with Gemma 2's soft-capped scores, sliding and global layers, a GeGLU MLP, and soft-capped
//! logits.

use super::{Builder, Linear, Norm};
use crate::config::{GemmaLayout, ModelConfig};
use crate::error::Result;
use protrain_ir::{OpKind, QkvLayout, ValueId, WeightLayout};

/// One `model.layers.{i}` block's parameters.
struct Layer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Gemma 3's per-head norms of q and k.
    qk_norm: Option<(Norm, Norm)>,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
    pre_feedforward_layernorm: Norm,
    post_feedforward_layernorm: Norm,
}

/// Declares layer `i`'s parameters in `named_parameters()` order: attention (Gemma 3's q and k
/// norms after its projections), MLP, then the four norms.
fn layer_params(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &GemmaLayout,
    i: usize,
    block: protrain_ir::BlockId,
) -> Layer {
    let c = config.hidden_size;
    let (q_width, kv_width) = (
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    );
    let inner = config.intermediate_size;
    let p = format!("model.layers.{i}");
    let bias = layout.attention_bias;
    let mut linear = |name: &str, input: u64, output: u64, bias: bool| {
        b.linear_params(
            &format!("{p}.{name}"),
            input,
            output,
            bias,
            WeightLayout::OutIn,
            block,
        )
    };
    let q_proj = linear("self_attn.q_proj", c, q_width, bias);
    let k_proj = linear("self_attn.k_proj", c, kv_width, bias);
    let v_proj = linear("self_attn.v_proj", c, kv_width, bias);
    let o_proj = linear("self_attn.o_proj", q_width, c, bias);
    let qk_norm = layout.qk_norm.then(|| {
        let d = config.head_dim;
        (
            b.norm_params(&format!("{p}.self_attn.q_norm"), d, false, block),
            b.norm_params(&format!("{p}.self_attn.k_norm"), d, false, block),
        )
    });
    let mut linear = |name: &str, input: u64, output: u64| {
        b.linear_params(
            &format!("{p}.{name}"),
            input,
            output,
            false,
            WeightLayout::OutIn,
            block,
        )
    };
    let gate_proj = linear("mlp.gate_proj", c, inner);
    let up_proj = linear("mlp.up_proj", c, inner);
    let down_proj = linear("mlp.down_proj", inner, c);
    let mut norm = |name: &str| b.norm_params(&format!("{p}.{name}"), c, false, block);
    Layer {
        q_proj,
        k_proj,
        v_proj,
        o_proj,
        qk_norm,
        gate_proj,
        up_proj,
        down_proj,
        input_layernorm: norm("input_layernorm"),
        post_attention_layernorm: norm("post_attention_layernorm"),
        pre_feedforward_layernorm: norm("pre_feedforward_layernorm"),
        post_feedforward_layernorm: norm("post_feedforward_layernorm"),
    }
}

/// Gemma's RMSNorm, `x / rms(x) * (1 + weight)` in f32, over the last dimension or, with
/// `head_dim`, over each head of it.
fn gemma_norm(
    b: &mut Builder,
    x: ValueId,
    norm: &Norm,
    eps: f64,
    head_dim: Option<u64>,
    name: String,
) -> Result<ValueId> {
    let kind = OpKind::RmsNorm {
        eps,
        head_dim,
        unit_offset: true,
    };
    b.op(kind, &[x, norm.weight.value], name)
}

/// Declares Gemma 2's or Gemma 3's parameters and emits its forward ops.
pub(super) fn build(b: &mut Builder, config: &ModelConfig, layout: &GemmaLayout) -> Result<()> {
    let c = config.hidden_size;
    let (tokens, targets) = b.inputs();
    let blocks = b.blocks(
        "model.embed_tokens",
        "model.layers",
        config.num_layers,
        "lm_head",
    );
    let embed = b.embed_tokens(config, &blocks);
    let layers: Vec<Layer> = (blocks.layers.clone().into_iter().enumerate())
        .map(|(i, block)| layer_params(b, config, layout, i, block))
        .collect();
    let norm = b.norm_params("model.norm", c, false, blocks.head);
    let lm_head = b.lm_head(config, embed, &blocks);

    b.enter(blocks.embedding);
    let x = b.op(
        OpKind::Embedding {
            padding_idx: config.padding_idx,
        },
        &[tokens, embed.value],
        "embed_tokens".into(),
    )?;
    let factor = (c as f64).sqrt();
    let mut x = b.op(OpKind::Scale { factor }, &[x], "embed_scale".into())?;
    for (i, (layer, &block)) in layers.iter().zip(&blocks.layers).enumerate() {
        b.enter(block);
        x = decoder_layer(b, config, layout, i, layer, x)?;
    }
    b.enter(blocks.head);
    let x = gemma_norm(b, x, &norm, config.norm_eps, None, "norm".into())?;
    let head = Linear {
        weight: lm_head,
        bias: None,
        layout: WeightLayout::OutIn,
    };
    let mut logits = b.linear(x, &head, "logits".into())?;
    if let Some(cap) = layout.final_logit_softcapping {
        logits = b.op(OpKind::Softcap { cap }, &[logits], "logits_softcap".into())?;
    }
    let loss = b.op_with_role(
        OpKind::CrossEntropy,
        &[logits, targets],
        "loss".into(),
        protrain_ir::Role::Loss,
    )?;
    b.graph.add_output(loss);
    Ok(())
}

/// One decoder layer: `x + post_norm(attn(pre_norm(x)))`, then the same with the MLP.
fn decoder_layer(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &GemmaLayout,
    i: usize,
    layer: &Layer,
    x: ValueId,
) -> Result<ValueId> {
    let eps = config.norm_eps;
    let n = |what: &str| format!("layers.{i}.{what}");
    let rotary = layout.rope(i);
    let rope = OpKind::Rope {
        head_dim: config.head_dim,
        theta: rotary.theta,
        scaling: rotary.scaling.clone(),
    };
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: layout.window(i),
        qkv: QkvLayout::Separate,
        scale: Some(layout.query_pre_attn_scalar.powf(-0.5)),
        softcap: layout.attn_logit_softcapping,
    };
    let h = gemma_norm(
        b,
        x,
        &layer.input_layernorm,
        eps,
        None,
        n("input_layernorm"),
    )?;
    let mut q = b.linear(h, &layer.q_proj, n("attn.q"))?;
    let mut k = b.linear(h, &layer.k_proj, n("attn.k"))?;
    let v = b.linear(h, &layer.v_proj, n("attn.v"))?;
    if let Some((q_norm, k_norm)) = &layer.qk_norm {
        let d = Some(config.head_dim);
        q = gemma_norm(b, q, q_norm, eps, d, n("attn.q_norm"))?;
        k = gemma_norm(b, k, k_norm, eps, d, n("attn.k_norm"))?;
    }
    let q = b.op(rope.clone(), &[q], n("attn.q_rope"))?;
    let k = b.op(rope, &[k], n("attn.k_rope"))?;
    let att = b.op(attention, &[q, k, v], n("attn.core"))?;
    let att = b.linear(att, &layer.o_proj, n("attn.out"))?;
    let att = gemma_norm(
        b,
        att,
        &layer.post_attention_layernorm,
        eps,
        None,
        n("post_attention_layernorm"),
    )?;
    let x = b.add(x, att, n("attn.residual"))?;
    let h = gemma_norm(
        b,
        x,
        &layer.pre_feedforward_layernorm,
        eps,
        None,
        n("pre_feedforward_layernorm"),
    )?;
    let gate = b.linear(h, &layer.gate_proj, n("mlp.gate"))?;
    let up = b.linear(h, &layer.up_proj, n("mlp.up"))?;
    let h = b.op(OpKind::Geglu, &[gate, up], n("mlp.act"))?;
    let h = b.linear(h, &layer.down_proj, n("mlp.out"))?;
    let h = gemma_norm(
        b,
        h,
        &layer.post_feedforward_layernorm,
        eps,
        None,
        n("post_feedforward_layernorm"),
    )?;
    b.add(x, h, n("out"))
}
