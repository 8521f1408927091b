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
//! Each family's fields are a struct with derived `Deserialize` (GPT-2's `attribute_map` names
//! as serde aliases) whose field types check their values, so an error names the field's JSON
//! path (`rope_scaling.factor`), what it must be and what it is. A second step applies the
//! defaults and the checks that span fields.
//!
//! Parsing never panics: every number is range-checked before any arithmetic uses it.

mod gemma;
mod moe;
mod phi3;

pub use gemma::{GemmaLayout, LayerType, Rotary};
pub use moe::{MoeArchitecture, MoeLayout};
pub use phi3::{LongRope, Phi3Layout};

use crate::error::{ConfigSource, ModelError, Result};
use protrain_ir::RopeScaling;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// The `model_type` values this crate builds.
pub const SUPPORTED_MODEL_TYPES: [&str; 12] = [
    "gemma2",
    "gemma3_text",
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "opt",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
];

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
    /// Layers before this one attend to the whole prefix even with a window (Qwen2's
    /// `max_window_layers`: the window is on layers `i >= max_window_layers`).
    #[serde(default)]
    pub full_attention_layers: u64,
    /// Biases on the q, k and v projections only, not on `o_proj` (Qwen2).
    #[serde(default)]
    pub qkv_bias: bool,
    /// RMSNorms of the projected queries and keys (Qwen3, OLMo 2).
    #[serde(default)]
    pub qk_norm: QkNorm,
    /// Norms after attention and after the MLP, on the block outputs before each residual add,
    /// instead of before them (OLMo 2).
    #[serde(default)]
    pub post_norm: bool,
}

impl LlamaLayout {
    /// The attention window of layer `layer`.
    pub fn window_of(&self, layer: u64) -> Option<u64> {
        self.sliding_window
            .filter(|_| layer >= self.full_attention_layers)
    }
}

/// Where the queries and keys are RMS-normalised after their projections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// Not normalised.
    #[default]
    None,
    /// Each head separately, with a `[head_dim]` weight (Qwen3's `q_norm`, `k_norm`).
    PerHead,
    /// The whole projection, with a `[heads * head_dim]` weight (OLMo 2's).
    Whole,
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
    /// Qwen2 and Qwen2.5: LLaMA with q/k/v biases and windows on the upper layers.
    Qwen2(LlamaLayout),
    /// Qwen3: LLaMA with per-head q/k RMSNorm and an explicit `head_dim`.
    Qwen3(LlamaLayout),
    /// OLMo 2: LLaMA with norms after attention and MLP and q/k RMSNorm over the projection.
    Olmo2(LlamaLayout),
    /// OPT: learned positions offset by 2, LayerNorm, ReLU MLP, biases.
    Opt(OptLayout),
    /// Gemma 2: scaled embeddings, RMSNorms with a unit offset before and after attention and
    /// MLP, GeGLU, soft-capped attention scores and logits, sliding and global layers.
    Gemma2(GemmaLayout),
    /// Gemma 3 (text): Gemma 2 with per-head q/k RMSNorms instead of score soft-capping, and
    /// a RoPE base per layer type.
    #[serde(rename = "gemma3_text")]
    Gemma3(GemmaLayout),
    /// Mixtral: Mistral whose MLPs are mixtures of SwiGLU experts with renormalised top-k
    /// routing.
    Mixtral(MoeArchitecture),
    /// Qwen3-MoE: Qwen3 whose MLPs (all but `mlp_only_layers`, every `decoder_sparse_step`-th)
    /// are mixtures of experts.
    Qwen3Moe(MoeArchitecture),
    /// Phi-3: LLaMA with fused `qkv_proj` and `gate_up_proj` weights, LongRoPE, partial
    /// rotary embeddings and an optional window on every layer.
    Phi3(Phi3Layout),
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

/// The largest config file read: Hugging Face configs are a few KiB; this leaves room for
/// long `id2label` tables and refuses weights or data passed by mistake.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

