//! One module per subcommand, plus the argument groups they share.

pub mod compile;
pub mod dump;
pub mod info;
pub mod models;
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
