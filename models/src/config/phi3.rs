//! `Phi3Config` (`phi3`), read as transformers 5 reads it: `num_key_value_heads` defaults to
//! the heads, `rms_norm_eps` to 1e-5, `pad_token_id` to 32000, no window unless
//! `sliding_window` is given; RoPE from v4's `rope_scaling` or v5's `rope_parameters`
//! (`rope_theta` and `partial_rotary_factor` inside the dict win over the top-level ones), with
//! types `default` and `longrope` (`su` and `yarn` are old names of `longrope` for Phi-3, as
//! `Phi3Config` renames them); `original_max_position_embeddings` is the top-level field
//! (4096 when absent), which transformers puts above the dict's.

use super::{
    flag, non_negative, Activation, Architecture, Context, Dim, Flag, Given, Layers, ModelConfig,
    NonNegative, Number, Positive, Text,
};
use crate::error::Result;
use protrain_ir::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Phi-3's LongRoPE settings, for every sequence length (the op gets one length's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LongRope {
    /// Divisors of the inverse frequencies up to `original_max_position_embeddings` tokens.
    pub short_factor: Vec<f64>,
    /// Divisors beyond it.
    pub long_factor: Vec<f64>,
    /// The pre-training context: sequences longer than it use `long_factor`.
    pub original_max_position_embeddings: u64,
    /// The multiplier of cos and sin: the dict's `attention_factor`, else
    /// `sqrt(1 + ln(factor) / ln(original))` with `factor` the dict's or
    /// `max_position_embeddings / original` (1 when that factor is at most 1).
    pub attention_factor: f64,
}

/// What Phi-3 adds to the common dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phi3Layout {
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Rotated width of each head: `int(head_dim * partial_rotary_factor)`.
    pub rotary_dim: u64,
    /// LongRoPE, when the config asks for it.
    pub longrope: Option<LongRope>,
    /// The attention window of every layer; `None` attends to the whole prefix.
    pub sliding_window: Option<u64>,
}

impl Phi3Layout {
    /// The RoPE scaling of a `seq`-token sequence: LongRoPE's long factors beyond the original
    /// context, its short ones up to it (as transformers' `longrope_frequency_update` picks
    /// them from the largest position), or none.
    pub fn rope_scaling(&self, seq: u64) -> RopeScaling {
        match &self.longrope {
            None => RopeScaling::None,
            Some(l) => RopeScaling::LongRope {
                factors: if seq > l.original_max_position_embeddings {
                    l.long_factor.clone()
                } else {
                    l.short_factor.clone()
                },
                attention_factor: l.attention_factor,
            },
        }
    }

    /// What makes this Phi-3 what it is beyond its sizes, one `what: how` line each (for
    /// `protrain info`).
    pub fn features(&self, config: &ModelConfig) -> Vec<String> {
        let rope = match &self.longrope {
            None => String::new(),
            Some(l) => format!(
                ", longrope (short factors up to {} tokens, long beyond; cos and sin x{})",
                l.original_max_position_embeddings, l.attention_factor
            ),
        };
        let partial = match self.rotary_dim == config.head_dim {
            true => "whole head".to_string(),
            false => format!("first {} of {} per head", self.rotary_dim, config.head_dim),
        };
        vec![
            "norms: RMSNorm before attention and MLP".into(),
            "biases: none".into(),
            "projections: fused qkv_proj (q, k, v rows in order) and gate_up_proj (gate rows \
             first)"
                .into(),
            "mlp: SwiGLU (up * silu(gate))".into(),
            format!(
                "positions: RoPE theta {} ({partial}){rope}",
                self.rope_theta
            ),
            format!(
                "attention window: {}",
                self.sliding_window.map_or(
                    "none (every layer attends to the whole prefix)".to_string(),
                    |w| format!("{w} tokens on every layer")
                )
            ),
        ]
    }
}

/// `Phi3Config`.
#[derive(Deserialize)]
pub(super) struct Phi3Json {
    vocab_size: Option<Dim>,
    hidden_size: Option<Dim>,
    intermediate_size: Option<Dim>,
    num_hidden_layers: Option<Layers>,
    num_attention_heads: Option<Dim>,
    num_key_value_heads: Option<Dim>,
    head_dim: Option<Dim>,
    max_position_embeddings: Option<Dim>,
    original_max_position_embeddings: Option<Dim>,
    hidden_act: Option<Text>,
    rms_norm_eps: Option<NonNegative>,
    tie_word_embeddings: Option<Flag>,
    initializer_range: Option<NonNegative>,
    #[serde(default)]
    pad_token_id: Given<Value>,
    rope_theta: Option<Positive>,
    partial_rotary_factor: Option<Number>,
    rope_scaling: Option<Map<String, Value>>,
    rope_parameters: Option<Map<String, Value>>,
    #[serde(default)]
    sliding_window: Given<Dim<{ u64::MAX }>>,
}

