//! A model's vital statistics: dimensions, exact parameter count, and model-state memory.

use crate::build::{build_forward, BuildOptions};
use crate::config::{Architecture, LlamaLayout, ModelConfig, QkNorm};
use crate::error::Result;
use protrain_ir::RopeScaling;
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
    let tied = match config.tie_word_embeddings {
        true => "tied embeddings: lm_head is the token embedding",
        false => "tied embeddings: no (lm_head has its own weight)",
    };
    let mut lines = match &config.architecture {
        Architecture::Gpt2 => vec![
            "norms: LayerNorm before attention and MLP".to_string(),
            "biases: every linear".into(),
            format!("positions: {} learned rows", config.max_position_embeddings),
        ],
        Architecture::Opt(l) => vec![
            format!(
                "norms: LayerNorm {} attention and MLP{}",
                if l.do_layer_norm_before {
                    "before"
                } else {
                    "after"
                },
                if l.final_layer_norm {
                    ", and a final one"
                } else {
                    ""
                }
            ),
            format!(
                "biases: {}",
                if l.enable_bias {
                    "every linear"
                } else {
                    "none"
                }
            ),
            format!(
                "positions: {} learned rows, offset 2",
                config.max_position_embeddings
            ),
        ],
        Architecture::Llama(l)
        | Architecture::Mistral(l)
        | Architecture::Qwen2(l)
        | Architecture::Qwen3(l)
        | Architecture::Olmo2(l) => rotary_features(config, l),
        Architecture::Mixtral(arch) | Architecture::Qwen3Moe(arch) => {
            let mut lines = rotary_features(config, &arch.layout);
            let moe = &arch.moe;
            let sparse = moe.sparse_layers.iter().filter(|s| **s).count();
            lines.push(format!(
                "experts: {} per sparse layer ({sparse} of {} layers), top-{} routing{}, \
                 SwiGLU experts {} wide",
                moe.experts,
                config.num_layers,
                moe.top_k,
                if moe.normalize { " renormalised" } else { "" },
                moe.expert_intermediate_size
            ));
            lines
        }
        // Gemma's lines name its tied embeddings among its own features.
        Architecture::Gemma2(l) | Architecture::Gemma3(l) => return l.features(config),
        Architecture::Phi3(l) => l.features(config),
    };
    lines.push(tied.into());
    lines
}

/// The features of the LLaMA-like families.
fn rotary_features(config: &ModelConfig, l: &LlamaLayout) -> Vec<String> {
    let norms = match l.post_norm {
        false => "norms: RMSNorm before attention and MLP",
        true => "norms: RMSNorm after attention and MLP (on each output, before its residual add)",
    };
    let mut biases = Vec::new();
    if l.attention_bias {
        biases.push("q, k, v, o");
    } else if l.qkv_bias {
        biases.push("q, k, v");
    }
    if l.mlp_bias {
        biases.push("gate, up, down");
    }
    let biases = match biases.is_empty() {
        true => "none".to_string(),
        false => biases.join("; "),
    };
    let qk_norm = match l.qk_norm {
        QkNorm::None => "none".to_string(),
        QkNorm::PerHead => format!("RMSNorm per head ({} wide)", config.head_dim),
        QkNorm::Whole => "RMSNorm over the whole projection".into(),
    };
    let scaling = match &l.rope_scaling {
        RopeScaling::None => String::new(),
        RopeScaling::Linear { factor } => format!(", linear scaling by {factor}"),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => format!(
            ", llama3 scaling (factor {factor}, low {low_freq_factor}, high {high_freq_factor}, \
             original {original_max_position_embeddings})"
        ),
        other => format!(", {}", other.describe().unwrap_or_default()),
    };
    let window = match l.sliding_window {
        None => "none (every layer attends to the whole prefix)".to_string(),
        Some(w) if l.full_attention_layers == 0 => format!("{w} tokens on every layer"),
        Some(_) if l.full_attention_layers >= config.num_layers => {
            "none (the window starts above the last layer)".into()
        }
        Some(w) => format!(
            "{w} tokens on layers {}..={}; the whole prefix on layers 0..={}",
            l.full_attention_layers,
            config.num_layers - 1,
            l.full_attention_layers - 1
        ),
    };
    vec![
        norms.into(),
        format!("biases: {biases}"),
        format!("q/k norm: {qk_norm}"),
        format!("positions: RoPE theta {}{scaling}", l.rope_theta),
        format!("attention window: {window}"),
    ]
}
