//! Hugging Face `config.json` parsing into a normalized [`ModelConfig`].
//!
//! Each supported `model_type` is read the way its transformers configuration class reads it
//! (transformers 4.x and 5.x): a field that is absent or `null` takes the class's default, and
//! derived fields are derived as the class derives them (`n_inner: null` is `4 * n_embd`, a
//! missing `num_key_value_heads` or `head_dim` comes from the heads, OPT's
//! `word_embed_proj_dim` defaults to the hidden size, RoPE settings come from v4's `rope_theta`
//! and `rope_scaling` or v5's `rope_parameters`).
//!
//! One deliberate difference: the dimensions that set a model's size (vocabulary, hidden size,
//! layers, heads, MLP width, and the learned position count of GPT-2 and OPT) are required.
//! transformers would fill them with its reference model's values, which silently builds a model
//! other than the one the file describes.
//!
//! Parsing never panics: every number is range-checked before any arithmetic uses it.

use crate::error::{ConfigSource, ModelError, Result};
use protrain_ir::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;
use std::path::Path;

/// The `model_type` values this crate builds.
pub const SUPPORTED_MODEL_TYPES: [&str; 4] = ["gpt2", "llama", "mistral", "opt"];

/// The largest accepted width of any dimension (vocabulary, hidden size, heads, positions).
///
/// Far above any published model; it keeps every shape's byte size well inside a `u64`.
pub const MAX_DIM: u64 = 1 << 24;

/// The largest accepted number of layers.
pub const MAX_LAYERS: u64 = 1 << 16;

/// The elementwise activation of a model's MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// GELU with the tanh approximation (transformers' `gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `max(x, 0)` (transformers' `relu`).
    Relu,
    /// `x * sigmoid(x)` (transformers' `silu`, `swish`); LLaMA's gated MLP uses it.
    Silu,
}

impl Activation {
    /// The transformers names (`ACT2FN` keys) this crate accepts, with what each maps to.
    const NAMES: [(&'static str, Activation); 5] = [
        ("gelu_new", Activation::GeluTanh),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("relu", Activation::Relu),
        ("silu", Activation::Silu),
        ("swish", Activation::Silu),
    ];
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Activation::GeluTanh => "gelu_new",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
        })
    }
}

/// What LLaMA and Mistral add to the common dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaLayout {
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Long-context rescaling of the rotary frequencies.
    pub rope_scaling: RopeScaling,
    /// Whether q, k, v and o projections have biases (`attention_bias`).
    pub attention_bias: bool,
    /// Whether gate, up and down projections have biases (`mlp_bias`).
    pub mlp_bias: bool,
    /// Mistral's sliding attention window in tokens; `None` attends to the whole prefix.
    pub sliding_window: Option<u64>,
}

/// What OPT adds to the common dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptLayout {
    /// Width of the token embeddings; when it differs from the hidden size the decoder has
    /// `project_in` and `project_out` linear layers (no bias).
    pub word_embed_proj_dim: u64,
    /// Pre-norm (`true`) or OPT-350m's post-norm layers (`false`).
    pub do_layer_norm_before: bool,
    /// Whether the decoder ends in `final_layer_norm` (pre-norm models that did not remove it).
    pub final_layer_norm: bool,
    /// Whether attention and MLP linears have biases (`enable_bias`).
    pub enable_bias: bool,
}

/// The family of a model, with what only that family has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model_type", rename_all = "snake_case")]
pub enum Architecture {
    /// GPT-2: learned positions, pre-norm LayerNorm, packed Conv1D attention, GELU MLP.
    Gpt2,
    /// LLaMA: RoPE, RMSNorm, grouped KV heads, SwiGLU MLP.
    Llama(LlamaLayout),
    /// Mistral: LLaMA with an optional sliding attention window.
    Mistral(LlamaLayout),
    /// OPT: learned positions offset by 2, LayerNorm, ReLU MLP, biases.
    Opt(OptLayout),
}