impl ModelConfig {
    /// Parses a Hugging Face `config.json` text; `from` names it in errors and becomes the
    /// config's [`name`](Self::name).
    pub fn from_json(text: &str, from: ConfigSource) -> Result<Self> {
        // Parsed once into a `Value`: syntax errors keep their line and column, and the family
        // struct is chosen by `model_type` before the rest is read.
        let value: Value = serde_json::from_str(text).map_err(|e| invalid_json(&from, &e))?;
        if !value.is_object() {
            return Err(ModelError::NotAnObject {
                found: kind_of(&value).to_string(),
                from,
            });
        }
        let head: Head = typed(&value, &from)?;
        let Some(Text(model_type)) = head.model_type else {
            return Err(ModelError::MissingModelType { from });
        };
        let Some(&model_type) = SUPPORTED_MODEL_TYPES.iter().find(|t| **t == model_type) else {
            return Err(ModelError::UnknownModelType { model_type, from });
        };
        let context = Context {
            from: &from,
            model_type,
        };
        match model_type {
            "gpt2" => typed::<Gpt2Json>(&value, &from)?.into_config(&context),
            "llama" | "mistral" | "qwen2" | "qwen3" | "olmo2" | "mixtral" | "qwen3_moe" => {
                typed::<RotaryJson>(&value, &from)?.into_config(&context)
            }
            "gemma2" | "gemma3_text" => {
                typed::<gemma::GemmaJson>(&value, &from)?.into_config(&context)
            }
            "phi3" => typed::<phi3::Phi3Json>(&value, &from)?.into_config(&context),
            _ => typed::<OptJson>(&value, &from)?.into_config(&context),
        }
    }

    /// Reads and parses a `config.json` file.
    ///
    /// Refuses, before reading, anything but a regular file (a FIFO or `/dev/zero` would be
    /// read until memory runs out) and files over [`MAX_CONFIG_BYTES`]; it reads at most that
    /// many bytes even if the file grows meanwhile.
    pub fn from_file(path: &Path) -> Result<Self> {
        use std::io::Read;
        let io = |error: std::io::Error| match error.kind() {
            std::io::ErrorKind::NotFound => ModelError::FileMissing { path: path.into() },
            _ => ModelError::Io {
                path: path.into(),
                error,
            },
        };
        let not_config = |problem: String| ModelError::NotAConfigFile {
            path: path.into(),
            problem,
        };
        // Stat before opening: opening a FIFO blocks until something writes to it.
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(not_config(
                "is not a regular file (a device, FIFO or socket); give a Hugging Face \
                 config.json, a directory holding one, or a preset name"
                    .into(),
            ));
        }
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(not_config(format!(
                "is {} bytes, but a model config is a few KiB of JSON (at most {} MiB here); \
                 give the model's config.json, not its weights",
                meta.len(),
                MAX_CONFIG_BYTES >> 20
            )));
        }
        let file = std::fs::File::open(path).map_err(io)?;
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(not_config(format!(
                "grew past {} MiB while being read; a model config is a few KiB of JSON",
                MAX_CONFIG_BYTES >> 20
            )));
        }
        Self::from_json(&text, ConfigSource::File(path.into()))
    }

    /// The transformers `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self.architecture {
            Architecture::Gpt2 => "gpt2",
            Architecture::Llama(_) => "llama",
            Architecture::Mistral(_) => "mistral",
            Architecture::Qwen2(_) => "qwen2",
            Architecture::Qwen3(_) => "qwen3",
            Architecture::Olmo2(_) => "olmo2",
            Architecture::Opt(_) => "opt",
            Architecture::Gemma2(_) => "gemma2",
            Architecture::Gemma3(_) => "gemma3_text",
            Architecture::Mixtral(_) => "mixtral",
            Architecture::Qwen3Moe(_) => "qwen3_moe",
            Architecture::Phi3(_) => "phi3",
        }
    }

    /// The number of learned position rows a sequence may use, for models with learned
    /// positions (GPT-2, OPT); `None` for rotary models, whose positions are computed.
    pub fn learned_positions(&self) -> Option<u64> {
        match self.architecture {
            Architecture::Gpt2 | Architecture::Opt(_) => Some(self.max_position_embeddings),
            Architecture::Llama(_)
            | Architecture::Mistral(_)
            | Architecture::Qwen2(_)
            | Architecture::Qwen3(_)
            | Architecture::Olmo2(_)
            | Architecture::Mixtral(_)
            | Architecture::Qwen3Moe(_)
            | Architecture::Gemma2(_)
            | Architecture::Gemma3(_)
            | Architecture::Phi3(_) => None,
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

/// Deserializes `value` as `T`; an error names the JSON path of the field at fault.
fn typed<'a, T: Deserialize<'a>>(value: &'a Value, from: &ConfigSource) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        let message = e.inner().to_string();
        if let Some(name) = message
            .strip_prefix("duplicate field `")
            .and_then(|m| m.strip_suffix('`'))
        {
            return ModelError::DuplicateField {
                from: from.clone(),
                field: name.to_string(),
            };
        }
        // serde's own type errors ("invalid type: sequence, expected an object ...") read
        // like the field types' ("must be ..., found ...").
        let problem = match message
            .strip_prefix("invalid type: ")
            .and_then(|m| m.split_once(", expected "))
        {
            Some((found, expected)) => {
                let found = match found {
                    "sequence" => "an array",
                    "map" => "an object",
                    other => other,
                };
                must_be(expected, found)
            }
            None => message,
        };
        ModelError::InvalidField {
            from: from.clone(),
            field,
            problem,
        }
    })
}

