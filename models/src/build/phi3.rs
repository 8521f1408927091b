//! Phi-3 (`Phi3ForCausalLM`): LLaMA's pre-norm decoder with q, k and v in one `qkv_proj`
//! (rows q, then k, then v) and gate and up in one `gate_up_proj` (gate rows first), as the
//! Hub stores them. The packed `qkv` is rotated in place (q's and k's heads, over their
//! rotary part; v's copied) and read by a packed attention; the packed `gate_up` feeds a
//! packed SwiGLU, `up * silu(gate)`.

use super::{Builder, Linear, Norm};
use crate::config::{ModelConfig, Phi3Layout};
use crate::error::Result;
use protrain_ir::{BlockId, OpKind, QkvLayout, WeightLayout};

/// One `model.layers.{i}` block's parameters.
struct Layer {
    o_proj: Linear,
    qkv_proj: Linear,
    gate_up_proj: Linear,
    down_proj: Linear,
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
}

/// Declares the parameters of a Phi-3 model and emits its forward ops.
pub(super) fn build(b: &mut Builder, config: &ModelConfig, layout: &Phi3Layout) -> Result<()> {
    let c = config.hidden_size;
    let (tokens, targets) = b.inputs();
    let blocks = b.blocks(
        "model.embed_tokens",
        "model.layers",
        config.num_layers,
        "lm_head",
    );
    let embed = b.embed_tokens(config, &blocks);
    let layers: Vec<Layer> = blocks
        .layers
        .iter()
        .enumerate()
        .map(|(i, &block)| layer_params(b, config, i, block))
        .collect();
    let norm = b.norm_params("model.norm", c, false, blocks.head);
    let lm_head = b.lm_head(config, embed, &blocks);

    b.enter(blocks.embedding);
    let mut x = b.op(
        OpKind::Embedding {
            padding_idx: config.padding_idx,
        },
        &[tokens, embed.value],
        "embed_tokens".into(),
    )?;
    let rope = OpKind::PartialRope {
        head_dim: config.head_dim,
        rotary_dim: layout.rotary_dim,
        heads: config.num_heads + config.num_kv_heads,
        theta: layout.rope_theta,
        scaling: layout.rope_scaling(b.graph.info.seq),
    };
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: layout.sliding_window,
        qkv: QkvLayout::Packed,
        scale: None,
        softcap: None,
    };
    let eps = config.norm_eps;
    for (i, layer) in layers.iter().enumerate() {
        b.enter(blocks.layers[i]);
        let n = |what: &str| format!("layers.{i}.{what}");
        let h = b.norm(x, &layer.input_layernorm, eps, n("input_layernorm"))?;
        let qkv = b.linear(h, &layer.qkv_proj, n("attn.qkv"))?;
        let qkv = b.op(rope.clone(), &[qkv], n("attn.qkv_rope"))?;
        let att = b.op(attention.clone(), &[qkv], n("attn.core"))?;
        let att = b.linear(att, &layer.o_proj, n("attn.out"))?;
        x = b.add(x, att, n("attn.residual"))?;
        let h = b.norm(
            x,
            &layer.post_attention_layernorm,
            eps,
            n("post_attention_layernorm"),
        )?;
        let gate_up = b.linear(h, &layer.gate_up_proj, n("mlp.gate_up"))?;
        let h = b.op(OpKind::PackedSwiglu, &[gate_up], n("mlp.act"))?;
        let h = b.linear(h, &layer.down_proj, n("mlp.out"))?;
        x = b.add(x, h, n("out"))?;
    }
    b.enter(blocks.head);
    let x = b.norm(x, &norm, eps, "norm".into())?;
    b.logits_and_loss(x, lm_head, targets)
}

/// Declares `model.layers.{i}`'s parameters in `named_parameters()` order (`Phi3Attention`
/// defines `o_proj` before `qkv_proj`).
fn layer_params(b: &mut Builder, config: &ModelConfig, i: usize, block: BlockId) -> Layer {
    let c = config.hidden_size;
    let q_width = config.num_heads * config.head_dim;
    let qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim;
    let inner = config.intermediate_size;
    let p = format!("model.layers.{i}");
    let mut proj = |name: &str, input: u64, output: u64| {
        b.linear_params(
            &format!("{p}.{name}"),
            input,
            output,
            false,
            WeightLayout::OutIn,
            block,
        )
    };
    let o_proj = proj("self_attn.o_proj", q_width, c);
    let qkv_proj = proj("self_attn.qkv_proj", c, qkv_width);
    let gate_up_proj = proj("mlp.gate_up_proj", c, 2 * inner);
    let down_proj = proj("mlp.down_proj", inner, c);
    Layer {
        o_proj,
        qkv_proj,
        gate_up_proj,
        down_proj,
        input_layernorm: b.norm_params(&format!("{p}.input_layernorm"), c, false, block),
        post_attention_layernorm: b.norm_params(
            &format!("{p}.post_attention_layernorm"),
            c,
            false,
            block,
        ),
    }
}