/// A model's architecture, normalized across families, with transformers' defaults applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// The preset name, or the config's path.
    pub name: String,
    /// The family and what is specific to it.
    pub architecture: Architecture,
    /// Rows of the token embedding.
    pub vocab_size: u64,
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Transformer layers.
    pub num_layers: u64,
    /// Query heads.
    pub num_heads: u64,
    /// Key/value heads (equal to `num_heads` without grouped-query attention).
    pub num_kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: u64,
    /// Longest sequence the model was trained for; a hard limit for learned positions.
    pub max_position_embeddings: u64,
    /// Epsilon of every LayerNorm or RMSNorm.
    pub norm_eps: f64,
    /// The MLP activation.
    pub activation: Activation,
    /// Whether `lm_head.weight` is the token embedding.
    pub tie_word_embeddings: bool,
    /// The embedding row `nn.Embedding(padding_idx=...)` keeps out of the lookup's gradient
    /// (`pad_token_id` for LLaMA, Mistral and OPT; GPT-2 has none).
    pub padding_idx: Option<u64>,
    /// Standard deviation of the normal initialisation (`initializer_range`; OPT's `init_std`).
    pub initializer_range: f64,
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` text; `from` names it in errors and becomes the
    /// config's [`name`](Self::name).
    pub fn from_json(text: &str, from: ConfigSource) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| invalid_json(&from, &e))?;
        let Value::Object(map) = &value else {
            return Err(ModelError::NotAnObject {
                found: kind_of(&value).to_string(),
                from,
            });
        };
        let model_type = match map.get("model_type") {
            None | Some(Value::Null) => return Err(ModelError::MissingModelType { from }),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(ModelError::InvalidField {
                    from,
                    field: "model_type".into(),
                    expected: "a string".into(),
                    found: other.to_string(),
                })
            }
        };
        let Some(&model_type) = SUPPORTED_MODEL_TYPES.iter().find(|t| **t == model_type) else {
            return Err(ModelError::UnknownModelType {
                model_type: model_type.to_string(),
                from,
            });
        };
        let fields = Fields {
            map,
            from: &from,
            model_type,
        };
        match model_type {
            "gpt2" => parse_gpt2(&fields),
            "llama" | "mistral" => parse_llama(&fields),
            _ => parse_opt(&fields),
        }
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => ModelError::FileMissing { path: path.into() },
            _ => ModelError::Io {
                path: path.into(),
                error,
            },
        })?;
        Self::from_json(&text, ConfigSource::File(path.into()))
    }

    /// The transformers `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self.architecture {
            Architecture::Gpt2 => "gpt2",
            Architecture::Llama(_) => "llama",
            Architecture::Mistral(_) => "mistral",
            Architecture::Opt(_) => "opt",
        }
    }

    /// The number of learned position rows a sequence may use, for models with learned
    /// positions (GPT-2, OPT); `None` for rotary models, whose positions are computed.
    pub fn learned_positions(&self) -> Option<u64> {
        match self.architecture {
            Architecture::Gpt2 | Architecture::Opt(_) => Some(self.max_position_embeddings),
            Architecture::Llama(_) | Architecture::Mistral(_) => None,
        }
    }
}