/// The text of an [`ModelError::InvalidField`]: what a field must be and what it is.
fn must_be(expected: &str, found: impl fmt::Display) -> String {
    format!("must be {expected}, found {found}")
}

// ----- Field types: each accepts any JSON value and checks it, so that a wrong value gets a
// message saying what the field must be and what it is (as JSON), at the field's path.

/// Takes the field's JSON value and checks it with `check`, which returns the field's value
/// or what the field must be.
fn checked<'de, D, T>(d: D, check: impl FnOnce(&Value) -> Result<T, String>) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    let value = Value::deserialize(d)?;
    check(&value).map_err(|expected| D::Error::custom(must_be(&expected, &value)))
}

/// A dimension: an integer from 1 to `MAX`.
#[derive(Clone, Copy)]
struct Dim<const MAX: u64 = MAX_DIM>(u64);

impl<'de, const MAX: u64> Deserialize<'de> for Dim<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| match v.as_u64() {
            Some(n) if (1..=MAX).contains(&n) => Ok(Dim(n)),
            _ => Err(format!("an integer from 1 to {MAX}")),
        })
    }
}

/// A layer count.
type Layers = Dim<MAX_LAYERS>;

/// `true` or `false`.
#[derive(Clone, Copy)]
struct Flag(bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| v.as_bool().map(Flag).ok_or("true or false".into()))
    }
}

/// A string.
struct Text(String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| {
            v.as_str()
                .map(|s| Text(s.to_string()))
                .ok_or("a string".into())
        })
    }
}

/// A finite number `>= 0` (epsilons, standard deviations).
#[derive(Clone, Copy)]
struct NonNegative(f64);

impl<'de> Deserialize<'de> for NonNegative {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| match v.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(NonNegative(x)),
            _ => Err("a non-negative number".into()),
        })
    }
}

/// A finite number `> 0` (RoPE bases and factors).
#[derive(Clone, Copy)]
struct Positive(f64);

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Positive(x)),
            _ => Err("a positive number".into()),
        })
    }
}

/// Any number, kept as written (for messages).
struct Number(serde_json::Number);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked(d, |v| match v {
            Value::Number(n) => Ok(Number(n.clone())),
            _ => Err("a number".into()),
        })
    }
}

/// A field whose absence and `null` mean different things (MistralConfig's
/// `num_key_value_heads` and `sliding_window`, OPTConfig's `pad_token_id`): the class's default
/// when absent, "none" when `null`. Use with `#[serde(default)]`.
#[derive(Default)]
enum Given<T> {
    #[default]
    Absent,
    Null,
    Value(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Given<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.map_or(Given::Null, Given::Value))
    }
}

// ----- What each family reads. Every field is optional at this level (absent and `null` are
// `None`); the conversions below apply transformers' defaults and require the dimensions.

/// The field every config has.
#[derive(Deserialize)]
struct Head {
    model_type: Option<Text>,
}

/// `GPT2Config`; `hidden_size`, `num_hidden_layers`, `num_attention_heads` and
/// `max_position_embeddings` are accepted for the `n_*` names, as its `attribute_map` does.
#[derive(Deserialize)]
struct Gpt2Json {
    vocab_size: Option<Dim>,
    #[serde(alias = "hidden_size")]
    n_embd: Option<Dim>,
    #[serde(alias = "num_hidden_layers")]
    n_layer: Option<Layers>,
    #[serde(alias = "num_attention_heads")]
    n_head: Option<Dim>,
    #[serde(alias = "max_position_embeddings")]
    n_positions: Option<Dim>,
    n_inner: Option<Dim>,
    activation_function: Option<Text>,
    layer_norm_epsilon: Option<NonNegative>,
    tie_word_embeddings: Option<Flag>,
    initializer_range: Option<NonNegative>,
    scale_attn_weights: Option<Flag>,
    scale_attn_by_inverse_layer_idx: Option<Flag>,
    add_cross_attention: Option<Flag>,
}

