//! OPT (`OPTForCausalLM`): learned positions offset by 2, LayerNorm before (or, OPT-350m style,
//! after) each sublayer, separate q/k/v projections with biases, an MLP with the config's
//! activation (ReLU), optional `project_in`/`project_out`, tied `lm_head`.

use super::{activation, Builder, Linear, Norm, Weight};
use crate::config::{ModelConfig, OptLayout};
use crate::error::Result;
use protrain_ir::{BlockId, OpKind, QkvLayout, ValueId, WeightLayout};

/// `OPTLearnedPositionalEmbedding` keeps two rows before position 0 (fairseq's padding rows).
const POSITION_OFFSET: u64 = 2;

/// One `model.decoder.layers.{i}` block's parameters.
struct Layer {
    k_proj: Linear,
    v_proj: Linear,
    q_proj: Linear,
    out_proj: Linear,
    self_attn_layer_norm: Norm,
    fc1: Linear,
    fc2: Linear,
    final_layer_norm: Norm,
}

/// Declares OPT's parameters and emits its forward ops.
pub(super) fn build(b: &mut Builder, config: &ModelConfig, layout: &OptLayout) -> Result<()> {
    let (c, v) = (config.hidden_size, config.vocab_size);
    let word = layout.word_embed_proj_dim;
    let projected = word != c;
    let (tokens, targets) = b.inputs();
    let blocks = b.blocks(
        "model.decoder.embed_tokens",
        "model.decoder.layers",
        config.num_layers,
        "lm_head",
    );

    // Parameters, in `named_parameters()` order, which is OPTDecoder's definition order:
    // embeddings, project_out, project_in, final_layer_norm, then the layers.
    let d = "model.decoder";
    let embed = b.param(
        format!("{d}.embed_tokens.weight"),
        &[v, word],
        blocks.embedding,
    );
    if config.tie_word_embeddings {
        b.alias(embed, "lm_head.weight".into());
    }
    let positions = config.max_position_embeddings + POSITION_OFFSET;
    let embed_positions = b.param(
        format!("{d}.embed_positions.weight"),
        &[positions, c],
        blocks.embedding,
    );
    let linear = WeightLayout::OutIn;
    let project_out = projected.then(|| {
        b.linear_params(
            &format!("{d}.project_out"),
            c,
            word,
            false,
            linear,
            blocks.head,
        )
    });
    let project_in = projected.then(|| {
        b.linear_params(
            &format!("{d}.project_in"),
            word,
            c,
            false,
            linear,
            blocks.embedding,
        )
    });
    let final_norm = layout
        .final_layer_norm
        .then(|| b.norm_params(&format!("{d}.final_layer_norm"), c, true, blocks.head));
    let layers: Vec<Layer> = blocks
        .layers
        .iter()
        .enumerate()
        .map(|(i, &block)| layer_params(b, config, layout, i, block))
        .collect();
    let lm_head: Weight = if config.tie_word_embeddings {
        embed
    } else {
        b.param("lm_head.weight".into(), &[v, word], blocks.head)
    };

    // Forward.
    b.enter(blocks.embedding);
    let mut tok = b.op(
        OpKind::Embedding {
            padding_idx: config.padding_idx,
        },
        &[tokens, embed.value],
        "embed_tokens".into(),
    )?;
    if let Some(project_in) = &project_in {
        tok = b.linear(tok, project_in, "project_in".into())?;
    }
    let position = OpKind::PositionEmbedding {
        offset: POSITION_OFFSET,
    };
    let pos = b.op(
        position,
        &[tokens, embed_positions.value],
        "embed_positions".into(),
    )?;
    let mut x = b.add(tok, pos, "embed".into())?;
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: None,
        qkv: QkvLayout::Separate,
        scale: None,
        softcap: None,
    };
    for (i, (layer, &block)) in layers.iter().zip(&blocks.layers).enumerate() {
        b.enter(block);
        x = decoder_layer(b, config, layout, &attention, layer, i, x)?;
    }
    b.enter(blocks.head);
    if let Some(final_norm) = &final_norm {
        x = b.norm(x, final_norm, config.norm_eps, "final_layer_norm".into())?;
    }
    if let Some(project_out) = &project_out {
        x = b.linear(x, project_out, "project_out".into())?;
    }
    b.logits_and_loss(x, lm_head, targets)
}

/// Declares layer `i`'s parameters in block `block`, in OPTDecoderLayer's definition order.
fn layer_params(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &OptLayout,
    i: usize,
    block: BlockId,
) -> Layer {
    let d = "model.decoder";
    let c = config.hidden_size;
    let bias = layout.enable_bias;
    let ffn = config.intermediate_size;
    let linear = WeightLayout::OutIn;
    let p = format!("{d}.layers.{i}");
    Layer {
        k_proj: b.linear_params(&format!("{p}.self_attn.k_proj"), c, c, bias, linear, block),
        v_proj: b.linear_params(&format!("{p}.self_attn.v_proj"), c, c, bias, linear, block),
        q_proj: b.linear_params(&format!("{p}.self_attn.q_proj"), c, c, bias, linear, block),
        out_proj: b.linear_params(
            &format!("{p}.self_attn.out_proj"),
            c,
            c,
            bias,
            linear,
            block,
        ),
        self_attn_layer_norm: b.norm_params(&format!("{p}.self_attn_layer_norm"), c, true, block),
        fc1: b.linear_params(&format!("{p}.fc1"), c, ffn, bias, linear, block),
        fc2: b.linear_params(&format!("{p}.fc2"), ffn, c, bias, linear, block),
        final_layer_norm: b.norm_params(&format!("{p}.final_layer_norm"), c, true, block),
    }
}

/// Emits layer `i` on the residual stream `x`: attention then the MLP, each normalised before
/// (`do_layer_norm_before`) or after its residual add.
fn decoder_layer(
    b: &mut Builder,
    config: &ModelConfig,
    layout: &OptLayout,
    attention: &OpKind,
    layer: &Layer,
    i: usize,
    mut x: ValueId,
) -> Result<ValueId> {
    let eps = config.norm_eps;
    let pre_norm = layout.do_layer_norm_before;
    let n = |what: &str| format!("layers.{i}.{what}");
    let mut h = x;
    if pre_norm {
        h = b.norm(
            x,
            &layer.self_attn_layer_norm,
            eps,
            n("self_attn_layer_norm"),
        )?;
    }
    let q = b.linear(h, &layer.q_proj, n("attn.q"))?;
    let k = b.linear(h, &layer.k_proj, n("attn.k"))?;
    let v = b.linear(h, &layer.v_proj, n("attn.v"))?;
    let att = b.op(attention.clone(), &[q, k, v], n("attn.core"))?;
    let att = b.linear(att, &layer.out_proj, n("attn.out"))?;
    x = b.add(x, att, n("attn.residual"))?;
    if !pre_norm {
        x = b.norm(
            x,
            &layer.self_attn_layer_norm,
            eps,
            n("self_attn_layer_norm"),
        )?;
    }
    let mut h = x;
    if pre_norm {
        h = b.norm(x, &layer.final_layer_norm, eps, n("final_layer_norm"))?;
    }
    let h = b.linear(h, &layer.fc1, n("mlp.fc1"))?;
    let h = b.op(activation(config.activation), &[h], n("mlp.act"))?;
    let h = b.linear(h, &layer.fc2, n("mlp.out"))?;
    x = b.add(x, h, n("out"))?;
    if !pre_norm {
        x = b.norm(x, &layer.final_layer_norm, eps, n("final_layer_norm"))?;
    }
    Ok(x)
}
