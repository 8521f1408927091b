//! `Gemma2Config` (`gemma2`) and `Gemma3TextConfig` (`gemma3_text`), read as transformers 5
//! reads them: each absent field takes the class's default (Gemma 2's soft-caps 50 and 30,
//! Gemma 3's none; `head_dim` 256; 4 KV heads; a 4096-token window), `layer_types` defaults to
//! every second layer global (Gemma 2) or every `sliding_window_pattern`-th (Gemma 3, 6), and
//! Gemma 3's RoPE has a base per layer type (`rope_theta` global, `rope_local_base_freq`
//! local) with `rope_scaling` on the global layers only.

use super::{
    flag, non_negative, Activation, Architecture, Context, Dim, Flag, Given, Layers, ModelConfig,
    NonNegative, Positive, Text,
};
use crate::error::Result;
use protrain_ir::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Whether a layer attends to a sliding window or to the whole prefix (`layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// `sliding_attention`: the layer's window is [`GemmaLayout::sliding_window`].
    Sliding,
    /// `full_attention`: the whole causal prefix.
    Full,
}

/// RoPE settings of one layer type.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rotary {
    /// Base of the frequencies.
    pub theta: f64,
    /// Long-context rescaling.
    pub scaling: RopeScaling,
}

/// What Gemma 2 and Gemma 3 (text) add to the common dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmaLayout {
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5`, not `head_dim^-0.5`.
    pub query_pre_attn_scalar: f64,
    /// `attn_logit_softcapping`: scores capped to `c * tanh(s / c)` (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// `final_logit_softcapping`: logits capped the same way.
    pub final_logit_softcapping: Option<f64>,
    /// The window of sliding layers; `None` (a `null` field) attends to the whole prefix.
    pub sliding_window: Option<u64>,
    /// Each layer's attention, in order.
    pub layer_types: Vec<LayerType>,
    /// RoPE of the global (`full_attention`) layers.
    pub rope_global: Rotary,
    /// RoPE of the sliding layers.
    pub rope_local: Rotary,
    /// Whether q, k, v and o projections have biases (`attention_bias`).
    pub attention_bias: bool,
    /// Gemma 3's per-head RMSNorm of q and k (`q_norm`, `k_norm`) before RoPE.
    pub qk_norm: bool,
}