/// `LlamaConfig` and `MistralConfig`, which read the same fields but for LLaMA's biases and
/// Mistral's window. Each field is type-checked even where the other family ignores it.
#[derive(Deserialize)]
struct RotaryJson {
    vocab_size: Option<Dim>,
    hidden_size: Option<Dim>,
    intermediate_size: Option<Dim>,
    num_hidden_layers: Option<Layers>,
    num_attention_heads: Option<Dim>,
    #[serde(default)]
    num_key_value_heads: Given<Dim>,
    head_dim: Option<Dim>,
    max_position_embeddings: Option<Dim>,
    hidden_act: Option<Text>,
    rms_norm_eps: Option<NonNegative>,
    tie_word_embeddings: Option<Flag>,
    initializer_range: Option<NonNegative>,
    /// Checked against the vocabulary once it is known.
    #[serde(default)]
    pad_token_id: Given<Value>,
    rope_theta: Option<Positive>,
    rope_scaling: Option<RopeJson>,
    rope_parameters: Option<RopeJson>,
    partial_rotary_factor: Option<Number>,
    original_max_position_embeddings: Option<Dim>,
    /// LLaMA only.
    attention_bias: Option<Flag>,
    /// LLaMA only.
    mlp_bias: Option<Flag>,
    /// Mistral, Qwen2 and Qwen3.
    #[serde(default)]
    sliding_window: Given<Dim<{ u64::MAX }>>,
    /// Qwen2 and Qwen3: whether `sliding_window` applies at all.
    use_sliding_window: Option<Flag>,
    /// Qwen2 and Qwen3: layers below this one have no window.
    max_window_layers: Option<Dim<{ u64::MAX }>>,
    /// Qwen2 and Qwen3: `full_attention` or `sliding_attention` per layer.
    layer_types: Option<Vec<Text>>,
    /// Mixtral and Qwen3-MoE: the experts and their router.
    #[serde(flatten)]
    moe: moe::MoeJson,
}

/// v4's `rope_scaling` or v5's `rope_parameters`.
#[derive(Deserialize)]
#[serde(expecting = "an object such as {\"rope_type\": \"default\"}")]
struct RopeJson {
    rope_type: Option<Text>,
    /// v4's old name of `rope_type`.
    #[serde(rename = "type")]
    old_type: Option<Text>,
    rope_theta: Option<Positive>,
    partial_rotary_factor: Option<Number>,
    factor: Option<Positive>,
    low_freq_factor: Option<Positive>,
    high_freq_factor: Option<Positive>,
    original_max_position_embeddings: Option<Dim>,
    /// YaRN's multiplier of cos and sin, when given.
    attention_factor: Option<Positive>,
    /// YaRN's ramp bounds (`None` or 0 take 32 and 1, as transformers' `or` does).
    beta_fast: Option<NonNegative>,
    beta_slow: Option<NonNegative>,
    /// YaRN's attention-factor scalars.
    mscale: Option<NonNegative>,
    mscale_all_dim: Option<NonNegative>,
    /// YaRN: whether the ramp's ends are rounded out (default true).
    truncate: Option<Flag>,
    /// Every other key: an object among them means per-layer-type settings.
    #[serde(flatten)]
    others: BTreeMap<String, Value>,
}

/// `OPTConfig`.
#[derive(Deserialize)]
struct OptJson {
    vocab_size: Option<Dim>,
    hidden_size: Option<Dim>,
    ffn_dim: Option<Dim>,
    num_hidden_layers: Option<Layers>,
    num_attention_heads: Option<Dim>,
    max_position_embeddings: Option<Dim>,
    word_embed_proj_dim: Option<Dim>,
    do_layer_norm_before: Option<Flag>,
    #[serde(rename = "_remove_final_layer_norm")]
    remove_final_layer_norm: Option<Flag>,
    layer_norm_elementwise_affine: Option<Flag>,
    activation_function: Option<Text>,
    enable_bias: Option<Flag>,
    tie_word_embeddings: Option<Flag>,
    /// Checked against the vocabulary once it is known.
    #[serde(default)]
    pad_token_id: Given<Value>,
    init_std: Option<NonNegative>,
}

// ----- From what a config says to a ModelConfig: defaults, derived fields, cross-field checks.

/// What the conversions need for their errors.
struct Context<'a> {
    from: &'a ConfigSource,
    model_type: &'static str,
}

