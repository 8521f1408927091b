//! One module per subcommand, plus the argument groups they share.

pub mod compile;
pub mod dump;
pub mod info;
pub mod models;
pub mod profile;
pub mod run;
pub mod schedule;
pub mod train;

use protrain::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `text` to `path`, or to standard output when there is no path.
pub fn write_output(path: Option<&Path>, text: &str) -> Result<()> {
    match path {
        Some(path) => std::fs::write(path, text).map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        }),
        None => {
            let mut out = std::io::stdout().lock();
            // A closed pipe (`protrain dump ... | head`) is not an error worth reporting.
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
            Ok(())
        }
    }
}

/// The sequence length to use: the one asked for, else `default` capped at the model's
/// position limit.
pub fn seq_or_default(
    config: &protrain::models::ModelConfig,
    seq: Option<u64>,
    default: u64,
) -> u64 {
    seq.unwrap_or_else(|| default.min(config.max_position_embeddings))
}

/// AdamW settings, shared by `train` and `compile` (a schedule carries them in its optimizer
/// ops). Defaults suit the small models protrain trains on the host.
#[derive(clap::Args, Debug, Clone)]
pub struct OptimizerArgs {
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// AdamW first-moment decay.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// AdamW second-moment decay.
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f64,
    /// AdamW epsilon, added to the root of the second moment.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// AdamW decoupled weight decay, applied to every parameter.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Scale gradients down to this global norm when larger (clip_grad_norm_); off by default.
    #[arg(long, value_name = "NORM")]
    pub grad_clip: Option<f64>,
}

impl OptimizerArgs {
    /// The optimizer these flags describe.
    pub fn config(&self) -> protrain::OptimizerConfig {
        protrain::OptimizerConfig {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            grad_clip: self.grad_clip,
        }
    }
}
