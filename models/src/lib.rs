//! protrain's models: Hugging Face `config.json` parsing, named presets, and builders that lower
//! GPT-2, LLaMA, Mistral and OPT to a forward [`Graph`](protrain_ir::Graph) whose parameters
//! carry their Hugging Face names.
//!
//! ```
//! let config = protrain_models::load("llama-tiny").unwrap();
//! let graph = protrain_models::build_forward(&config, &protrain_models::BuildOptions::new(2, 16)).unwrap();
//! assert_eq!(graph.param_count(), config.info().unwrap().parameters);
//! ```

#![warn(missing_docs)]

pub mod build;
pub mod config;
pub mod error;
pub mod info;
pub mod init;
pub mod presets;

pub use build::{build_forward, BuildOptions};
pub use config::{
    Activation, Architecture, GemmaLayout, LayerType, LlamaLayout, LongRope, ModelConfig,
    MoeArchitecture, MoeLayout, OptLayout, Phi3Layout, QkNorm, Rotary, SUPPORTED_MODEL_TYPES,
};
pub use error::{ConfigSource, ModelError, Result};
pub use info::{ModelInfo, ModelStateBytes};
pub use presets::{find_preset, presets, Preset};

use std::path::Path;

/// Loads a model configuration from a spec: a preset name, a path to a `config.json`, or a
/// directory holding one (a downloaded Hugging Face model).
///
/// A spec that is neither a preset nor an existing path, and does not look like a path, is
/// reported as an unknown preset with the closest preset name.
pub fn load(spec: &str) -> Result<ModelConfig> {
    if let Some(preset) = find_preset(spec) {
        return preset.config();
    }
    let path = Path::new(spec);
    let looks_like_path =
        spec.contains(['/', '\\']) || spec.ends_with(".json") || spec.starts_with('.');
    if !path.exists() && !looks_like_path {
        return Err(presets::unknown_preset(spec));
    }
    if path.is_dir() {
        let file = path.join("config.json");
        if !file.is_file() {
            return Err(ModelError::NoConfigInDirectory { dir: path.into() });
        }
        return ModelConfig::from_file(&file);
    }
    ModelConfig::from_file(path)
}
