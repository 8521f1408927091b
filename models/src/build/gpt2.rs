//! GPT-2 (`GPT2LMHeadModel`): learned positions, pre-norm LayerNorm, packed `c_attn` attention
//! through `Conv1D` (`[in, out]`) weights, an MLP with the config's activation, tied `lm_head`.

use super::{activation, Builder, Linear, Norm, Weight};
use crate::config::ModelConfig;
use crate::error::Result;
use protrain_ir::{OpKind, ParamId, QkvLayout, WeightLayout};

/// One `transformer.h.{i}` block's parameters.
struct Layer {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// Declares GPT-2's parameters and emits its forward ops.
pub(super) fn build(b: &mut Builder, config: &ModelConfig) -> Result<()> {
    let (c, v) = (config.hidden_size, config.vocab_size);
    let (tokens, targets) = b.inputs();
    let blocks = b.blocks(
        "transformer.wte",
        "transformer.h",
        config.num_layers,
        "lm_head",
    );

    // Parameters, in `named_parameters()` order: transformer.{wte, wpe, h.*, ln_f}, lm_head.
    let wte = b.param("transformer.wte.weight".into(), &[v, c], blocks.embedding);
    if config.tie_word_embeddings {
        b.alias(wte, "lm_head.weight".into());
    }
    let wpe = b.param(
        "transformer.wpe.weight".into(),
        &[config.max_position_embeddings, c],
        blocks.embedding,
    );
    let conv = WeightLayout::InOut;
    let inner = config.intermediate_size;
    let layers: Vec<Layer> = blocks
        .layers
        .iter()
        .enumerate()
        .map(|(i, &block)| {
            let p = format!("transformer.h.{i}");
            Layer {
                ln_1: b.norm_params(&format!("{p}.ln_1"), c, true, block),
                c_attn: b.linear_params(&format!("{p}.attn.c_attn"), c, 3 * c, true, conv, block),
                attn_proj: b.linear_params(&format!("{p}.attn.c_proj"), c, c, true, conv, block),
                ln_2: b.norm_params(&format!("{p}.ln_2"), c, true, block),
                c_fc: b.linear_params(&format!("{p}.mlp.c_fc"), c, inner, true, conv, block),
                mlp_proj: b.linear_params(&format!("{p}.mlp.c_proj"), inner, c, true, conv, block),
            }
        })
        .collect();
    let ln_f = b.norm_params("transformer.ln_f", c, true, blocks.head);
    let lm_head: Weight = if config.tie_word_embeddings {
        wte
    } else {
        b.param("lm_head.weight".into(), &[v, c], blocks.head)
    };
    // Checkpoints saved by old versions of transformers name the `transformer.*` tensors
    // without the prefix.
    let legacy: Vec<(ParamId, String)> = b
        .graph
        .params()
        .filter_map(|(id, p)| {
            p.name
                .strip_prefix("transformer.")
                .map(|n| (id, n.to_string()))
        })
        .collect();
    for (id, name) in legacy {
        b.graph.add_param_alias(id, name);
    }

    // Forward.
    b.enter(blocks.embedding);
    let tok = b.op(
        OpKind::Embedding { padding_idx: None },
        &[tokens, wte.value],
        "wte".into(),
    )?;
    let pos = b.op(
        OpKind::PositionEmbedding { offset: 0 },
        &[tokens, wpe.value],
        "wpe".into(),
    )?;
    let mut x = b.add(tok, pos, "embed".into())?;
    let eps = config.norm_eps;
    let attention = OpKind::Attention {
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        window: None,
        qkv: QkvLayout::Packed,
        scale: None,
        softcap: None,
    };
    for (i, (layer, &block)) in layers.iter().zip(&blocks.layers).enumerate() {
        b.enter(block);
        let n = |what: &str| format!("h.{i}.{what}");
        let h = b.norm(x, &layer.ln_1, eps, n("ln_1"))?;
        let qkv = b.linear(h, &layer.c_attn, n("attn.qkv"))?;
        let att = b.op(attention.clone(), &[qkv], n("attn.core"))?;
        let att = b.linear(att, &layer.attn_proj, n("attn.out"))?;
        x = b.add(x, att, n("attn.residual"))?;
        let h = b.norm(x, &layer.ln_2, eps, n("ln_2"))?;
        let h = b.linear(h, &layer.c_fc, n("mlp.fc"))?;
        let h = b.op(activation(config.activation), &[h], n("mlp.act"))?;
        let h = b.linear(h, &layer.mlp_proj, n("mlp.out"))?;
        x = b.add(x, h, n("out"))?;
    }
    b.enter(blocks.head);
    let x = b.norm(x, &ln_f, eps, "ln_f".into())?;
    b.logits_and_loss(x, lm_head, targets)
}
