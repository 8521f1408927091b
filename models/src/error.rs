//! The crate's error type: everything loading a config or building a graph can reject.

use std::fmt;
use std::path::PathBuf;

/// Where a config came from, for error messages: a preset or a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// A built-in preset, by name.
    Preset(String),
    /// A `config.json` file.
    File(PathBuf),
    /// JSON text handed over directly, under a name the caller chose.
    Text(String),
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::Preset(name) => write!(f, "preset '{name}'"),
            ConfigSource::File(path) => write!(f, "{}", path.display()),
            ConfigSource::Text(name) => f.write_str(name),
        }
    }
}

/// Everything `protrain-models` can reject, each with the text that tells the user what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The spec names a preset that does not exist and no file of that name exists.
    #[error(
        "unknown model '{name}'; {}`protrain models` lists the presets, or give a path to a config.json",
        match suggestion { Some(s) => format!("did you mean '{s}'? "), None => String::new() }
    )]
    UnknownPreset {
        /// What the user asked for.
        name: String,
        /// The closest preset name, when one is close.
        suggestion: Option<String>,
    },
    /// A config path that does not exist.
    #[error("config file {} does not exist", path.display())]
    FileMissing {
        /// The path given.
        path: PathBuf,
    },
    /// A directory that holds no `config.json`.
    #[error("directory {} holds no config.json; give the path of a Hugging Face config.json or a preset name", dir.display())]
    NoConfigInDirectory {
        /// The directory given.
        dir: PathBuf,
    },
    /// A config file exists but cannot be read.
    #[error("cannot read {}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        error: std::io::Error,
    },
    /// A config path that is not a regular file, or is too large to be a config.
    #[error("{}: {problem}", path.display())]
    NotAConfigFile {
        /// The file.
        path: PathBuf,
        /// What it is, and what to give instead.
        problem: String,
    },
    /// The text is not JSON.
    #[error("{from}: invalid JSON at line {line}, column {column}: {message}")]
    InvalidJson {
        /// The config.
        from: ConfigSource,
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column of the problem.
        column: usize,
        /// What serde_json found.
        message: String,
    },
    /// The JSON is not an object.
    #[error("{from}: a config must be a JSON object, found {found}")]
    NotAnObject {
        /// The config.
        from: ConfigSource,
        /// What the top level is.
        found: String,
    },
    /// The config has no `model_type`.
    #[error("{from}: missing required field `model_type`; supported: {}", crate::config::SUPPORTED_MODEL_TYPES.join(", "))]
    MissingModelType {
        /// The config.
        from: ConfigSource,
    },
    /// `model_type` names a family this crate does not build.
    #[error("{from}: unknown model_type '{model_type}'; supported: {}", crate::config::SUPPORTED_MODEL_TYPES.join(", "))]
    UnknownModelType {
        /// The config.
        from: ConfigSource,
        /// What it says.
        model_type: String,
    },
    /// A field the family needs is absent (or null).
    #[error("{from}: missing required field `{field}`, which model_type '{model_type}' needs")]
    MissingField {
        /// The config.
        from: ConfigSource,
        /// The field.
        field: &'static str,
        /// The config's `model_type`.
        model_type: &'static str,
    },
    /// A field has the wrong type or an out-of-range value.
    #[error("{from}: field `{field}` {problem}")]
    InvalidField {
        /// The config.
        from: ConfigSource,
        /// The field's JSON path (dotted inside nested objects).
        field: String,
        /// What it must be and what it is, as JSON: `must be true or false, found "yes"`.
        problem: String,
    },
    /// A field is given both under its name and under a transformers alias (GPT-2's
    /// `hidden_size` for `n_embd`, say), which would leave its value to the order of the keys.
    #[error(
        "{from}: field `{field}` is given twice, under its name and under its transformers alias; keep one"
    )]
    DuplicateField {
        /// The config.
        from: ConfigSource,
        /// The field, by its canonical name.
        field: String,
    },
    /// A valid value this crate does not implement.
    #[error("{from}: {field} '{value}' is not supported for {model_type}; supported: {supported}")]
    Unsupported {
        /// The config.
        from: ConfigSource,
        /// The field.
        field: String,
        /// Its value.
        value: String,
        /// The config's `model_type`.
        model_type: &'static str,
        /// What is supported instead.
        supported: String,
    },
    /// The hidden size does not split into the heads.
    #[error("{from}: hidden size {hidden} is not divisible by the {heads} attention heads")]
    HiddenNotDivisibleByHeads {
        /// The config.
        from: ConfigSource,
        /// The hidden size.
        hidden: u64,
        /// The number of attention heads.
        heads: u64,
    },
    /// Query heads do not group evenly over the key/value heads.
    #[error(
        "{from}: the {heads} attention heads are not divisible by the {kv_heads} key/value heads"
    )]
    HeadsNotDivisibleByKvHeads {
        /// The config.
        from: ConfigSource,
        /// Query heads.
        heads: u64,
        /// Key/value heads.
        kv_heads: u64,
    },
    /// The batch geometry is unusable.
    #[error("{0}")]
    InvalidOptions(String),
    /// The sequence is longer than a learned-position model's table.
    #[error(
        "sequence length {seq} is longer than the {max_positions} positions {model} has learned; use a sequence length of at most {max_positions}"
    )]
    SequenceTooLong {
        /// The model's name.
        model: String,
        /// The sequence length asked for.
        seq: u64,
        /// The model's maximum.
        max_positions: u64,
    },
    /// The IR rejected the graph: a bug in a builder, reported instead of panicking.
    #[error(transparent)]
    Ir(#[from] protrain_ir::IrError),
}

/// The crate's result alias.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
