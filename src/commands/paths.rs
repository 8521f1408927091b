//! The one check of a command's outputs against its inputs, made before any work: no output
//! may be one of the files the command reads (a run that ends by writing `--save` over its
//! own config or schedule destroys it), a device, a FIFO or a directory, or lie in a
//! directory that does not exist; checkpoints may not replace or prune an input.

use protrain::{Error, Result};
use std::path::{Path, PathBuf};

/// The files a command reads, gathered from its arguments before it reads any.
#[derive(Debug, Default)]
pub struct Inputs(Vec<PathBuf>);

impl Inputs {
    /// No inputs yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `path`; a directory adds the files directly in it too (a model or weights
    /// directory is read through the files it holds).
    pub fn file(&mut self, path: &Path) -> &mut Self {
        if path.is_dir() {
            if let Ok(entries) = std::fs::read_dir(path) {
                self.0.extend(entries.flatten().map(|e| e.path()));
            }
        }
        self.0.push(path.to_path_buf());
        self
    }

    /// Adds `path` when there is one.
    pub fn maybe(&mut self, path: Option<&Path>) -> &mut Self {
        if let Some(path) = path {
            self.file(path);
        }
        self
    }

    /// Adds a MODEL argument: a preset name adds nothing, a path its file or directory.
    pub fn model(&mut self, model: &str) -> &mut Self {
        for path in super::model_inputs(model) {
            self.0.push(path);
        }
        self
    }

    /// Adds a `--hardware` value that names a profile file rather than a preset.
    pub fn hardware(&mut self, hardware: Option<&str>) -> &mut Self {
        if let Some(h) = hardware.filter(|h| protrain::ir::HardwareProfile::preset(h).is_none()) {
            self.0.push(PathBuf::from(h));
        }
        self
    }

    /// Adds what `run` and `train` read through [`super::run::ExecArgs`]: the data, the
    /// tokenizer, the initial weights, the evaluation data and, with `--resume` and no
    /// `--data`, the data of the checkpointed run.
    pub fn exec(&mut self, args: &super::run::ExecArgs) -> &mut Self {
        self.maybe(args.data.as_deref())
            .maybe(args.tokenizer.as_deref())
            .maybe(args.init.as_deref())
            .maybe(args.eval.eval_data.as_deref());
        if let (Some(dir), None) = (&args.resume, &args.data) {
            let saved = protrain::runtime::checkpoint::peek_latest(dir).ok();
            self.maybe(saved.as_ref().and_then(|s| s.run.as_ref()?.data.as_deref()));
        }
        self
    }

    /// The inputs as paths.
    pub fn paths(&self) -> Vec<&Path> {
        self.0.iter().map(PathBuf::as_path).collect()
    }
}

/// Fails unless each of `outputs` (its flag, its path) may be written: a regular file or
/// nothing, none of `inputs` (compared as the same file: device and inode), in a directory
/// that exists ([`super::check_output`]).
pub fn check_outputs(outputs: &[(&str, &Path)], inputs: &Inputs) -> Result<()> {
    let inputs = inputs.paths();
    for &(flag, path) in outputs {
        super::check_output(path, &inputs)?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(Error::Usage(format!(
                "{flag} {}: the directory {} does not exist; create it or choose another path",
                path.display(),
                dir.display()
            )));
        }
    }
    Ok(())
}

/// Whether `output` is `-`, standard output, once checked: `-` may not come with `--json`,
/// which prints there too (`what` names what `-o` writes); a file is checked against `inputs`
/// as [`check_outputs`] checks it.
pub fn stdout_or_checked(output: &Path, json: bool, what: &str, inputs: &Inputs) -> Result<bool> {
    if output != Path::new("-") {
        check_outputs(&[("-o", output)], inputs)?;
        return Ok(false);
    }
    if json {
        return Err(Error::Usage(format!(
            "`-o -` writes the {what} on standard output, where --json would print too: write \
             the {what} to a file, or leave out --json"
        )));
    }
    Ok(true)
}

/// Fails unless `dir` may take checkpoints: not an existing file of another kind than a
/// directory, and holding no input under a name the checkpoints use (`step-*`), which a
/// save would replace or a prune delete. `flag` names the option that gave it.
pub fn check_checkpoint_dir(flag: &str, dir: &Path, inputs: &Inputs) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(Error::Usage(format!(
            "{flag} {} is not a directory; give a directory for the checkpoints",
            dir.display()
        )));
    }
    let Ok(dir_id) = std::fs::canonicalize(dir) else {
        return Ok(());
    };
    for input in inputs.paths() {
        let named = input
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("step-"));
        let parent = input
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if named && std::fs::canonicalize(parent).is_ok_and(|p| p == dir_id) && input.is_file() {
            return Err(Error::Usage(format!(
                "{flag} {}: {} is an input of this command, and checkpoints written there \
                 would replace or prune it; give another checkpoint directory (--resume \
                 continues a run in its own)",
                dir.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// The outputs of `run` and `train` ([`super::run::ExecArgs`]): `--save` and `--trace`,
/// checked against `inputs`, and the checkpoint directory (`--checkpoint-dir`, or the
/// resumed one with `--save-every`).
pub fn check_exec_outputs(args: &super::run::ExecArgs, inputs: &Inputs) -> Result<()> {
    let mut outputs = Vec::new();
    if let Some(p) = &args.save {
        outputs.push(("--save", p.as_path()));
    }
    if let Some(p) = &args.trace {
        outputs.push(("--trace", p.as_path()));
    }
    check_outputs(&outputs, inputs)?;
    if let Some(dir) = &args.checkpoint_dir {
        check_checkpoint_dir("--checkpoint-dir", dir, inputs)?;
    }
    Ok(())
}
