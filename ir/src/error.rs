//! The IR's error type.

/// Everything the IR can reject.
#[derive(Debug, thiserror::Error)]
pub enum IrError {
    /// An op's inputs do not fit its kind.
    #[error("{op}: {why}")]
    TypeMismatch {
        /// The op kind's mnemonic.
        op: &'static str,
        /// What does not fit.
        why: String,
    },
    /// The graph breaks an invariant.
    #[error("invalid graph: {0}")]
    Invalid(String),
    /// A graph file is not valid JSON for a graph.
    #[error("not a protrain graph: {0}")]
    Json(#[from] serde_json::Error),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// An input file is refused before it is read: not a regular file, or larger than any
    /// file of its kind ([`crate::file::read_input`]).
    #[error("{path} {problem}")]
    InputFile {
        /// The file.
        path: String,
        /// What is wrong with it, and what to give instead.
        problem: String,
    },
    /// A hardware profile's JSON does not parse as a profile.
    #[error("{origin} is not a hardware profile: {source}")]
    ProfileJson {
        /// The file or text it came from.
        origin: String,
        /// The parse error, naming the field at fault.
        source: serde_json::Error,
    },
    /// A hardware profile parses but holds unusable figures.
    #[error("hardware profile `{name}`: {why}")]
    BadProfile {
        /// The profile's name.
        name: String,
        /// Which figure is wrong and why.
        why: String,
    },
    /// A `--hardware` value names neither a preset nor a profile file.
    #[error("unknown hardware `{name}`: not a preset ({known}) and no such profile file; run `protrain profile` to measure one")]
    UnknownHardware {
        /// What was asked for.
        name: String,
        /// The preset names, comma-separated.
        known: String,
    },
    /// A schedule breaks an invariant of the schedule verifier.
    #[error(transparent)]
    Schedule(#[from] crate::verify_schedule::ScheduleError),
    /// A schedule file (`.ptsched`) cannot be decoded.
    #[error("{origin}: {problem}")]
    ScheduleFile {
        /// The file, or `schedule data` for bytes without a name.
        origin: String,
        /// What is wrong with it, and what to do.
        problem: crate::file::FileProblem,
    },
    /// A policy's text form does not parse or does not fit the model.
    #[error("bad policy `{text}`: {why}")]
    BadPolicy {
        /// The text given (or the policy as printed).
        text: String,
        /// What is wrong with it, and what to write instead.
        why: String,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why writing failed.
        source: std::io::Error,
    },
}

/// The IR's result alias.
pub type Result<T, E = IrError> = std::result::Result<T, E>;