impl Context<'_> {
    /// The config's name: the preset's name or the file's path.
    fn name(&self) -> String {
        match self.from {
            ConfigSource::Preset(name) | ConfigSource::Text(name) => name.clone(),
            ConfigSource::File(path) => path.display().to_string(),
        }
    }

    fn invalid(&self, field: &str, expected: &str, found: impl fmt::Display) -> ModelError {
        ModelError::InvalidField {
            from: self.from.clone(),
            field: field.to_string(),
            problem: must_be(expected, found),
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

    /// A required dimension's value; a missing one is named `field`.
    fn required<const MAX: u64>(&self, dim: Option<Dim<MAX>>, field: &'static str) -> Result<u64> {
        dim.map(|d| d.0).ok_or_else(|| ModelError::MissingField {
            from: self.from.clone(),
            field,
            model_type: self.model_type,
        })
    }

    /// An MLP activation among `allowed` (transformers' names); `default` when not given.
    fn activation(
        &self,
        field: &str,
        value: Option<&Text>,
        default: &str,
        allowed: &[Activation],
    ) -> Result<Activation> {
        let value = value.map_or(default, |t| t.0.as_str());
        let supported: Vec<&str> = Activation::NAMES
            .iter()
            .filter(|(_, a)| allowed.contains(a))
            .map(|(n, _)| *n)
            .collect();
        Activation::NAMES
            .iter()
            .find(|(n, a)| *n == value && allowed.contains(a))
            .map(|(_, a)| *a)
            .ok_or_else(|| self.unsupported(field, value, &supported.join(", ")))
    }

    /// `pad_token_id` as the embedding's `padding_idx`: negative ids count from the end, as
    /// `nn.Embedding` counts them.
    fn padding_idx(&self, value: &Value, vocab: u64) -> Result<u64> {
        let expected = format!("null or a token id in -{vocab}..{vocab}");
        let id = value
            .as_i64()
            .ok_or_else(|| self.invalid("pad_token_id", &expected, value))?;
        // vocab <= MAX_DIM, so the casts below are exact.
        let v = vocab as i64;
        match id {
            0.. if id < v => Ok(id as u64),
            ..0 if id >= -v => Ok((v + id) as u64),
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

/// The value of an optional flag.
fn flag(value: Option<Flag>, default: bool) -> bool {
    value.map_or(default, |f| f.0)
}

/// The value of an optional epsilon or standard deviation.
fn non_negative(value: Option<NonNegative>, default: f64) -> f64 {
    value.map_or(default, |x| x.0)
}

impl Gpt2Json {
    fn into_config(self, c: &Context) -> Result<ModelConfig> {
        let vocab = c.required(self.vocab_size, "vocab_size")?;
        let hidden = c.required(self.n_embd, "n_embd")?;
        let layers = c.required(self.n_layer, "n_layer")?;
        let heads = c.required(self.n_head, "n_head")?;
        let positions = c.required(self.n_positions, "n_positions")?;
        let head_dim = c.split_heads(hidden, heads)?;
        let inner = self.n_inner.map_or(4 * hidden, |d| d.0);
        let activation = c.activation(
            "activation_function",
            self.activation_function.as_ref(),
            "gelu_new",
            &[Activation::GeluTanh, Activation::Relu, Activation::Silu],
        )?;
        // Options that change the computation in ways the IR's ops do not express.
        if !flag(self.scale_attn_weights, true) {
            return Err(c.unsupported(
                "scale_attn_weights",
                "false",
                "true (scores scaled by 1/sqrt(head_dim))",
            ));
        }
        if flag(self.scale_attn_by_inverse_layer_idx, false) {
            return Err(c.unsupported("scale_attn_by_inverse_layer_idx", "true", "false"));
        }
        if flag(self.add_cross_attention, false) {
            return Err(c.unsupported(
                "add_cross_attention",
                "true",
                "false (decoder-only models)",
            ));
        }
        Ok(ModelConfig {
            name: c.name(),
            architecture: Architecture::Gpt2,
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim,
            intermediate_size: inner,
            max_position_embeddings: positions,
            norm_eps: non_negative(self.layer_norm_epsilon, 1e-5),
            activation,
            tie_word_embeddings: flag(self.tie_word_embeddings, true),
            padding_idx: None,
            initializer_range: non_negative(self.initializer_range, 0.02),
        })
    }
}

/// The RoPE types this crate implements for the LLaMA-like families.
const ROPE_TYPES: &str = "default, linear, llama3, yarn";

impl RotaryJson {
    fn into_config(self, c: &Context) -> Result<ModelConfig> {
        let family = c.model_type;
        let mistral = matches!(family, "mistral" | "mixtral");
        let qwen = matches!(family, "qwen2" | "qwen3");
        let vocab = c.required(self.vocab_size, "vocab_size")?;
        let hidden = c.required(self.hidden_size, "hidden_size")?;
        let intermediate = c.required(self.intermediate_size, "intermediate_size")?;
        let layers = c.required(self.num_hidden_layers, "num_hidden_layers")?;
        let heads = c.required(self.num_attention_heads, "num_attention_heads")?;
        // LlamaConfig always requires hidden % heads == 0; the others only use the quotient
        // when `head_dim` is not given, and Qwen3Config's default is 128.
        let head_dim = match self.head_dim {
            Some(Dim(d)) if family != "llama" => d,
            Some(Dim(d)) => {
                c.split_heads(hidden, heads)?;
                d
            }
            None if family == "qwen3" => 128,
            None => c.split_heads(hidden, heads)?,
        };
        if head_dim % 2 != 0 {
            return Err(c.invalid(
                "head_dim",
                "even (rotary embeddings rotate pairs)",
                head_dim,
            ));
        }
        // MistralConfig's default is 8 KV heads and Qwen's 32 when the field is absent, while an
        // explicit `null` means "as many as the heads".
        let kv_heads = match self.num_key_value_heads {
            Given::Absent if mistral => 8,
            Given::Absent if family == "qwen3_moe" => 4,
            Given::Absent if qwen => 32,
            Given::Absent | Given::Null => heads,
            Given::Value(Dim(n)) => n,
        };
        c.check_kv_heads(heads, kv_heads)?;
        let (sliding_window, full_attention_layers) = self.window(c, layers)?;
        let max_positions = self.max_position_embeddings.map_or(
            match family {
                "mistral" | "mixtral" => 4096 * 32,
                "qwen2" | "qwen3" | "qwen3_moe" => 32768,
                _ => 2048,
            },
            |d| d.0,
        );
        c.activation(
            "hidden_act",
            self.hidden_act.as_ref(),
            "silu",
            &[Activation::Silu],
        )?;
        let (rope_theta, rope_scaling) = self.rope(c, max_positions)?;
        // Qwen2 always has q/k/v biases and reads neither flag; Mistral reads neither either.
        let reads_biases = matches!(family, "llama" | "qwen3" | "olmo2" | "qwen3_moe");
        let layout = LlamaLayout {
            rope_theta,
            rope_scaling,
            attention_bias: reads_biases && flag(self.attention_bias, false),
            mlp_bias: family == "llama" && flag(self.mlp_bias, false),
            sliding_window,
            full_attention_layers,
            qkv_bias: family == "qwen2",
            qk_norm: match family {
                "qwen3" | "qwen3_moe" => QkNorm::PerHead,
                "olmo2" => QkNorm::Whole,
                _ => QkNorm::None,
            },
            post_norm: family == "olmo2",
        };
        // OLMo2Config's pad_token_id defaults to 1.
        let padding_idx = match &self.pad_token_id {
            Given::Absent if family == "olmo2" => Some(1).filter(|&p| p < vocab),
            Given::Absent | Given::Null => None,
            Given::Value(id) => Some(c.padding_idx(id, vocab)?),
        };
        Ok(ModelConfig {
            name: c.name(),
            architecture: match family {
                "mistral" => Architecture::Mistral(layout),
                "qwen2" => Architecture::Qwen2(layout),
                "qwen3" => Architecture::Qwen3(layout),
                "olmo2" => Architecture::Olmo2(layout),
                "mixtral" => Architecture::Mixtral(MoeArchitecture {
                    layout,
                    moe: self.moe.into_layout(c, layers, intermediate)?,
                }),
                "qwen3_moe" => Architecture::Qwen3Moe(MoeArchitecture {
                    layout,
                    moe: self.moe.into_layout(c, layers, intermediate)?,
                }),
                _ => Architecture::Llama(layout),
            },
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            intermediate_size: intermediate,
            max_position_embeddings: max_positions,
            norm_eps: non_negative(
                self.rms_norm_eps,
                if matches!(family, "olmo2" | "mixtral") {
                    1e-5
                } else {
                    1e-6
                },
            ),
            activation: Activation::Silu,
            tie_word_embeddings: flag(self.tie_word_embeddings, false),
            padding_idx,
            initializer_range: non_negative(self.initializer_range, 0.02),
        })
    }

    /// The attention window and the layers below it that have none, as each family's config
    /// class reads them. Mistral: `sliding_window` (4096 when absent, none when `null`) on
    /// every layer. Qwen2 and Qwen3: none unless `use_sliding_window`, then `sliding_window`
    /// (4096 when absent) on the layers `layer_types` marks `sliding_attention`, by default
    /// those at or above `max_window_layers` (28). LLaMA and OLMo 2 read no window.
    fn window(&self, c: &Context, layers: u64) -> Result<(Option<u64>, u64)> {
        let size = |absent: Option<u64>| match self.sliding_window {
            Given::Absent => absent,
            Given::Null => None,
            Given::Value(Dim(w)) => Some(w),
        };
        match c.model_type {
            "mistral" => Ok((size(Some(4096)), 0)),
            // MixtralConfig's window is none unless given.
            "mixtral" => Ok((size(None), 0)),
            "qwen3_moe" if flag(self.use_sliding_window, false) => Err(c.unsupported(
                "use_sliding_window",
                "true",
                "false (Qwen3-MoE's attention windows are not built)",
            )),
            "qwen2" | "qwen3" => {
                let window = size(Some(4096)).filter(|_| flag(self.use_sliding_window, false));
                let Some(types) = &self.layer_types else {
                    let below = self.max_window_layers.map_or(28, |d| d.0).min(layers);
                    return Ok((window, below));
                };
                if types.len() as u64 != layers {
                    return Err(c.invalid(
                        "layer_types",
                        &format!("a list of {layers} layer types (one per layer)"),
                        format!("{} entries", types.len()),
                    ));
                }
                // Full layers first, then windowed ones: the one pattern Qwen's configs make.
                let full = types.iter().take_while(|t| t.0 == "full_attention").count();
                if let Some((i, t)) = types
                    .iter()
                    .enumerate()
                    .skip(full)
                    .find(|(_, t)| t.0 != "sliding_attention")
                {
                    return Err(c.unsupported(
                        "layer_types",
                        &format!("{} at layer {i}", t.0),
                        "full_attention layers followed by sliding_attention layers",
                    ));
                }
                Ok((window, full as u64))
            }
            _ => Ok((None, 0)),
        }
    }

    /// RoPE settings as transformers' `RotaryEmbeddingConfigMixin` standardizes them: v4's
    /// `rope_scaling` wins over v5's `rope_parameters`; `rope_theta` inside the dict wins over
    /// a top-level one, which wins over the default 10000; `type` is the old name of
    /// `rope_type`; llama3's `original_max_position_embeddings` is the top-level field, else
    /// the dict's, else `max_position_embeddings`.
    fn rope(&self, c: &Context, max_positions: u64) -> Result<(f64, RopeScaling)> {
        // MixtralConfig's `default_theta` is 1e6; the others' 1e4.
        let default_theta = if c.model_type == "mixtral" {
            1_000_000.0
        } else {
            10_000.0
        };
        let top_theta = self.rope_theta.as_ref().map_or(default_theta, |t| t.0);
        let (field, params) = match (&self.rope_scaling, &self.rope_parameters) {
            (Some(params), _) => ("rope_scaling", params),
            (None, Some(params)) => ("rope_parameters", params),
            (None, None) => {
                // transformers reads a top-level factor without any RoPE dict too.
                check_partial_rotary(c, self.partial_rotary_factor.as_ref())?;
                return Ok((top_theta, RopeScaling::None));
            }
        };
        if let Some((key, _)) = params.others.iter().find(|(_, v)| v.is_object()) {
            return Err(c.unsupported(
                field,
                &format!("per-layer-type settings ('{key}')"),
                "one set of RoPE settings for every layer",
            ));
        }
        let path = |key: &str| format!("{field}.{key}");
        let theta = params.rope_theta.as_ref().map_or(top_theta, |t| t.0);
        let partial = params
            .partial_rotary_factor
            .as_ref()
            .or(self.partial_rotary_factor.as_ref());
        check_partial_rotary(c, partial)?;
        let rope_type = match params.rope_type.as_ref().or(params.old_type.as_ref()) {
            Some(Text(t)) => t.as_str(),
            None => "default",
        };
        let float = |key: &str, value: &Option<Positive>| -> Result<f64> {
            value.as_ref().map(|x| x.0).ok_or_else(|| {
                c.invalid(
                    &path(key),
                    &format!("a positive number (needed by rope_type '{rope_type}')"),
                    Value::Null,
                )
            })
        };
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: float("factor", &params.factor)?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: float("factor", &params.factor)?,
                low_freq_factor: float("low_freq_factor", &params.low_freq_factor)?,
                high_freq_factor: float("high_freq_factor", &params.high_freq_factor)?,
                original_max_position_embeddings: self
                    .original_max_position_embeddings
                    .as_ref()
                    .or(params.original_max_position_embeddings.as_ref())
                    .map_or(max_positions, |d| d.0),
            },
            "yarn" => {
                let original = self
                    .original_max_position_embeddings
                    .as_ref()
                    .or(params.original_max_position_embeddings.as_ref())
                    .map_or(max_positions, |d| d.0);
                yarn(params, max_positions, original)
            }
            other => return Err(c.unsupported(&path("rope_type"), other, ROPE_TYPES)),
        };
        Ok((theta, scaling))
    }
}

/// YaRN's settings as `_compute_yarn_parameters` derives them: `factor` (else
/// `max_position_embeddings / original`), `beta_fast` 32 and `beta_slow` 1 when absent or 0,
/// `truncate` true, and the attention factor given, else `mscale(factor, mscale) /
/// mscale(factor, mscale_all_dim)` when both are given and non-zero, else `mscale(factor)`, with
/// `mscale(s, m) = 0.1 * m * ln(s) + 1` (1 for `s <= 1`).
fn yarn(params: &RopeJson, max_positions: u64, original: u64) -> RopeScaling {
    let factor = params
        .factor
        .as_ref()
        .map_or(max_positions as f64 / original as f64, |f| f.0);
    let mscale = |scale: f64, m: f64| match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    };
    let given = |x: &Option<NonNegative>| x.as_ref().map(|x| x.0).filter(|&x| x != 0.0);
    let attention_factor = match (
        &params.attention_factor,
        given(&params.mscale),
        given(&params.mscale_all_dim),
    ) {
        (Some(a), _, _) => a.0,
        (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
        (None, _, _) => mscale(factor, 1.0),
    };
    RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: given(&params.beta_fast).unwrap_or(32.0),
        beta_slow: given(&params.beta_slow).unwrap_or(1.0),
        truncate: flag(params.truncate, true),
        attention_factor,
    }
}

/// Refuses a `partial_rotary_factor` other than 1: transformers' modelling code of these
/// families applies cos and sin to the whole head (only Phi-3's rotates part of it), so a
/// smaller factor builds no model there either.
fn check_partial_rotary(c: &Context, partial: Option<&Number>) -> Result<()> {
    if let Some(Number(factor)) = partial {
        if factor.as_f64() != Some(1.0) {
            return Err(c.unsupported(
                "partial_rotary_factor",
                &factor.to_string(),
                "1.0 (transformers' modelling of this family rotates the whole head; \
                 Phi-3 is the family that rotates part of it)",
            ));
        }
    }
    Ok(())
}

impl OptJson {
    fn into_config(self, c: &Context) -> Result<ModelConfig> {
        let vocab = c.required(self.vocab_size, "vocab_size")?;
        let hidden = c.required(self.hidden_size, "hidden_size")?;
        let ffn = c.required(self.ffn_dim, "ffn_dim")?;
        let layers = c.required(self.num_hidden_layers, "num_hidden_layers")?;
        let heads = c.required(self.num_attention_heads, "num_attention_heads")?;
        let positions = c.required(self.max_position_embeddings, "max_position_embeddings")?;
        let head_dim = c.split_heads(hidden, heads)?;
        let word_embed_proj_dim = self.word_embed_proj_dim.map_or(hidden, |d| d.0);
        let do_layer_norm_before = flag(self.do_layer_norm_before, true);
        // OPTDecoder: `if config.do_layer_norm_before and not config._remove_final_layer_norm`.
        let final_layer_norm = do_layer_norm_before && !flag(self.remove_final_layer_norm, false);
        if !flag(self.layer_norm_elementwise_affine, true) {
            return Err(c.unsupported(
                "layer_norm_elementwise_affine",
                "false",
                "true (layer norms with weight and bias)",
            ));
        }
        let activation = c.activation(
            "activation_function",
            self.activation_function.as_ref(),
            "relu",
            &[Activation::Relu, Activation::GeluTanh, Activation::Silu],
        )?;
        // OPTConfig's pad_token_id defaults to 1.
        let padding_idx = match &self.pad_token_id {
            Given::Absent => Some(1).filter(|&p| p < vocab),
            Given::Null => None,
            Given::Value(id) => Some(c.padding_idx(id, vocab)?),
        };
        Ok(ModelConfig {
            name: c.name(),
            architecture: Architecture::Opt(OptLayout {
                word_embed_proj_dim,
                do_layer_norm_before,
                final_layer_norm,
                enable_bias: flag(self.enable_bias, true),
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
            tie_word_embeddings: flag(self.tie_word_embeddings, true),
            padding_idx,
            initializer_range: non_negative(self.init_std, 0.02),
        })
    }
}
