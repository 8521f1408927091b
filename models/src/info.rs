//! A model's vital statistics: dimensions, exact parameter count, and model-state memory.

use crate::build::{build_forward, BuildOptions};
use crate::config::{Architecture, ModelConfig};
use crate::error::Result;
use serde::{Deserialize, Serialize};

/// Bytes of model state per parameter in mixed-precision AdamW training, part by part.
pub mod bytes_per_param {
    /// bf16 parameter.
    pub const PARAM: u64 = 2;
    /// bf16 gradient.
    pub const GRAD: u64 = 2;
    /// fp32 master weight.
    pub const MASTER: u64 = 4;
    /// fp32 Adam first moment.
    pub const ADAM_M: u64 = 4;
    /// fp32 Adam second moment.
    pub const ADAM_V: u64 = 4;
    /// All of the above: 16.
    pub const TOTAL: u64 = PARAM + GRAD + MASTER + ADAM_M + ADAM_V;
    /// Gradients in the parameter chunk after its last upload (PatrickStar's reuse): 14.
    pub const GRADS_IN_PARAMS: u64 = TOTAL - GRAD;
    /// Staging: only the master weight and the moments stored, the bf16 copies made at
    /// upload and the gradients consumed as they arrive: 12, the floor.
    pub const STAGED: u64 = MASTER + ADAM_M + ADAM_V;
}

/// Model-state bytes of mixed-precision AdamW training, part by part (before any chunking or
/// gradient slot reuse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelStateBytes {
    /// bf16 parameters.
    pub params: u64,
    /// bf16 gradients.
    pub grads: u64,
    /// fp32 master weights.
    pub master: u64,
    /// fp32 Adam first moments.
    pub adam_m: u64,
    /// fp32 Adam second moments.
    pub adam_v: u64,
    /// The sum: 16 bytes per parameter.
    pub total: u64,
    /// With gradients in the parameter chunk: 14 bytes per parameter.
    pub grads_in_params: u64,
    /// With staging (master and moments only): 12 bytes per parameter.
    pub staged: u64,
}

impl ModelStateBytes {
    /// The model states of `parameters` parameters.
    pub fn for_parameters(parameters: u64) -> Self {
        use bytes_per_param::*;
        Self {
            params: parameters * PARAM,
            grads: parameters * GRAD,
            master: parameters * MASTER,
            adam_m: parameters * ADAM_M,
            adam_v: parameters * ADAM_V,
            total: parameters * TOTAL,
            grads_in_params: parameters * GRADS_IN_PARAMS,
            staged: parameters * STAGED,
        }
    }
}

/// What `protrain info` prints about a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The preset name or config path.
    pub name: String,
    /// The transformers `model_type`.
    pub model_type: String,
    /// Transformer layers.
    pub layers: u64,
    /// Width of the residual stream.
    pub hidden: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Width of the MLP's hidden layer.
    pub intermediate: u64,
    /// `max_position_embeddings` (a hard limit only for learned positions).
    pub max_positions: u64,
    /// Trainable parameters, tied tensors counted once; exact.
    pub parameters: u64,
    /// Model-state memory of mixed-precision AdamW training.
    pub model_state_bytes: ModelStateBytes,
    /// What makes the model what it is beyond its sizes, one `what: how` line each: norms and
    /// where they sit, biases, q/k norms, tied embeddings, positions, attention windows.
    pub features: Vec<String>,
}

impl ModelInfo {
    /// The statistics of a model. The parameter count is the sum over the parameters of the
    /// forward graph built at batch 1, sequence 1, so it cannot drift from what is trained.
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let graph = build_forward(config, &BuildOptions::new(1, 1))?;
        let parameters = graph.param_count();
        Ok(Self {
            name: config.name.clone(),
            model_type: config.model_type().to_string(),
            layers: config.num_layers,
            hidden: config.hidden_size,
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            vocab: config.vocab_size,
            intermediate: config.intermediate_size,
            max_positions: config.max_position_embeddings,
            parameters,
            model_state_bytes: ModelStateBytes::for_parameters(parameters),
            features: features(config),
        })
    }
}

impl ModelConfig {
    /// This model's [`ModelInfo`].
    pub fn info(&self) -> Result<ModelInfo> {
        ModelInfo::new(self)
    }
}

/// The `what: how` lines of [`ModelInfo::features`].
fn features(config: &ModelConfig) -> Vec<String> {
    match &config.architecture {
        Architecture::Gemma2(layout) | Architecture::Gemma3(layout) => layout.features(config),
        _ => Vec::new(),
    }
}