impl Phi3Json {
    pub(super) fn into_config(self, c: &Context) -> Result<ModelConfig> {
        let vocab = c.required(self.vocab_size, "vocab_size")?;
        let hidden = c.required(self.hidden_size, "hidden_size")?;
        let intermediate = c.required(self.intermediate_size, "intermediate_size")?;
        let layers = c.required(self.num_hidden_layers, "num_hidden_layers")?;
        let heads = c.required(self.num_attention_heads, "num_attention_heads")?;
        // Phi3Attention reads `head_dim` when the config has one, else hidden / heads.
        let head_dim = match self.head_dim {
            Some(Dim(d)) => d,
            None => c.split_heads(hidden, heads)?,
        };
        let kv_heads = self.num_key_value_heads.map_or(heads, |d| d.0);
        c.check_kv_heads(heads, kv_heads)?;
        c.activation(
            "hidden_act",
            self.hidden_act.as_ref(),
            "silu",
            &[Activation::Silu],
        )?;
        let max_positions = self.max_position_embeddings.map_or(4096, |d| d.0);
        let (rope_theta, rotary_dim, longrope) = self.rope(c, head_dim, max_positions)?;
        let padding_idx = match &self.pad_token_id {
            Given::Absent => Some(32000).filter(|&p| p < vocab),
            Given::Null => None,
            Given::Value(id) => Some(c.padding_idx(id, vocab)?),
        };
        let layout = Phi3Layout {
            rope_theta,
            rotary_dim,
            longrope,
            sliding_window: match self.sliding_window {
                Given::Absent | Given::Null => None,
                Given::Value(Dim(w)) => Some(w),
            },
        };
        Ok(ModelConfig {
            name: c.name(),
            architecture: Architecture::Phi3(layout),
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            intermediate_size: intermediate,
            max_position_embeddings: max_positions,
            norm_eps: non_negative(self.rms_norm_eps, 1e-5),
            activation: Activation::Silu,
            tie_word_embeddings: flag(self.tie_word_embeddings, false),
            padding_idx,
            initializer_range: non_negative(self.initializer_range, 0.02),
        })
    }

    /// `(rope_theta, rotary_dim, longrope)` as `Phi3Config.convert_rope_params_to_dict` and
    /// `_compute_longrope_parameters` derive them.
    fn rope(
        &self,
        c: &Context,
        head_dim: u64,
        max_positions: u64,
    ) -> Result<(f64, u64, Option<LongRope>)> {
        let (field, params) = match (&self.rope_scaling, &self.rope_parameters) {
            (Some(p), _) => ("rope_scaling", p.clone()),
            (None, Some(p)) => ("rope_parameters", p.clone()),
            (None, None) => ("rope_parameters", Map::new()),
        };
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
        let theta = positive("rope_theta")?
            .or(self.rope_theta.map(|t| t.0))
            .unwrap_or(10_000.0);
        let partial = match params.get("partial_rotary_factor") {
            None | Some(Value::Null) => self
                .partial_rotary_factor
                .as_ref()
                .and_then(|n| n.0.as_f64())
                .unwrap_or(1.0),
            Some(_) => positive("partial_rotary_factor")?.unwrap_or(1.0),
        };
        let rotary_dim = rotary_dim(c, head_dim, partial)?;
        let rope_type = match params.get("rope_type").or(params.get("type")) {
            None | Some(Value::Null) => "default",
            Some(Value::String(s)) => s.as_str(),
            Some(other) => return Err(c.invalid(&path("rope_type"), "a string", other)),
        };
        match rope_type {
            "default" => return Ok((theta, rotary_dim, None)),
            "longrope" | "su" | "yarn" => {}
            other => {
                return Err(c.unsupported(
                    &path("rope_type"),
                    other,
                    "default, longrope (su and yarn are read as longrope, as Phi3Config does)",
                ))
            }
        }
        let factors = |key: &str| -> Result<Vec<f64>> {
            let expected = format!(
                "a list of {} positive numbers (rotary_dim / 2)",
                rotary_dim / 2
            );
            let value = params.get(key).unwrap_or(&Value::Null);
            let list: Option<Vec<f64>> = value.as_array().and_then(|a| {
                a.iter()
                    .map(|v| v.as_f64().filter(|x| x.is_finite() && *x > 0.0))
                    .collect()
            });
            match list {
                Some(l) if l.len() as u64 == rotary_dim / 2 => Ok(l),
                Some(l) => Err(c.invalid(&path(key), &expected, format!("{} numbers", l.len()))),
                None => Err(c.invalid(&path(key), &expected, value)),
            }
        };
        let short_factor = factors("short_factor")?;
        let long_factor = factors("long_factor")?;
        // The top-level field wins; Phi3Config always has one (4096 by default).
        let original = self.original_max_position_embeddings.map_or(4096, |d| d.0);
        let factor = positive("factor")?.unwrap_or(max_positions as f64 / original as f64);
        let attention_factor = match positive("attention_factor")? {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
        };
        Ok((
            theta,
            rotary_dim,
            Some(LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings: original,
                attention_factor,
            }),
        ))
    }
}

/// `int(head_dim * partial_rotary_factor)`, which must be even and at least 2 (rotate-half
/// pairs element `i` with `i + rotary_dim / 2`).
pub(super) fn rotary_dim(c: &Context, head_dim: u64, partial: f64) -> Result<u64> {
    let why = "a number in (0, 1] whose share of head_dim is an even width of at least 2";
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(c.invalid("partial_rotary_factor", why, partial));
    }
    // Python's int() truncates, as here.
    let dim = (head_dim as f64 * partial) as u64;
    if dim < 2 || !dim.is_multiple_of(2) {
        return Err(c.invalid(
            "partial_rotary_factor",
            why,
            format!("{partial} (head_dim {head_dim} x {partial} = {dim})"),
        ));
    }
    Ok(dim)
}
