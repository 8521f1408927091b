//! How each parameter is initialised without a checkpoint, as transformers' `_init_weights`
//! does it.

use crate::config::{Architecture, ModelConfig};
use protrain_ir::{Graph, OpKind, ParamId, ParamInit};

/// Sets every parameter's [`ParamInit`] from how the graph uses it: norm scales are ones (zeros
/// where the norm scales by `1 + weight`),
/// norm shifts and linear biases zeros, every other weight normal with std
/// `initializer_range`; GPT-2 scales its residual projections (`c_proj.weight`) by
/// `1/sqrt(2 * n_layer)`, as `GPT2PreTrainedModel._init_weights` does.
///
/// It does not zero an embedding's padding row, which transformers also does at
/// initialisation: that row is one of thousands and is trained like the others.
pub fn assign_inits(config: &ModelConfig, graph: &mut Graph) {
    let mut inits: Vec<(ParamId, ParamInit)> = Vec::new();
    for (_, op) in graph.ops() {
        let fixed = |slot: usize| -> Option<ParamInit> {
            match (&op.kind, slot) {
                // A `1 + weight` scale starts at one from a zero weight (Gemma's `RMSNorm`).
                (
                    OpKind::RmsNorm {
                        unit_offset: true, ..
                    },
                    1,
                ) => Some(ParamInit::Zeros),
                (OpKind::LayerNorm { .. } | OpKind::RmsNorm { .. }, 1) => Some(ParamInit::Ones),
                (OpKind::LayerNorm { .. }, 2) | (OpKind::Linear { bias: true, .. }, 2) => {
                    Some(ParamInit::Zeros)
                }
                _ => None,
            }
        };
        for (slot, &input) in op.inputs.iter().enumerate() {
            if let (Some(param), Some(init)) = (graph.param_of(input), fixed(slot)) {
                inits.push((param, init));
            }
        }
    }
    let std = config.initializer_range;
    let residual_std = std / (2.0 * config.num_layers as f64).sqrt();
    let normal: Vec<(ParamId, ParamInit)> = graph
        .params()
        .map(|(id, p)| {
            let scaled = matches!(config.architecture, Architecture::Gpt2)
                && p.name.ends_with("c_proj.weight");
            let std = if scaled { residual_std } else { std };
            (id, ParamInit::Normal { std })
        })
        .collect();
    for (id, init) in normal.into_iter().chain(inits) {
        graph.set_param_init(id, init);
    }
}