impl GemmaLayout {
    /// The window of layer `i`: the sliding window on sliding layers, none on global ones.
    pub fn window(&self, i: usize) -> Option<u64> {
        match self.layer_types.get(i) {
            Some(LayerType::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// The RoPE settings of layer `i`.
    pub fn rope(&self, i: usize) -> &Rotary {
        match self.layer_types.get(i) {
            Some(LayerType::Sliding) => &self.rope_local,
            _ => &self.rope_global,
        }
    }
}

impl GemmaLayout {
    /// What makes this Gemma what it is beyond its sizes, one `what: how` line each (for
    /// `protrain info`), so that two configs that build different models read differently.
    pub fn features(&self, config: &ModelConfig) -> Vec<String> {
        let cap =
            |c: Option<f64>| c.map_or("none".to_string(), |c| format!("{c} (c * tanh(x / c))"));
        let rope = |r: &Rotary| match &r.scaling {
            RopeScaling::None => format!("theta {}", r.theta),
            RopeScaling::Linear { factor } => {
                format!("theta {}, linear scaling x{factor}", r.theta)
            }
            RopeScaling::Llama3 { factor, .. } => format!("theta {}, llama3 x{factor}", r.theta),
            other => format!(
                "theta {}, {}",
                r.theta,
                other.describe().unwrap_or_default()
            ),
        };
        let global: Vec<String> = (0..self.layer_types.len())
            .filter(|&i| self.layer_types[i] == LayerType::Full)
            .map(|i| i.to_string())
            .collect();
        let sliding = self.layer_types.len() - global.len();
        let mut lines = vec![
            "norms: RMSNorm scaling by (1 + weight) in f32, before and after attention and MLP"
                .to_string(),
            format!(
                "embeddings: scaled by sqrt({}) in the activation dtype",
                config.hidden_size
            ),
            format!(
                "attention scale: query_pre_attn_scalar^-0.5 = {}^-0.5",
                self.query_pre_attn_scalar
            ),
            format!("attention soft-cap: {}", cap(self.attn_logit_softcapping)),
            format!(
                "final logit soft-cap: {}",
                cap(self.final_logit_softcapping)
            ),
            format!(
                "windows: {} on {sliding} of {} layers; global layers {}",
                self.sliding_window
                    .map_or("none".to_string(), |w| format!("{w} tokens")),
                self.layer_types.len(),
                if global.is_empty() {
                    "none".to_string()
                } else {
                    global.join(", ")
                }
            ),
            format!(
                "rope: {} on global layers, {} on sliding layers",
                rope(&self.rope_global),
                rope(&self.rope_local)
            ),
            "mlp: GeGLU (gelu_pytorch_tanh(gate) * up)".to_string(),
            format!(
                "biases: {}",
                if self.attention_bias {
                    "q, k, v, o"
                } else {
                    "none"
                }
            ),
            format!(
                "tied embeddings: {}",
                if config.tie_word_embeddings {
                    "lm_head is the token embedding"
                } else {
                    "no (lm_head has its own weight)"
                }
            ),
        ];
        if self.qk_norm {
            lines.push("q/k norms: per head, RMSNorm scaling by (1 + weight)".into());
        }
        lines
    }
}

/// `Gemma2Config` and `Gemma3TextConfig`; each field is type-checked even where the other
/// family ignores it.
#[derive(Deserialize)]
pub(super) struct GemmaJson {
    vocab_size: Option<Dim>,
    hidden_size: Option<Dim>,
    intermediate_size: Option<Dim>,
    num_hidden_layers: Option<Layers>,
    num_attention_heads: Option<Dim>,
    num_key_value_heads: Option<Dim>,
    head_dim: Option<Dim>,
    max_position_embeddings: Option<Dim>,
    hidden_activation: Option<Text>,
    rms_norm_eps: Option<NonNegative>,
    tie_word_embeddings: Option<Flag>,
    initializer_range: Option<NonNegative>,
    #[serde(default)]
    pad_token_id: Given<Value>,
    attention_bias: Option<Flag>,
    query_pre_attn_scalar: Option<Positive>,
    #[serde(default)]
    sliding_window: Given<Dim<{ u64::MAX }>>,
    layer_types: Option<Vec<Text>>,
    sliding_window_pattern: Option<Dim>,
    #[serde(default)]
    final_logit_softcapping: Given<Positive>,
    #[serde(default)]
    attn_logit_softcapping: Given<Positive>,
    use_bidirectional_attention: Option<Flag>,
    rope_theta: Option<Positive>,
    rope_local_base_freq: Option<Positive>,
    rope_scaling: Option<Map<String, Value>>,
    rope_parameters: Option<Map<String, Value>>,
}

/// The RoPE types Gemma's builder implements.
const GEMMA_ROPE_TYPES: &str = "default, linear, yarn";

impl GemmaJson {
    pub(super) fn into_config(self, c: &Context) -> Result<ModelConfig> {
        let gemma3 = c.model_type == "gemma3_text";
        let vocab = c.required(self.vocab_size, "vocab_size")?;
        let hidden = c.required(self.hidden_size, "hidden_size")?;
        let intermediate = c.required(self.intermediate_size, "intermediate_size")?;
        let layers = c.required(self.num_hidden_layers, "num_hidden_layers")?;
        let heads = c.required(self.num_attention_heads, "num_attention_heads")?;
        // `validate_architecture` requires it although `head_dim` is its own field.
        c.split_heads(hidden, heads)?;
        let head_dim = self.head_dim.map_or(256, |d| d.0);
        if !head_dim.is_multiple_of(2) {
            let why = "even (rotary embeddings rotate pairs)";
            return Err(c.invalid("head_dim", why, head_dim));
        }
        let kv_heads = self.num_key_value_heads.map_or(4, |d| d.0);
        c.check_kv_heads(heads, kv_heads)?;
        c.activation(
            "hidden_activation",
            self.hidden_activation.as_ref(),
            "gelu_pytorch_tanh",
            &[Activation::GeluTanh],
        )?;
        if flag(self.use_bidirectional_attention, false) {
            return Err(c.unsupported(
                "use_bidirectional_attention",
                "true",
                "false (causal language models)",
            ));
        }
        let soft = |given: &Given<Positive>, default: Option<f64>| match given {
            Given::Absent => default,
            Given::Null => None,
            Given::Value(p) => Some(p.0),
        };
        let attn_cap = soft(&self.attn_logit_softcapping, (!gemma3).then_some(50.0));
        if gemma3 && attn_cap.is_some() {
            // Gemma3Attention keeps the field but never passes it to the attention.
            return Err(c.unsupported(
                "attn_logit_softcapping",
                &format!("{}", attn_cap.unwrap_or_default()),
                "null (transformers' Gemma 3 attention does not soft-cap its scores)",
            ));
        }
        let layer_types = self.layer_types(c, layers, gemma3)?;
        let max_positions = self
            .max_position_embeddings
            .map_or(if gemma3 { 131_072 } else { 8192 }, |d| d.0);
        let (rope_global, rope_local) = self.rope(c, gemma3, max_positions)?;
        let padding_idx = match &self.pad_token_id {
            Given::Absent => Some(0),
            Given::Null => None,
            Given::Value(id) => Some(c.padding_idx(id, vocab)?),
        };
        let layout = GemmaLayout {
            query_pre_attn_scalar: self.query_pre_attn_scalar.map_or(256.0, |p| p.0),
            attn_logit_softcapping: attn_cap,
            final_logit_softcapping: soft(&self.final_logit_softcapping, (!gemma3).then_some(30.0)),
            sliding_window: match self.sliding_window {
                Given::Absent => Some(4096),
                Given::Null => None,
                Given::Value(Dim(w)) => Some(w),
            },
            layer_types,
            rope_global,
            rope_local,
            attention_bias: flag(self.attention_bias, false),
            qk_norm: gemma3,
        };
        Ok(ModelConfig {
            name: c.name(),
            architecture: if gemma3 {
                Architecture::Gemma3(layout)
            } else {
                Architecture::Gemma2(layout)
            },
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            intermediate_size: intermediate,
            max_position_embeddings: max_positions,
            norm_eps: non_negative(self.rms_norm_eps, 1e-6),
            activation: Activation::GeluTanh,
            tie_word_embeddings: flag(self.tie_word_embeddings, true),
            padding_idx,
            initializer_range: non_negative(self.initializer_range, 0.02),
        })
    }

    /// `layer_types` as given (one per layer), else the class's pattern: a global layer every
    /// second layer (Gemma 2) or every `sliding_window_pattern`-th (Gemma 3, default 6).
    fn layer_types(&self, c: &Context, layers: u64, gemma3: bool) -> Result<Vec<LayerType>> {
        let Some(given) = &self.layer_types else {
            let pattern = match self.sliding_window_pattern {
                Some(Dim(p)) if gemma3 => p,
                _ if gemma3 => 6,
                _ => 2,
            };
            return Ok((0..layers)
                .map(|i| match (i + 1) % pattern {
                    0 => LayerType::Full,
                    _ => LayerType::Sliding,
                })
                .collect());
        };
        if given.len() as u64 != layers {
            return Err(c.invalid(
                "layer_types",
                &format!("a list of num_hidden_layers = {layers} layer types"),
                format!("{} of them", given.len()),
            ));
        }
        given
            .iter()
            .enumerate()
            .map(|(i, Text(t))| match t.as_str() {
                "sliding_attention" => Ok(LayerType::Sliding),
                "full_attention" => Ok(LayerType::Full),
                other => Err(c.unsupported(
                    &format!("layer_types[{i}]"),
                    other,
                    "sliding_attention, full_attention",
                )),
            })
            .collect()
    }

    /// The global and local RoPE settings. v4's `rope_scaling` (and Gemma 3's top-level
    /// `rope_theta` and `rope_local_base_freq`) win over v5's `rope_parameters`, which is one
    /// set for every layer or, for Gemma 3, one per layer type (`full_attention`,
    /// `sliding_attention`). YaRN's `original_max_position_embeddings` defaults to
    /// `max_positions`; its `truncate` is read from a flat settings object only: transformers
    /// reads it from the top level of `rope_parameters`, where Gemma 3's per-type objects
    /// (which a v4 `rope_scaling` is merged into) have none, so there it is always true.
    fn rope(&self, c: &Context, gemma3: bool, max_positions: u64) -> Result<(Rotary, Rotary)> {
        let default_global = if gemma3 { 1_000_000.0 } else { 10_000.0 };
        let global_theta = self.rope_theta.map_or(default_global, |t| t.0);
        let local_theta = match (gemma3, self.rope_local_base_freq) {
            (true, Some(t)) => t.0,
            (true, None) => 10_000.0,
            (false, _) => global_theta,
        };
        let empty = Map::new();
        let params = self.rope_parameters.as_ref().unwrap_or(&empty);
        let per_type = params.values().any(Value::is_object);
        let section = |key: &str| -> Result<Option<&Map<String, Value>>> {
            match params.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(m)) => Ok(Some(m)),
                Some(other) => {
                    Err(c.invalid(&format!("rope_parameters.{key}"), "an object", other))
                }
            }
        };
        let (global_params, local_params) = if per_type {
            if let Some(key) = params
                .keys()
                .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
            {
                return Err(c.unsupported(
                    &format!("rope_parameters.{key}"),
                    "a layer type",
                    "full_attention, sliding_attention",
                ));
            }
            (section("full_attention")?, section("sliding_attention")?)
        } else if params.is_empty() {
            (None, None)
        } else {
            (Some(params), (!gemma3).then_some(params))
        };
        // Where transformers reads YaRN's `truncate`: the top level of `rope_parameters`.
        let yarn = YarnContext {
            max_positions,
            top_level: match gemma3 && (per_type || self.rope_scaling.is_some()) {
                true => None,
                false => Some(self.rope_scaling.as_ref().unwrap_or(params)),
            },
        };
        let global = match &self.rope_scaling {
            Some(scaling) => one_rope(c, "rope_scaling", scaling, global_theta, &yarn)?,
            None => match global_params {
                Some(p) => one_rope(c, "rope_parameters", p, global_theta, &yarn)?,
                None => Rotary {
                    theta: global_theta,
                    scaling: RopeScaling::None,
                },
            },
        };
        let local = match local_params {
            Some(p) => one_rope(c, "rope_parameters", p, local_theta, &yarn)?,
            None if gemma3 => Rotary {
                theta: local_theta,
                scaling: RopeScaling::None,
            },
            // Gemma 2 has one rotary embedding for every layer.
            None => global.clone(),
        };
        Ok((global, local))
    }
}

/// What YaRN's settings read beyond their own object.
struct YarnContext<'a> {
    /// `max_position_embeddings`: the default `original_max_position_embeddings`.
    max_positions: u64,
    /// The object `truncate` is read from (`None`: none, so true).
    top_level: Option<&'a Map<String, Value>>,
}