fn invalid_json(from: &ConfigSource, e: &serde_json::Error) -> ModelError {
    let (line, column) = (e.line(), e.column());
    let text = e.to_string();
    let suffix = format!(" at line {line} column {column}");
    let message = text.strip_suffix(&suffix).unwrap_or(&text).to_string();
    ModelError::InvalidJson {
        from: from.clone(),
        line,
        column,
        message,
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed, range-checked access to a config object's fields, with errors that name the field.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    from: &'a ConfigSource,
    model_type: &'static str,
}

impl<'a> Fields<'a> {
    /// The field's value, `None` when absent or `null`.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    /// The first of `names` that is present and not `null`, with the name it was found under.
    fn get_any(&self, names: &[&'static str]) -> Option<(&'static str, &'a Value)> {
        names.iter().find_map(|n| self.get(n).map(|v| (*n, v)))
    }

    /// The config's name: the preset's name or the file's path.
    fn name(&self) -> String {
        match self.from {
            ConfigSource::Preset(name) | ConfigSource::Text(name) => name.clone(),
            ConfigSource::File(path) => path.display().to_string(),
        }
    }

    fn invalid(&self, field: &str, expected: &str, found: &Value) -> ModelError {
        ModelError::InvalidField {
            from: self.from.clone(),
            field: field.to_string(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    fn missing(&self, field: &'static str) -> ModelError {
        ModelError::MissingField {
            from: self.from.clone(),
            field,
            model_type: self.model_type,
        }
    }

    fn unsupported(&self, field: &str, value: &str, supported: &str) -> ModelError {
        ModelError::Unsupported {
            from: self.from.clone(),
            field: field.to_string(),
            value: value.to_string(),
            model_type: self.model_type,
            supported: supported.to_string(),
        }
    }

    /// A dimension in `1..=max`.
    fn check_dim(&self, field: &str, value: &Value, max: u64) -> Result<u64> {
        match value.as_u64() {
            Some(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(self.invalid(field, &format!("an integer from 1 to {max}"), value)),
        }
    }

    /// A required dimension, found under the first of `names` present (transformers'
    /// `attribute_map` aliases); errors name the first.
    fn dim(&self, names: &[&'static str]) -> Result<u64> {
        self.dim_with_max(names, MAX_DIM)
    }

    fn dim_with_max(&self, names: &[&'static str], max: u64) -> Result<u64> {
        match self.get_any(names) {
            Some((name, value)) => self.check_dim(name, value, max),
            None => Err(self.missing(names[0])),
        }
    }

    /// An optional dimension: `None` when absent or `null`.
    fn opt_dim(&self, name: &str) -> Result<Option<u64>> {
        self.get(name)
            .map(|v| self.check_dim(name, v, MAX_DIM))
            .transpose()
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(self.invalid(name, "true or false", other)),
        }
    }

    fn str_or(&self, name: &str, default: &'a str) -> Result<&'a str> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(self.invalid(name, "a string", other)),
        }
    }

    /// A float, positive when `positive`, else non-negative.
    fn check_float(&self, field: &str, value: &Value, positive: bool) -> Result<f64> {
        match value.as_f64() {
            Some(x) if x.is_finite() && (x > 0.0 || (!positive && x == 0.0)) => Ok(x),
            _ => Err(self.invalid(
                field,
                if positive {
                    "a positive number"
                } else {
                    "a non-negative number"
                },
                value,
            )),
        }
    }

    fn eps_or(&self, name: &str, default: f64) -> Result<f64> {
        self.get(name)
            .map_or(Ok(default), |v| self.check_float(name, v, false))
    }

    /// An MLP activation among `allowed` (transformers' names).
    fn activation(&self, name: &str, default: &str, allowed: &[Activation]) -> Result<Activation> {
        let value = self.str_or(name, default)?;
        let supported: Vec<&str> = Activation::NAMES
            .iter()
            .filter(|(_, a)| allowed.contains(a))
            .map(|(n, _)| *n)
            .collect();
        Activation::NAMES
            .iter()
            .find(|(n, a)| *n == value && allowed.contains(a))
            .map(|(_, a)| *a)
            .ok_or_else(|| self.unsupported(name, value, &supported.join(", ")))
    }

    /// `pad_token_id` as the embedding's `padding_idx`: negative ids count from the end, as
    /// `nn.Embedding` counts them.
    fn padding_idx(&self, vocab: u64) -> Result<Option<u64>> {
        let Some(value) = self.get("pad_token_id") else {
            return Ok(None);
        };
        let expected = format!("null or a token id in -{vocab}..{vocab}");
        let id = value
            .as_i64()
            .ok_or_else(|| self.invalid("pad_token_id", &expected, value))?;
        // vocab <= MAX_DIM, so the casts below are exact.
        let v = vocab as i64;
        match id {
            0.. if id < v => Ok(Some(id as u64)),
            ..0 if id >= -v => Ok(Some((v + id) as u64)),
            _ => Err(self.invalid("pad_token_id", &expected, value)),
        }
    }

    /// Checks `hidden % heads == 0` and returns `hidden / heads`.
    fn split_heads(&self, hidden: u64, heads: u64) -> Result<u64> {
        if !hidden.is_multiple_of(heads) {
            return Err(ModelError::HiddenNotDivisibleByHeads {
                from: self.from.clone(),
                hidden,
                heads,
            });
        }
        Ok(hidden / heads)
    }

    fn check_kv_heads(&self, heads: u64, kv_heads: u64) -> Result<()> {
        if !heads.is_multiple_of(kv_heads) {
            return Err(ModelError::HeadsNotDivisibleByKvHeads {
                from: self.from.clone(),
                heads,
                kv_heads,
            });
        }
        Ok(())
    }
}

/// `GPT2Config`; `hidden_size`, `num_hidden_layers`, `num_attention_heads` and
/// `max_position_embeddings` are accepted for the `n_*` names, as its `attribute_map` does.
fn parse_gpt2(f: &Fields) -> Result<ModelConfig> {
    let vocab = f.dim(&["vocab_size"])?;
    let hidden = f.dim(&["n_embd", "hidden_size"])?;
    let layers = f.dim_with_max(&["n_layer", "num_hidden_layers"], MAX_LAYERS)?;
    let heads = f.dim(&["n_head", "num_attention_heads"])?;
    let positions = f.dim(&["n_positions", "max_position_embeddings"])?;
    let head_dim = f.split_heads(hidden, heads)?;
    let inner = match f.opt_dim("n_inner")? {
        Some(n) => n,
        None => 4 * hidden,
    };
    let activation = f.activation(
        "activation_function",
        "gelu_new",
        &[Activation::GeluTanh, Activation::Relu, Activation::Silu],
    )?;
    // Options that change the computation in ways the IR's ops do not express.
    if !f.bool_or("scale_attn_weights", true)? {
        return Err(f.unsupported(
            "scale_attn_weights",
            "false",
            "true (scores scaled by 1/sqrt(head_dim))",
        ));
    }
    if f.bool_or("scale_attn_by_inverse_layer_idx", false)? {
        return Err(f.unsupported("scale_attn_by_inverse_layer_idx", "true", "false"));
    }
    if f.bool_or("add_cross_attention", false)? {
        return Err(f.unsupported("add_cross_attention", "true", "false (decoder-only models)"));
    }
    Ok(ModelConfig {
        name: f.name(),
        architecture: Architecture::Gpt2,
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim,
        intermediate_size: inner,
        max_position_embeddings: positions,
        norm_eps: f.eps_or("layer_norm_epsilon", 1e-5)?,
        activation,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
        padding_idx: None,
        initializer_range: f.eps_or("initializer_range", 0.02)?,
    })
}

/// `LlamaConfig` and `MistralConfig`, which differ in defaults and in Mistral's sliding window.
fn parse_llama(f: &Fields) -> Result<ModelConfig> {
    let mistral = f.model_type == "mistral";
    let vocab = f.dim(&["vocab_size"])?;
    let hidden = f.dim(&["hidden_size"])?;
    let intermediate = f.dim(&["intermediate_size"])?;
    let layers = f.dim_with_max(&["num_hidden_layers"], MAX_LAYERS)?;
    let heads = f.dim(&["num_attention_heads"])?;
    // LlamaConfig always requires hidden % heads == 0; MistralConfig only uses the quotient when
    // `head_dim` is not given.
    let head_dim = match f.opt_dim("head_dim")? {
        Some(d) if mistral => d,
        Some(d) => {
            f.split_heads(hidden, heads)?;
            d
        }
        None => f.split_heads(hidden, heads)?,
    };
    if head_dim % 2 != 0 {
        return Err(f.invalid(
            "head_dim",
            "even (rotary embeddings rotate pairs)",
            &head_dim.into(),
        ));
    }
    // MistralConfig's defaults are 8 KV heads and a 4096-token window when the field is absent,
    // while an explicit `null` means "as many as the heads" and "no window".
    let kv_heads = match f.map.get("num_key_value_heads") {
        None if mistral => 8,
        None | Some(Value::Null) => heads,
        Some(v) => f.check_dim("num_key_value_heads", v, MAX_DIM)?,
    };
    f.check_kv_heads(heads, kv_heads)?;
    let sliding_window = match f.map.get("sliding_window") {
        _ if !mistral => None,
        None => Some(4096),
        Some(Value::Null) => None,
        Some(v) => Some(f.check_dim("sliding_window", v, u64::MAX)?),
    };
    let max_positions =
        f.opt_dim("max_position_embeddings")?
            .unwrap_or(if mistral { 4096 * 32 } else { 2048 });
    f.activation("hidden_act", "silu", &[Activation::Silu])?;
    let (rope_theta, rope_scaling) = parse_rope(f, max_positions)?;
    let layout = LlamaLayout {
        rope_theta,
        rope_scaling,
        attention_bias: !mistral && f.bool_or("attention_bias", false)?,
        mlp_bias: !mistral && f.bool_or("mlp_bias", false)?,
        sliding_window,
    };
    Ok(ModelConfig {
        name: f.name(),
        architecture: if mistral {
            Architecture::Mistral(layout)
        } else {
            Architecture::Llama(layout)
        },
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        intermediate_size: intermediate,
        max_position_embeddings: max_positions,
        norm_eps: f.eps_or("rms_norm_eps", 1e-6)?,
        activation: Activation::Silu,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        padding_idx: f.padding_idx(vocab)?,
        initializer_range: f.eps_or("initializer_range", 0.02)?,
    })
}

/// The RoPE types this crate implements.
const ROPE_TYPES: &str = "default, linear, llama3";

/// RoPE settings as transformers' `RotaryEmbeddingConfigMixin` standardizes them: v4's
/// `rope_scaling` wins over v5's `rope_parameters`; `rope_theta` inside the dict wins over a
/// top-level one, which wins over the default 10000; `type` is the old name of `rope_type`;
/// llama3's `original_max_position_embeddings` falls back to a top-level field, then to
/// `max_position_embeddings`.
fn parse_rope(f: &Fields, max_positions: u64) -> Result<(f64, RopeScaling)> {
    let top_theta = match f.get("rope_theta") {
        Some(v) => f.check_float("rope_theta", v, true)?,
        None => 10_000.0,
    };
    let Some((field, params)) = f.get_any(&["rope_scaling", "rope_parameters"]) else {
        return Ok((top_theta, RopeScaling::None));
    };
    let Value::Object(params) = params else {
        return Err(f.invalid(
            field,
            "an object such as {\"rope_type\": \"default\"}",
            params,
        ));
    };
    if let Some((key, _)) = params.iter().find(|(_, v)| v.is_object()) {
        return Err(f.unsupported(
            field,
            &format!("per-layer-type settings ('{key}')"),
            "one set of RoPE settings for every layer",
        ));
    }
    let sub = |key: &str| params.get(key).filter(|v| !v.is_null());
    let path = |key: &str| format!("{field}.{key}");
    let theta = match sub("rope_theta") {
        Some(v) => f.check_float(&path("rope_theta"), v, true)?,
        None => top_theta,
    };
    if let Some(v) = sub("partial_rotary_factor").or_else(|| f.get("partial_rotary_factor")) {
        if v.as_f64() != Some(1.0) {
            return Err(f.unsupported(
                "partial_rotary_factor",
                &v.to_string(),
                "1.0 (rotate the whole head)",
            ));
        }
    }
    let rope_type = match sub("rope_type").or_else(|| sub("type")) {
        None => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(f.invalid(&path("rope_type"), "a string", other)),
    };
    let float = |key: &str| -> Result<f64> {
        match sub(key) {
            Some(v) => f.check_float(&path(key), v, true),
            None => Err(f.invalid(
                &path(key),
                &format!("a positive number (needed by rope_type '{rope_type}')"),
                &Value::Null,
            )),
        }
    };
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: float("factor")?,
        },
        "llama3" => {
            let original = match f.get("original_max_position_embeddings") {
                Some(v) => f.check_dim("original_max_position_embeddings", v, MAX_DIM)?,
                None => match sub("original_max_position_embeddings") {
                    Some(v) => {
                        f.check_dim(&path("original_max_position_embeddings"), v, MAX_DIM)?
                    }
                    None => max_positions,
                },
            };
            RopeScaling::Llama3 {
                factor: float("factor")?,
                low_freq_factor: float("low_freq_factor")?,
                high_freq_factor: float("high_freq_factor")?,
                original_max_position_embeddings: original,
            }
        }
        other => return Err(f.unsupported(&path("rope_type"), other, ROPE_TYPES)),
    };
    Ok((theta, scaling))
}

/// `OPTConfig`.
fn parse_opt(f: &Fields) -> Result<ModelConfig> {
    let vocab = f.dim(&["vocab_size"])?;
    let hidden = f.dim(&["hidden_size"])?;
    let ffn = f.dim(&["ffn_dim"])?;
    let layers = f.dim_with_max(&["num_hidden_layers"], MAX_LAYERS)?;
    let heads = f.dim(&["num_attention_heads"])?;
    let positions = f.dim(&["max_position_embeddings"])?;
    let head_dim = f.split_heads(hidden, heads)?;
    let word_embed_proj_dim = f.opt_dim("word_embed_proj_dim")?.unwrap_or(hidden);
    let do_layer_norm_before = f.bool_or("do_layer_norm_before", true)?;
    // OPTDecoder: `if config.do_layer_norm_before and not config._remove_final_layer_norm`.
    let final_layer_norm = do_layer_norm_before && !f.bool_or("_remove_final_layer_norm", false)?;
    if !f.bool_or("layer_norm_elementwise_affine", true)? {
        return Err(f.unsupported(
            "layer_norm_elementwise_affine",
            "false",
            "true (layer norms with weight and bias)",
        ));
    }
    let activation = f.activation(
        "activation_function",
        "relu",
        &[Activation::Relu, Activation::GeluTanh, Activation::Silu],
    )?;
    Ok(ModelConfig {
        name: f.name(),
        architecture: Architecture::Opt(OptLayout {
            word_embed_proj_dim,
            do_layer_norm_before,
            final_layer_norm,
            enable_bias: f.bool_or("enable_bias", true)?,
        }),
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim,
        intermediate_size: ffn,
        max_position_embeddings: positions,
        // nn.LayerNorm's default; OPTConfig has no field for it.
        norm_eps: 1e-5,
        activation,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
        // OPTConfig's pad_token_id defaults to 1.
        padding_idx: match f.map.get("pad_token_id") {
            None => Some(1).filter(|&p| p < vocab),
            Some(_) => f.padding_idx(vocab)?,
        },
        initializer_range: f.eps_or("init_std", 0.02)?,
    })
}
