//! Named presets: Hugging Face `config.json` texts embedded in the binary.
//!
//! Each preset is the architecture part of a published model's `config.json` (fields left out
//! take transformers' defaults), read by the same parser as a user's file. The `-tiny` presets
//! (hidden 64, 2 layers, vocabulary 256, 256 positions) exist for fast training tests on the
//! built-in synthetic corpus.

use crate::config::ModelConfig;
use crate::error::{ConfigSource, ModelError, Result};

/// A named model configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// The name `load` accepts, e.g. `llama-2-7b`.
    pub name: &'static str,
    /// One line saying what it is.
    pub description: &'static str,
    /// The Hugging Face `config.json` text.
    pub config_json: &'static str,
}

impl Preset {
    /// The parsed configuration, named after the preset.
    pub fn config(&self) -> Result<ModelConfig> {
        ModelConfig::from_json(
            self.config_json,
            ConfigSource::Preset(self.name.to_string()),
        )
    }
}

macro_rules! preset {
    ($name:literal, $description:literal) => {
        Preset {
            name: $name,
            description: $description,
            config_json: include_str!(concat!("presets/", $name, ".json")),
        }
    };
}

const PRESETS: &[Preset] = &[
    preset!(
        "gpt2",
        "GPT-2 small: 124M parameters, 12 layers, hidden 768, 1024 positions"
    ),
    preset!(
        "gpt2-medium",
        "GPT-2 medium: 355M parameters, 24 layers, hidden 1024"
    ),
    preset!(
        "gpt2-large",
        "GPT-2 large: 774M parameters, 36 layers, hidden 1280"
    ),
    preset!(
        "gpt2-xl",
        "GPT-2 XL: 1.56B parameters, 48 layers, hidden 1600"
    ),
    preset!(
        "gpt3-175b",
        "GPT-3 175B's shape (Brown et al. 2020): 174.6B parameters, 96 layers, hidden 12288, \
         dense attention"
    ),
    preset!(
        "llama-2-7b",
        "LLaMA 2 7B: 6.74B parameters, 32 layers, hidden 4096, 4096 context"
    ),
    preset!(
        "llama-2-13b",
        "LLaMA 2 13B: 13.0B parameters, 40 layers, hidden 5120"
    ),
    preset!(
        "llama-2-70b",
        "LLaMA 2 70B: 69.0B parameters, 80 layers, hidden 8192, 8 KV heads (GQA)"
    ),
    preset!(
        "llama-3-8b",
        "LLaMA 3 8B: 8.03B parameters, 128256-token vocabulary, 8 KV heads, rope_theta 500000"
    ),
    preset!(
        "mistral-7b",
        "Mistral 7B v0.1: 7.24B parameters, 8 KV heads, 4096-token sliding window"
    ),
    preset!(
        "qwen2.5-7b",
        "Qwen2.5 7B: 7.62B parameters, 28 layers, hidden 3584, 4 KV heads, q/k/v biases"
    ),
    preset!(
        "qwen3-8b",
        "Qwen3 8B: 8.19B parameters, 36 layers, hidden 4096, 8 KV heads, per-head q/k norms"
    ),
    preset!(
        "mixtral-8x7b",
        "Mixtral 8x7B: 46.7B parameters (12.9B active), 32 layers of 8 SwiGLU experts, top-2 \
         routing, 8 KV heads"
    ),
    preset!(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B: 30.5B parameters (3.3B active), 48 layers of 128 experts, top-8 \
         routing, 4 KV heads, per-head q/k norms"
    ),
    preset!(
        "olmo2-1b",
        "OLMo 2 1B: 1.48B parameters, 16 layers, hidden 2048, norms after attention and MLP"
    ),
    preset!(
        "opt-1.3b",
        "OPT 1.3B: 1.32B parameters, 24 layers, hidden 2048, 2048 positions"
    ),
    preset!(
        "opt-13b",
        "OPT 13B: 12.9B parameters, 40 layers, hidden 5120"
    ),
    preset!(
        "opt-30b",
        "OPT 30B: 30.0B parameters, 48 layers, hidden 7168"
    ),
    preset!(
        "gemma-2-2b",
        "Gemma 2 2B: 2.61B parameters, 26 layers alternating 4096-token windows and global, \
         soft-capped scores and logits, tied embeddings"
    ),
    preset!(
        "gemma-2-9b",
        "Gemma 2 9B: 9.24B parameters, 42 layers, hidden 3584, 8 KV heads, head_dim 256"
    ),
    preset!(
        "gemma-3-1b",
        "Gemma 3 1B (text): 1.00B parameters, 26 layers, 5 of every 6 with 512-token windows, \
         q/k norms"
    ),
    preset!(
        "gemma-3-4b",
        "Gemma 3 4B (text part): 3.88B parameters, 34 layers, linear RoPE scaling x8 on global \
         layers"
    ),
    preset!(
        "phi-3-mini",
        "Phi-3 mini 4k: 3.82B parameters, 32 layers, hidden 3072, fused qkv_proj and \
         gate_up_proj, 2047-token window"
    ),
    preset!(
        "phi-3-mini-128k",
        "Phi-3 mini 128k: phi-3-mini with LongRoPE (short and long factors beyond 4096 tokens) \
         and 131072 positions"
    ),
    preset!(
        "gpt2-tiny",
        "Test GPT-2: hidden 64, 2 layers, 4 heads, vocabulary 256, 256 positions"
    ),
    preset!(
        "llama-tiny",
        "Test LLaMA: hidden 64, 2 layers, 4 heads over 2 KV heads, vocabulary 256"
    ),
    preset!(
        "mistral-tiny",
        "Test Mistral: as llama-tiny with an 8-token sliding window"
    ),
    preset!(
        "opt-tiny",
        "Test OPT: hidden 64, 2 layers, 4 heads, vocabulary 256, 256 positions"
    ),
];

/// Every preset, in a stable order: real models by family and size, then the test models.
pub fn presets() -> &'static [Preset] {
    PRESETS
}

/// The preset of that name, if there is one.
pub fn find_preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// The error for a name that is no preset, suggesting the closest preset when one is close.
pub(crate) fn unknown_preset(name: &str) -> ModelError {
    // The most similar name; the first of equally similar ones, so the choice is stable.
    let mut best: Option<(f64, &str)> = None;
    for preset in PRESETS {
        let similarity = strsim::normalized_damerau_levenshtein(name, preset.name);
        if similarity >= 0.5 && best.is_none_or(|(b, _)| similarity > b) {
            best = Some((similarity, preset.name));
        }
    }
    let suggestion = best.map(|(_, name)| name.to_string());
    ModelError::UnknownPreset {
        name: name.to_string(),
        suggestion,
    }
}