/// One RoPE settings object: `rope_type` (or v4's `type`) `default`, `linear` with its
/// `factor`, or `yarn` as [`super::yarn`] reads it; `rope_theta` inside it wins over `theta`.
fn one_rope(
    c: &Context,
    field: &str,
    params: &Map<String, Value>,
    theta: f64,
    yarn: &YarnContext<'_>,
) -> Result<Rotary> {
    let path = |key: &str| format!("{field}.{key}");
    let positive = |key: &str| -> Result<Option<f64>> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                _ => Err(c.invalid(&path(key), "a positive number", v)),
            },
        }
    };
    let theta = positive("rope_theta")?.unwrap_or(theta);
    let rope_type = match params.get("rope_type").or(params.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(c.invalid(&path("rope_type"), "a string", other)),
    };
    if let Some(p) = params.get("partial_rotary_factor").and_then(Value::as_f64) {
        if p != 1.0 {
            let why = "1.0 (rotate the whole head)";
            return Err(c.unsupported("partial_rotary_factor", &p.to_string(), why));
        }
    }
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: positive("factor")?.ok_or_else(|| {
                c.invalid(
                    &path("factor"),
                    "a positive number (needed by rope_type 'linear')",
                    Value::Null,
                )
            })?,
        },
        "yarn" => {
            let mut object = params.clone();
            // `truncate` comes from where transformers reads it, not from this object.
            object.remove("truncate");
            if let Some(t) = yarn.top_level.and_then(|top| top.get("truncate")) {
                object.insert("truncate".into(), t.clone());
            }
            let json: super::RopeJson = serde_json::from_value(Value::Object(object))
                .map_err(|e| c.invalid(field, "YaRN settings", e.to_string()))?;
            let original = json
                .original_max_position_embeddings
                .as_ref()
                .map_or(yarn.max_positions, |d| d.0);
            super::yarn(&json, yarn.max_positions, original)
        }
        other => return Err(c.unsupported(&path("rope_type"), other, GEMMA_ROPE_TYPES)),
    };
    Ok(Rotary { theta, scaling })
}
