//! Helpers the host benchmarks share: environment knobs, the GPT-2-shaped bench model, medians.

use protrain::models::{ConfigSource, ModelConfig};

/// An environment variable parsed as `T`, or `default`.
pub fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A GPT-2-shaped model: `layers` blocks of width `hidden` (64-wide heads), vocabulary 8192.
pub fn model(layers: u64, hidden: u64) -> ModelConfig {
    let json = serde_json::json!({
        "model_type": "gpt2",
        "vocab_size": 8192,
        "n_positions": 1024,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": hidden / 64,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
    });
    let mut config = ModelConfig::from_json(&json.to_string(), ConfigSource::Text("bench".into()))
        .expect("the bench model parses");
    config.name = format!("gpt2-{layers}x{hidden}");
    config
}

/// Median of some values.
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}
