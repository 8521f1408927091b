//! Training checkpoints: parameters, Adam moments, step and data position in safetensors.
//!
//! A checkpoint is one file, `step-NNNNNNNN.safetensors`, in a checkpoint directory. It holds
//! every parameter (f32, under its Hugging Face name) and every optimizer-state value (Adam's
//! `adam.m.NAME` and `adam.v.NAME`, f32), and in its metadata the steps taken, the data
//! position (the index of the next step, which fixes its batch: see
//! [`crate::data::Batcher`]), the token stream's length and a [`Fingerprint`] of the training
//! run. Files are written atomically by [`save_safetensors`] (a hidden `.NAME.XXXXXX.tmp` file,
//! synced, then renamed: [`protrain_ir::output::write_atomic`]), so a run killed while saving leaves
//! a temporary file that [`list`] ignores, never a torn checkpoint.
//!
//! The fingerprint covers what the numbers mean (parameter and state names and shapes, batch,
//! sequence length, optimizer hyper-parameters), not where the schedule keeps them: a
//! checkpoint written under one policy resumes under any other, bit-identically, because every
//! policy computes the same bits (the project's equivalence guarantee).
//!
//! The state is read and written through the executor, which first runs the disk write-backs
//! a schedule carries into the next step ([`crate::executor::Executor::flush_disk`]): a
//! checkpoint of a disk-tier run holds every update, even one taken while write-backs were
//! pending, so a run killed after it resumes bit for bit.
//!
//! The metadata also records the run's settings ([`RunSettings`]: steps, learning-rate
//! schedule, seed, data), its optimizer settings and its element type, so `--resume DIR` alone continues the run
//! ([`peek_latest`] reads them before anything is compiled).
//!
//! Every tensor's checksum is stored in the metadata, and so is a checksum of the whole
//! metadata (every other key and value, tensor checksums included); both are verified on load,
//! and the step in the metadata must match the file name: a damaged checkpoint is refused, and
//! [`load_latest`] falls back to the one before it with a warning.
//!
//! A run of several ranks writes a *sharded* checkpoint instead ([`sharded`]): each rank its
//! own shard file of the state it holds, with no gather, and rank 0 a manifest
//! (`step-NNNNNNNN.manifest.json`) naming them, written last. Either kind resumes on any
//! number of ranks: each rank reads the elements it holds under the resuming schedule
//! ([`Checkpoint::restore`]), from the shards that hold them, so a checkpoint of 4 ranks
//! resumes on 2 or 1 and one of 1 rank on 4 (re-sharding). A single rank writes the
//! single file: one rank has nothing to shard, and one file is what other tools read.

pub mod sharded;

use crate::backend::Backend;
use crate::error::{Difference, Result, RuntimeError};
use crate::executor::Executor;
use crate::loss_scale::ScalerState;
use crate::run_settings::RunSettings;
use crate::weights::{save_safetensors, ExpectedTensor, StorageDtype, WeightFile};
use protrain_ir::{DType, Graph, OpKind, Role, Schedule, ValueId};
use serde::{Deserialize, Serialize};
pub use sharded::{manifest_name, shard_name};
use sharded::{Shards, MANIFEST_SUFFIX};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The metadata key that marks a protrain checkpoint; its value is the layout version.
const FORMAT_KEY: &str = "protrain.checkpoint";

/// The checkpoint layout this build writes. Version 2 adds a checksum per tensor
/// (`LEGACY_CHECKSUM_PREFIX` + name in the metadata); version 3 the run and optimizer
/// settings (`RUN_KEY`, `OPTIMIZER_KEY`) and the checksum of the whole metadata
/// (`METADATA_CHECKSUM_KEY`); version 4 checks tensors with CRC-32 (`CHECKSUM_PREFIX`)
/// instead of FNV-1a. Versions 1 to 3 are still read.
const FORMAT_VERSION: &str = "4";

/// The bytes of a rank's error that [`Checkpoint::restore`] passes on to the other ranks.
const REPORT_BYTES: usize = 1024;

/// The layouts this build reads.
const READABLE_VERSIONS: [&str; 4] = ["1", "2", "3", "4"];

/// The metadata key of the metadata's own checksum ([`metadata_checksum`]).
const METADATA_CHECKSUM_KEY: &str = "metadata_checksum";

/// The metadata key of the run settings, as JSON ([`RunSettings`]).
const RUN_KEY: &str = "run";

/// The metadata key of the optimizer settings, as JSON ([`OptimizerSettings`]).
const OPTIMIZER_KEY: &str = "optimizer_settings";

/// The metadata key of the run's element type (`f32`, `bf16`, `f16`): not part of the
/// fingerprint, since the stored tensors are f32 whatever it is and any schedule of the model
/// can load them, but `--resume DIR` alone must train in it to continue the run.
const DTYPE_KEY: &str = "dtype";

/// The metadata key prefix of a tensor's checksum (layout 4): CRC-32 of its little-endian
/// f32 bytes, as 8 hex digits ([`checksum`]).
const CHECKSUM_PREFIX: &str = "crc32.";

/// The metadata key prefix of a tensor's checksum in layouts 2 and 3: FNV-1a (64-bit) of its
/// little-endian f32 bytes, as 16 hex digits ([`legacy_checksum`]).
const LEGACY_CHECKSUM_PREFIX: &str = "fnv1a64.";

/// The file name prefix of checkpoints; the step number (8 digits or more) and
/// `.safetensors` follow.
const PREFIX: &str = "step-";

/// The file name suffix of checkpoints.
const SUFFIX: &str = ".safetensors";

/// The AdamW hyper-parameters a training graph was built with: fixed when it is compiled, read
/// back from its `adamw` and `clip_coef` ops. The learning rate is the peak of the run's
/// learning-rate schedule ([`crate::train::LrSchedule`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSettings {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The global gradient norm gradients are clipped to, when they are.
    pub grad_clip: Option<f64>,
    /// Micro-batches per step over all ranks (ranks x gradient accumulation: the global
    /// batch's, as the loss gradient is scaled); 1 in checkpoints written before it.
    #[serde(default = "one")]
    pub grad_accum: u64,
}

/// Serde's default for [`OptimizerSettings::grad_accum`].
fn one() -> u64 {
    1
}

impl OptimizerSettings {
    /// The settings of `graph`'s first `adamw` op (autodiff gives every parameter the same
    /// ones) and its `clip_coef` op; `None` when the graph has no optimizer.
    pub fn of(graph: &Graph) -> Option<Self> {
        let mut settings = graph.ops().find_map(|(_, op)| match op.kind {
            OpKind::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => Some(Self {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                grad_clip: None,
                grad_accum: 1,
            }),
            _ => None,
        })?;
        settings.grad_accum = graph
            .ops()
            .find_map(|(_, op)| match op.kind {
                OpKind::CrossEntropyBackwardScaled { micro_batches }
                | OpKind::CrossEntropyBackwardLossScaled { micro_batches, .. } => {
                    Some(micro_batches)
                }
                _ => None,
            })
            .unwrap_or(1);
        settings.grad_clip = graph.ops().find_map(|(_, op)| match op.kind {
            OpKind::ClipCoef { max_norm } => Some(max_norm),
            OpKind::UnscaleCoef { max_norm, .. } => max_norm,
            _ => None,
        });
        Some(settings)
    }
}

impl std::fmt::Display for OptimizerSettings {
    /// `lr=0.003 beta1=0.9 beta2=0.95 eps=1e-8 weight_decay=0 grad_clip=none`, then
    /// ` grad_accum=K` with accumulation (left out without it, so a run that accumulates
    /// nothing shows only the settings that apply to it).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "lr={} beta1={} beta2={} eps={:e} weight_decay={} grad_clip=",
            self.lr, self.beta1, self.beta2, self.eps, self.weight_decay
        )?;
        match self.grad_clip {
            Some(norm) => write!(f, "{norm}")?,
            None => f.write_str("none")?,
        }
        if self.grad_accum > 1 {
            write!(f, " grad_accum={}", self.grad_accum)?;
        }
        Ok(())
    }
}

/// What identifies a training run for resuming: the parts a person reads, and a hash of the
/// whole structure. Offsets, streams and the policy are deliberately left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// The model's name (reported when checkpoints differ; not hashed, so a preset and its
    /// config file match).
    pub model: String,
    /// Sequences per step.
    pub batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// The optimizer settings, as [`OptimizerSettings`] prints them (`none` without an
    /// optimizer).
    pub optimizer: String,
    /// FNV-1a (64-bit) of batch, sequence length, optimizer settings, and every parameter's and
    /// optimizer-state value's name and shape in graph order, as 16 hex digits.
    pub hash: String,
}

impl Fingerprint {
    /// The fingerprint of a schedule's training run.
    pub fn of(schedule: &Schedule) -> Self {
        let graph = &schedule.graph;
        let optimizer =
            OptimizerSettings::of(graph).map_or_else(|| "none".to_string(), |s| s.to_string());
        let mut text = format!(
            "batch={} seq={}\noptimizer {optimizer}\n",
            schedule.header.batch, schedule.header.seq
        );
        for (_, p) in graph.params() {
            let _ = writeln!(text, "param {} {:?}", p.name, graph.value(p.value).ty.shape);
        }
        for id in state_values(graph) {
            let v = graph.value(id);
            let _ = writeln!(text, "state {} {:?}", v.name, v.ty.shape);
        }
        Self {
            model: schedule.header.model.clone(),
            batch: schedule.header.batch,
            seq: schedule.header.seq,
            optimizer,
            hash: format!("{:016x}", fnv1a(text.as_bytes())),
        }
    }
}

/// FNV-1a, 64-bit: stable across builds and platforms, unlike `std`'s `DefaultHasher`.
fn fnv1a(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(bytes);
    hasher.finish()
}

/// The checksum of a tensor's values: CRC-32 of their little-endian bytes, as 8 hex digits.
/// CRC-32 catches every burst of damage up to 32 bits and runs many bytes a cycle
/// (`crc32fast` uses the CPU's carry-less multiply), where FNV-1a takes one byte a step.
fn checksum(data: &[f32]) -> String {
    let mut hasher = crc32fast::Hasher::new();
    hash_le_bytes(data, |bytes| hasher.update(bytes));
    format!("{:08x}", hasher.finalize())
}

/// The checksum of a tensor's values in checkpoint layouts 2 and 3, which this build reads
/// but no longer writes: FNV-1a (64-bit) of their little-endian bytes, as 16 hex digits.
fn legacy_checksum(data: &[f32]) -> String {
    use std::hash::Hasher;
    let mut hasher = fnv::FnvHasher::default();
    hash_le_bytes(data, |bytes| hasher.write(bytes));
    format!("{:016x}", hasher.finish())
}

/// Feeds `data`'s little-endian bytes to `feed`, a bounded chunk at a time (the bytes of a
/// big tensor are never all copied at once).
fn hash_le_bytes(data: &[f32], mut feed: impl FnMut(&[u8])) {
    let mut bytes = Vec::with_capacity(4 * 4096);
    for chunk in data.chunks(4096) {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        feed(&bytes);
    }
}

/// The metadata key prefix and the checksum function of the tensors of a checkpoint of
/// layout `version` (2 or later).
fn tensor_checksum(version: u32) -> (&'static str, fn(&[f32]) -> String) {
    match version {
        2 | 3 => (LEGACY_CHECKSUM_PREFIX, legacy_checksum),
        _ => (CHECKSUM_PREFIX, checksum),
    }
}

/// The optimizer-state values that persist across steps, in graph order (as
/// [`Executor::state`] lists them).
fn state_values(graph: &Graph) -> impl Iterator<Item = ValueId> + '_ {
    graph
        .values()
        .filter(|(_, v)| v.role == Role::OptimizerState && v.producer.is_none())
        .map(|(id, _)| id)
}

/// Where a training run stands: what a checkpoint records besides the tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// Optimizer steps taken (AdamW's step count, but for skipped loss-scaled steps).
    pub step: u64,
    /// The index of the next step to run, which fixes its batch.
    pub data_step: u64,
    /// Tokens in the token stream, so that a resumed run can tell when its data differs.
    pub data_tokens: u64,
    /// A loss-scaled (f16) run's scaler and the AdamW steps it applied (metadata keys
    /// `loss_scale`, `loss_scale_clean_steps`, `adam_steps`); `None` for any other run.
    pub scaler: Option<ScalerState>,
}

/// The file name of the checkpoint after `step` steps: `step-00000040.safetensors`.
pub fn file_name(step: u64) -> String {
    format!("{PREFIX}{step:08}{SUFFIX}")
}

/// The step a checkpoint file name (a single file's or a sharded checkpoint's manifest)
/// stands for; `None` for any other name (temporary files and shard files included).
fn step_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix(PREFIX)?;
    let digits = rest
        .strip_suffix(SUFFIX)
        .or_else(|| rest.strip_suffix(MANIFEST_SUFFIX))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checksum of a checkpoint's metadata: FNV-1a (64-bit), as 16 hex digits, of every key
/// and value but [`METADATA_CHECKSUM_KEY`]'s, in key order, each as its length (u64, little
/// endian) and its UTF-8 bytes, so no two different metadata maps hash the same text.
fn metadata_checksum<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    use std::hash::Hasher;
    let sorted: BTreeMap<&str, &str> = entries
        .into_iter()
        .filter(|(k, _)| *k != METADATA_CHECKSUM_KEY)
        .collect();
    let mut hasher = fnv::FnvHasher::default();
    for (key, value) in sorted {
        for text in [key, value] {
            hasher.write(&(text.len() as u64).to_le_bytes());
            hasher.write(text.as_bytes());
        }
    }
    format!("{:016x}", hasher.finish())
}

/// Writes the executor's training state to `dir` (created if need be) as
/// [`file_name`]`(progress.step)`, atomically, and returns its path. The checkpoint records no
/// run settings: see [`save_run`] for one that `--resume` alone continues.
///
/// An executor of several ranks writes a sharded checkpoint ([`sharded`]): every rank must
/// call this at the same step; each writes its own shard, rank 0 the manifest
/// ([`manifest_name`]) once all are written, and every rank returns the manifest's path.
pub fn save<B: Backend>(
    dir: &Path,
    executor: &Executor<'_, B>,
    progress: &Progress,
) -> Result<PathBuf> {
    write(dir, executor, progress, None)
}

/// [`save`], recording the run's settings too, so that a resumed run takes them from the
/// checkpoint ([`Checkpoint::run`], [`peek_latest`]).
pub fn save_run<B: Backend>(
    dir: &Path,
    executor: &Executor<'_, B>,
    progress: &Progress,
    run: &RunSettings,
) -> Result<PathBuf> {
    write(dir, executor, progress, Some(run))
}

/// Writes a checkpoint, with the run's settings when given: one file from a single rank, a
/// sharded checkpoint from several.
fn write<B: Backend>(
    dir: &Path,
    executor: &Executor<'_, B>,
    progress: &Progress,
    run: Option<&RunSettings>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|source| RuntimeError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(file_name(progress.step));
    let metadata = run_metadata(&path, executor.schedule(), progress, run)?;
    if executor.rank().1 > 1 {
        sharded::write(dir, executor, progress.step, metadata)?;
        return Ok(dir.join(manifest_name(progress.step)));
    }
    let schedule = executor.schedule();
    let graph = &schedule.graph;
    let params = executor.params()?;
    let state = executor.state()?;
    let shape = |id: ValueId| -> Vec<usize> {
        graph
            .value(id)
            .ty
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect()
    };
    let param_shapes: Vec<Vec<usize>> = graph.params().map(|(_, p)| shape(p.value)).collect();
    let state_shapes: Vec<Vec<usize>> = state_values(graph).map(shape).collect();
    let mut tensors: Vec<(&str, &[usize], &[f32])> = Vec::with_capacity(params.len() + state.len());
    for (((_, p), s), data) in graph.params().zip(&param_shapes).zip(&params) {
        tensors.push((p.name.as_str(), s, data));
    }
    for ((name, data), s) in state.iter().zip(&state_shapes) {
        tensors.push((name.as_str(), s, data));
    }
    let checksums: Vec<(String, String)> = tensors
        .iter()
        .map(|(name, _, data)| (format!("{CHECKSUM_PREFIX}{name}"), checksum(data)))
        .collect();
    let mut metadata: Vec<(&str, &str)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    metadata.extend(checksums.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let sum = metadata_checksum(metadata.iter().copied());
    metadata.push((METADATA_CHECKSUM_KEY, sum.as_str()));
    save_safetensors(&path, &tensors, StorageDtype::F32, &metadata)?;
    Ok(path)
}

/// What every checkpoint's metadata records of its run (but the tensor checksums and the
/// metadata's own checksum): layout, progress, fingerprint, loss scaler, run and optimizer
/// settings. `path` is named when the settings do not encode.
fn run_metadata(
    path: &Path,
    schedule: &Schedule,
    progress: &Progress,
    run: Option<&RunSettings>,
) -> Result<Vec<(String, String)>> {
    let graph = &schedule.graph;
    let fingerprint = Fingerprint::of(schedule);
    let mut metadata: Vec<(String, String)> = [
        (FORMAT_KEY, FORMAT_VERSION.to_string()),
        ("step", progress.step.to_string()),
        ("data_step", progress.data_step.to_string()),
        ("data_tokens", progress.data_tokens.to_string()),
        ("fingerprint", fingerprint.hash),
        ("model", fingerprint.model),
        ("batch", fingerprint.batch.to_string()),
        ("seq", fingerprint.seq.to_string()),
        ("optimizer", fingerprint.optimizer),
        (DTYPE_KEY, schedule.header.dtype.name().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // The scale is an f32 (GradScaler's), so its shortest f64 text reads back exactly.
    if let Some(sc) = &progress.scaler {
        metadata.push(("loss_scale".into(), sc.scale.to_string()));
        metadata.push(("loss_scale_clean_steps".into(), sc.clean_steps.to_string()));
        metadata.push(("adam_steps".into(), sc.updates.to_string()));
    }
    let json = |what: &str, value: serde_json::Result<String>| {
        value.map_err(|e| RuntimeError::BadCheckpoint {
            path: path.to_path_buf(),
            problem: format!(
                "cannot be written: its {what} do not encode as JSON ({e}); use a token file \
                 path that is valid UTF-8"
            ),
        })
    };
    if let Some(r) = run {
        metadata.push((
            RUN_KEY.into(),
            json("run settings", serde_json::to_string(r))?,
        ));
    }
    if let Some(o) = OptimizerSettings::of(graph) {
        let text = json("optimizer settings", serde_json::to_string(&o))?;
        metadata.push((OPTIMIZER_KEY.into(), text));
    }
    // Written by `save_safetensors` anyway; given here so that the checksum covers it.
    metadata.push(("format".into(), "pt".into()));
    Ok(metadata)
}

/// Every complete checkpoint in `dir` as `(step, path)`, oldest first. Temporary files left by
/// an interrupted save, and every other file, are ignored; a missing directory holds none.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let io = |source| RuntimeError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io)?;
        let step = entry.file_name().to_str().and_then(step_of);
        if let Some(step) = step {
            if entry.file_type().map_err(io)?.is_file() {
                found.push((step, entry.path()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The newest checkpoint in `dir`; an error naming the directory when it holds none.
pub fn latest(dir: &Path) -> Result<PathBuf> {
    list(dir)?
        .pop()
        .map(|(_, path)| path)
        .ok_or_else(|| RuntimeError::NoCheckpoint {
            dir: dir.to_path_buf(),
        })
}

/// The newest checkpoint in `dir` that loads for `schedule`, and a warning for each newer one
/// that is damaged (unreadable, a checksum or step that does not match) and was skipped. A
/// checkpoint of another training run ([`RuntimeError::CheckpointMismatch`]) is not skipped:
/// the older ones are of that run too, and the error says what differs.
pub fn load_latest(dir: &Path, schedule: &Schedule) -> Result<(Checkpoint, Vec<String>)> {
    newest(
        dir,
        |e| matches!(e, RuntimeError::CheckpointMismatch { .. }),
        |path| Checkpoint::load(path, schedule),
    )
}

/// The newest checkpoint in `dir` that `attempt` takes, newest first, with a warning for each
/// newer one it failed on and that was skipped; an error `fatal` says no fallback can mend
/// (another run's checkpoint, or one every rank must give up on alike) ends the search.
fn newest(
    dir: &Path,
    fatal: impl Fn(&RuntimeError) -> bool,
    mut attempt: impl FnMut(&Path) -> Result<Checkpoint>,
) -> Result<(Checkpoint, Vec<String>)> {
    let found = list(dir)?;
    if found.is_empty() {
        return Err(RuntimeError::NoCheckpoint {
            dir: dir.to_path_buf(),
        });
    }
    let mut warnings = Vec::new();
    let mut last_error = None;
    for (_, path) in found.iter().rev() {
        match attempt(path) {
            Ok(ckpt) => return Ok((ckpt, warnings)),
            Err(e) if fatal(&e) => return Err(e),
            Err(e) => {
                warnings.push(format!(
                    "warning: skipping {}: {e}; trying the checkpoint before it",
                    path.display()
                ));
                last_error = Some(e);
            }
        }
    }
    Err(last_error.expect("at least one checkpoint was tried"))
}

/// The parameters of the newest intact checkpoint in `dir`, for `graph` (in its parameter
/// order, each tensor's checksum verified), and the file they came from: what evaluating a
/// checkpoint needs, which reads no optimizer state, so `graph` may be a forward-only graph.
/// Damaged newer checkpoints are passed over, as [`load_latest`] passes them over; a
/// checkpoint whose parameters are not `graph`'s (names or shapes) is an error naming the
/// first difference.
pub fn load_latest_params(dir: &Path, graph: &Graph) -> Result<(Vec<Vec<f32>>, PathBuf)> {
    let found = list(dir)?;
    let mut last_error = None;
    for (_, path) in found.iter().rev() {
        match read_params(path, graph) {
            Ok(params) => return Ok((params, path.clone())),
            Err(e @ RuntimeError::CheckpointMismatch { .. }) => return Err(e),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| RuntimeError::NoCheckpoint {
        dir: dir.to_path_buf(),
    }))
}

/// The parameters for `graph` of the one checkpoint at `path` (a file, or a sharded
/// checkpoint's manifest), read as [`load_latest_params`] reads them, and the step it was
/// written after; `None` when `path` is not named as a checkpoint is ([`file_name`]).
pub fn load_params_at(path: &Path, graph: &Graph) -> Option<Result<(Vec<Vec<f32>>, u64)>> {
    let step = path.file_name()?.to_str().and_then(step_of)?;
    Some(read_params(path, graph).map(|params| (params, step)))
}

/// The parameters of the checkpoint at `path` for `graph`; see [`load_latest_params`].
fn read_params(path: &Path, graph: &Graph) -> Result<Vec<Vec<f32>>> {
    if is_manifest(path) {
        let shards = Shards::open(path)?;
        header_of(path, &shards.manifest.metadata)?;
        return graph
            .params()
            .map(|(_, p)| {
                let want: Vec<usize> = graph
                    .value(p.value)
                    .ty
                    .shape
                    .iter()
                    .map(|&d| d as usize)
                    .collect();
                let found = shards.find(&p.name);
                let shape = found.map(|i| &shards.manifest.tensors[i].shape);
                match (found, shape) {
                    (Some(i), Some(shape)) if *shape == want => {
                        shards.read(i, 0..want.iter().product())
                    }
                    _ => Err(RuntimeError::CheckpointMismatch {
                        path: path.to_path_buf(),
                        differences: vec![Difference::Other(format!(
                            "parameter `{}` {}, the model expects {want:?}: the checkpoint is \
                             of another model",
                            p.name,
                            shape.map_or("is missing".into(), |s| format!("is {s:?}"))
                        ))],
                    }),
                }
            })
            .collect();
    }
    let (file, header) = read_header(path)?;
    let meta = file.metadata();
    let mut params = Vec::with_capacity(graph.params().len());
    for (_, p) in graph.params() {
        let want: Vec<usize> = graph
            .value(p.value)
            .ty
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect();
        let shape = match file.contains(&p.name) {
            true => file.shape(&p.name)?.to_vec(),
            false => Vec::new(),
        };
        if shape != want {
            let found = match file.contains(&p.name) {
                true => format!("is {shape:?}"),
                false => "is missing".into(),
            };
            return Err(RuntimeError::CheckpointMismatch {
                path: path.to_path_buf(),
                differences: vec![Difference::Other(format!(
                    "parameter `{}` {found}, the model expects {want:?}: the checkpoint is of \
                     another model",
                    p.name
                ))],
            });
        }
        let data = file.read_f32_vec(&p.name)?;
        if header.version != 1 {
            let (prefix, checksum) = tensor_checksum(header.version);
            let key = format!("{prefix}{}", p.name);
            let have = checksum(&data);
            if meta.get(&key) != Some(&have) {
                return Err(RuntimeError::BadCheckpoint {
                    path: path.to_path_buf(),
                    problem: format!(
                        "is damaged: tensor {} does not match its checksum; use an earlier \
                         checkpoint",
                        p.name
                    ),
                });
            }
        }
        params.push(data);
    }
    Ok(params)
}

/// Fails when `dir` already holds checkpoints and is not the directory the run resumed from
/// (`resumed`): [`prune`] keeps the newest checkpoints, so another run's later ones would
/// make it delete every checkpoint this run writes.
pub fn check_dir_is_ours(dir: &Path, resumed: Option<&Path>) -> Result<()> {
    let found = list(dir)?;
    let Some((newest, _)) = found.last() else {
        return Ok(());
    };
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if resumed.is_some_and(|r| same(r, dir)) {
        return Ok(());
    }
    Err(RuntimeError::ForeignCheckpointDir {
        dir: dir.to_path_buf(),
        count: found.len(),
        newest: *newest,
    })
}

/// The file a run holds locked in its checkpoint directory ([`take_dir`]); it holds the
/// run's PID.
pub const LOCK_NAME: &str = ".protrain.lock";

/// A checkpoint directory held by this run: an exclusive lock ([`File::try_lock`], `flock`) on
/// its [`LOCK_NAME`] file, released when the process ends, however it ends (so a run killed
/// with `kill -9` leaves no stale lock, only the file). Dropping it removes the file, then
/// releases the lock.
///
/// [`File::try_lock`]: std::fs::File::try_lock
#[derive(Debug)]
pub struct DirLock {
    /// The open lock file; the lock lives as long as it is open.
    file: std::fs::File,
    /// Its path.
    path: PathBuf,
    /// The temporary files of interrupted saves removed when the directory was taken.
    pub removed: Vec<PathBuf>,
    /// Their bytes.
    pub removed_bytes: u64,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Removed while still locked: a run that opened this file meanwhile finds, once it
        // has the lock, that the path no longer names it, and takes the directory anew.
        let _ = std::fs::remove_file(&self.path);
        let _ = &self.file;
    }
}

/// Takes the checkpoint directory `dir` (created if need be) for this run, so that no other
/// run writes or prunes checkpoints there meanwhile: two runs on one directory would each
/// delete the other's checkpoints as the oldest. Fails with
/// [`RuntimeError::CheckpointDirInUse`], naming the other run's PID, when one holds it.
///
/// Holding the directory, it then removes the temporary files of saves that were interrupted
/// (`.step-N.safetensors.XXXXXX.tmp` and the like, left by a run killed while saving: never a
/// live save, since only the holder saves there) and lists them in [`DirLock::removed`].
/// A file system without locks (some network file systems) is used without one.
pub fn take_dir(dir: &Path) -> Result<DirLock> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::MetadataExt;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RuntimeError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(LOCK_NAME);
    let mut file = loop {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(RuntimeError::CheckpointDirInUse {
                    dir: dir.to_path_buf(),
                    pid: text.trim().parse().ok(),
                });
            }
            // The file system has no locks: the directory is used unguarded rather than refused.
            Err(std::fs::TryLockError::Error(_)) => break file,
        }
        // The run that held it may have removed the file between our open and our lock:
        // the lock counts only on the file the path still names.
        let ours = file.metadata().map_err(io(&path))?;
        match std::fs::metadata(&path) {
            Ok(now) if (now.dev(), now.ino()) == (ours.dev(), ours.ino()) => break file,
            _ => continue,
        }
    };
    // The PID is for the message of a run refused; a failure to write it costs only that.
    let _ = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| write!(file, "{}", std::process::id()));
    let mut removed = Vec::new();
    let mut removed_bytes = 0;
    for entry in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let leftover = name.starts_with(&format!(".{PREFIX}")) && name.ends_with(".tmp");
        let Ok(meta) = entry.metadata() else { continue };
        if leftover && meta.is_file() && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
            removed_bytes += meta.len();
        }
    }
    removed.sort();
    Ok(DirLock {
        file,
        path,
        removed,
        removed_bytes,
    })
}

/// Deletes all but the newest `keep` checkpoints in `dir` (none when `keep` is 0): a sharded
/// one's manifest first (so it no longer counts), then its shard files; and the shard files
/// older than the oldest kept checkpoint that no manifest names (left by a save that was
/// killed).
pub fn prune(dir: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let remove = |path: &Path| {
        std::fs::remove_file(path).map_err(|source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let found = list(dir)?;
    let old = found.len().saturating_sub(keep);
    for (_, path) in &found[..old] {
        remove(path)?;
    }
    let Some(&(oldest_kept, _)) = found.get(old) else {
        return Ok(());
    };
    for (step, path) in sharded::shard_files(dir)? {
        if step < oldest_kept {
            remove(&path)?;
        }
    }
    Ok(())
}

/// Whether `path` names a sharded checkpoint's manifest (by its name).
fn is_manifest(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(MANIFEST_SUFFIX))
}

/// What a checkpoint's metadata says, checked: its layout, the metadata's checksum (layout 3
/// and later), the step against the file name.
struct Header {
    /// The layout version.
    version: u32,
    progress: Progress,
    batch: Option<u64>,
    seq: Option<u64>,
    dtype: Option<DType>,
    run: Option<RunSettings>,
    optimizer: Option<OptimizerSettings>,
}

/// Opens the checkpoint at `path` and reads and checks its metadata ([`Header`]); the tensors
/// are not read.
fn read_header(path: &Path) -> Result<(WeightFile, Header)> {
    let file = WeightFile::open(path)?;
    let header = header_of(path, file.metadata())?;
    if header.version >= 2 {
        check_tensor_names(path, &file, tensor_checksum(header.version).0)?;
    }
    Ok((file, header))
}

/// Fails unless the tensors of the checkpoint file at `path` are exactly those its metadata
/// holds checksums of. The metadata's checksum covers those names but not the file's tensor
/// table, so a name damaged there shows up as a tensor without a checksum (and a checksum
/// without its tensor): damage, never a checkpoint of another model.
fn check_tensor_names(path: &Path, file: &WeightFile, prefix: &str) -> Result<()> {
    let summed: std::collections::BTreeSet<&str> = file
        .metadata()
        .keys()
        .filter_map(|k| k.strip_prefix(prefix))
        .collect();
    let stored: std::collections::BTreeSet<&str> = file.names().collect();
    let unsummed = stored.difference(&summed).next();
    let missing = summed.difference(&stored).next();
    let problem = match (unsummed, missing) {
        (None, None) => return Ok(()),
        (Some(name), _) => format!("holds a tensor `{name}` that its metadata has no checksum of"),
        (None, Some(name)) => format!("lacks the tensor `{name}` its metadata has a checksum of"),
    };
    Err(RuntimeError::BadCheckpoint {
        path: path.to_path_buf(),
        problem: format!("is damaged: it {problem}; resume from an earlier checkpoint"),
    })
}

/// The metadata of any checkpoint at `path` (a single file's, or a sharded checkpoint's
/// manifest's) checked ([`Header`]); no tensor or shard file is read.
fn read_any_header(path: &Path) -> Result<Header> {
    match is_manifest(path) {
        true => header_of(path, &sharded::read_manifest(path)?.metadata),
        false => read_header(path).map(|(_, h)| h),
    }
}

/// Checks the metadata `meta` of the checkpoint at `path` ([`Header`]).
fn header_of(path: &Path, meta: &BTreeMap<String, String>) -> Result<Header> {
    let bad = |problem: String| RuntimeError::BadCheckpoint {
        path: path.to_path_buf(),
        problem,
    };
    let version = match meta.get(FORMAT_KEY).map(String::as_str) {
        Some(v) if READABLE_VERSIONS.contains(&v) => v,
        Some(other) => {
            return Err(bad(format!(
                "has checkpoint layout {other}, this build reads {}; resume it with the \
                 protrain that wrote it",
                READABLE_VERSIONS.join(", ")
            )))
        }
        None => {
            return Err(RuntimeError::WeightsNotCheckpoint {
                path: path.to_path_buf(),
                key: FORMAT_KEY,
            })
        }
    };
    let version: u32 = version.parse().expect("the readable versions are numbers");
    // Checked whenever the checksum is there, whatever the layout says: the layout is one of
    // the values it covers, so a damaged layout number cannot switch the check off.
    if version >= 3 || meta.contains_key(METADATA_CHECKSUM_KEY) {
        let Some(want) = meta.get(METADATA_CHECKSUM_KEY) else {
            return Err(bad(format!(
                "lacks the `{METADATA_CHECKSUM_KEY}` metadata; it is damaged, resume from an \
                 earlier checkpoint"
            )));
        };
        let have = metadata_checksum(meta.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if *want != have {
            return Err(bad(format!(
                "is damaged: its metadata has checksum {have}, but {want} was written; resume \
                 from an earlier checkpoint"
            )));
        }
    }
    let number = |key: &str| -> Result<u64> {
        let text = meta
            .get(key)
            .ok_or_else(|| bad(format!("lacks the `{key}` metadata; it is damaged")))?;
        text.parse().map_err(|_| {
            bad(format!(
                "has `{key}` = {text:?}, not a number; it is damaged"
            ))
        })
    };
    let scaler = match meta.get("loss_scale") {
        None => None,
        Some(text) => {
            let scale: f64 = text
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| {
                    bad(format!(
                        "has `loss_scale` = {text:?}, not a loss scale; it is damaged"
                    ))
                })?;
            Some(ScalerState {
                scale,
                clean_steps: number("loss_scale_clean_steps")?,
                updates: number("adam_steps")?,
            })
        }
    };
    let progress = Progress {
        step: number("step")?,
        data_step: number("data_step")?,
        data_tokens: number("data_tokens")?,
        scaler,
    };
    let named = path.file_name().and_then(|n| n.to_str()).and_then(step_of);
    if let Some(named) = named.filter(|&n| n != progress.step) {
        return Err(bad(format!(
            "is named for step {named} but its metadata says step {}; it was renamed or is \
             damaged",
            progress.step
        )));
    }
    fn parse<T: serde::de::DeserializeOwned>(
        meta: &BTreeMap<String, String>,
        key: &str,
        bad: impl Fn(String) -> RuntimeError,
    ) -> Result<Option<T>> {
        meta.get(key)
            .map(|text| {
                serde_json::from_str(text).map_err(|e| {
                    bad(format!(
                        "has unreadable `{key}` metadata ({e}); it is damaged, or written by \
                         another protrain"
                    ))
                })
            })
            .transpose()
    }
    let header = Header {
        version,
        progress,
        batch: number("batch").ok(),
        seq: number("seq").ok(),
        dtype: match meta.get(DTYPE_KEY) {
            None => None,
            Some(text) => Some(
                [DType::F32, DType::BF16, DType::F16]
                    .into_iter()
                    .find(|d| d.name() == text)
                    .ok_or_else(|| {
                        bad(format!(
                            "has `{DTYPE_KEY}` = {text:?}, not f32, bf16 or f16; it is damaged"
                        ))
                    })?,
            ),
        },
        run: parse(meta, RUN_KEY, bad)?,
        optimizer: parse(meta, OPTIMIZER_KEY, bad)?,
    };
    Ok(header)
}

/// What the newest readable checkpoint of a directory says about its run, read from its
/// metadata alone (its tensors are checked when it is loaded): what `--resume` needs before it
/// compiles anything.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedRun {
    /// The checkpoint.
    pub path: PathBuf,
    /// Where the run stood.
    pub progress: Progress,
    /// Sequences per step, when recorded.
    pub batch: Option<u64>,
    /// Tokens per sequence, when recorded.
    pub seq: Option<u64>,
    /// The element type of the run's parameters and activations, when recorded (the
    /// parameters are stored in f32 whatever it is: the master weights of a bf16 or f16 run).
    pub dtype: Option<DType>,
    /// The optimizer settings (layout 3 or later, with an optimizer).
    pub optimizer: Option<OptimizerSettings>,
    /// The run settings (layout 3 or later, written by [`save_run`]).
    pub run: Option<RunSettings>,
}

/// The run of the newest checkpoint in `dir` whose metadata is intact ([`SavedRun`]); damaged
/// newer ones are passed over, as [`load_latest`] passes them over (with the warnings it
/// gives).
pub fn peek_latest(dir: &Path) -> Result<SavedRun> {
    let found = list(dir)?;
    let mut last_error = None;
    for (_, path) in found.iter().rev() {
        match read_any_header(path) {
            Ok(h) => {
                return Ok(SavedRun {
                    path: path.clone(),
                    progress: h.progress,
                    batch: h.batch,
                    seq: h.seq,
                    dtype: h.dtype,
                    optimizer: h.optimizer,
                    run: h.run,
                })
            }
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| RuntimeError::NoCheckpoint {
        dir: dir.to_path_buf(),
    }))
}

/// The element type the weights at `path` were trained in, when `path` is a checkpoint that
/// records it: the one checkpoint a file (or a sharded checkpoint's manifest) named as a
/// checkpoint is ([`file_name`]), or the newest intact one of a directory of checkpoints.
/// `None` for anything else (a weights file) and for a checkpoint that does not record it.
pub fn saved_dtype(path: &Path) -> Option<DType> {
    if path.is_dir() {
        return peek_latest(path).ok()?.dtype;
    }
    path.file_name()?.to_str().and_then(step_of)?;
    read_any_header(path).ok()?.dtype
}

/// A checkpoint read back and checked against a schedule, ready to [`restore`](Self::restore).
///
/// A single-file checkpoint is checked whole when it is loaded (every tensor's checksum); a
/// sharded one's manifest and shard files are checked when it is loaded and its data, block
/// by block, when it is restored (each rank reads only the blocks it needs).
#[derive(Debug)]
pub struct Checkpoint {
    /// The file it was read from (a sharded checkpoint's manifest).
    pub path: PathBuf,
    /// Where the run stood when it was written.
    pub progress: Progress,
    /// The run's settings, when the checkpoint records them (written by [`save_run`], layout
    /// 3 or later).
    pub run: Option<RunSettings>,
    /// The ranks whose state it holds: the shard files of a sharded checkpoint, 1 for a
    /// single file.
    pub ranks: usize,
    /// Where the tensors are.
    source: Source,
}

/// Where a loaded checkpoint's tensors are.
#[derive(Debug)]
enum Source {
    /// One file, whose tensors (under their own names) were checked when it was loaded.
    File(WeightFile),
    /// A sharded checkpoint.
    Shards(Shards),
}

impl Checkpoint {
    /// Reads the checkpoint at `path` (a single file, or a sharded checkpoint's manifest) for
    /// `schedule`. Fails with an error naming what differs when it was written for another
    /// model, batch shape or optimizer, and with one naming the file when it is not a
    /// protrain checkpoint or is damaged (a shard file missing, or not the one its manifest
    /// names).
    pub fn load(path: &Path, schedule: &Schedule) -> Result<Self> {
        let (source, header) = match is_manifest(path) {
            true => {
                let shards = Shards::open(path)?;
                let header = header_of(path, &shards.manifest.metadata)?;
                (Source::Shards(shards), header)
            }
            false => {
                let (file, header) = read_header(path)?;
                (Source::File(file), header)
            }
        };
        let meta = match &source {
            Source::File(file) => file.metadata(),
            Source::Shards(shards) => &shards.manifest.metadata,
        };
        let bad = |problem: String| RuntimeError::BadCheckpoint {
            path: path.to_path_buf(),
            problem,
        };
        let (version, progress) = (header.version, header.progress);
        let graph = &schedule.graph;
        let want = Fingerprint::of(schedule);
        let text = |key: &str| meta.get(key).map_or("(not recorded)", String::as_str);
        let mut differences = Vec::new();
        if text("fingerprint") != want.hash {
            if text("model") != want.model {
                differences.push(format!(
                    "model: the checkpoint is of {}, this run trains {}",
                    text("model"),
                    want.model
                ));
            }
            if text("batch") != want.batch.to_string() || text("seq") != want.seq.to_string() {
                differences.push(format!(
                    "batch x seq: the checkpoint is {} x {}, this run is {} x {}",
                    text("batch"),
                    text("seq"),
                    want.batch,
                    want.seq
                ));
            }
            if text("optimizer") != want.optimizer {
                // Name only the settings that differ: `lr=0.003` against `lr=0.01`.
                let theirs: Vec<&str> = text("optimizer").split_whitespace().collect();
                let ours: Vec<&str> = want.optimizer.split_whitespace().collect();
                let (theirs, ours): (Vec<&str>, Vec<&str>) = if theirs.len() == ours.len() {
                    theirs.iter().zip(&ours).filter(|(t, o)| t != o).unzip()
                } else {
                    (theirs, ours)
                };
                differences.push(format!(
                    "optimizer: the checkpoint has {}, this run has {}",
                    theirs.join(" "),
                    ours.join(" ")
                ));
            }
        }
        let expected = expected_tensors(graph);
        let tensor_problems = match &source {
            Source::File(file) => match file.check_against(&expected) {
                Ok(_) => None,
                Err(RuntimeError::WeightsMismatch { count, report }) => Some((count, report)),
                Err(e) => return Err(e),
            },
            Source::Shards(shards) => manifest_mismatch(shards, &expected),
        };
        let intact_fingerprint = text("fingerprint") == want.hash;
        if let (true, Some((count, report))) = (intact_fingerprint, &tensor_problems) {
            // The metadata says this run's structure (and its checksum says the metadata is
            // intact), so tensors that do not match it are damage, not another run.
            return Err(bad(format!(
                "is damaged: its metadata is this run's but its tensors are not ({count} \
                 problem(s): {}); resume from an earlier checkpoint",
                report.lines().next().unwrap_or_default()
            )));
        }
        if let Some((count, report)) = tensor_problems {
            differences.push(format!(
                "tensors: {count} problem(s)\n  {}",
                report.replace('\n', "\n  ")
            ));
        }
        if differences.is_empty() && text("fingerprint") != want.hash {
            differences.push(format!(
                "structure: the checkpoint's fingerprint is {}, this run's is {}",
                text("fingerprint"),
                want.hash
            ));
        }
        if !differences.is_empty() {
            return Err(RuntimeError::CheckpointMismatch {
                path: path.to_path_buf(),
                differences: differences.into_iter().map(Difference::Other).collect(),
            });
        }
        let ranks = match &source {
            Source::File(file) => {
                // Every tensor against its checksum, one at a time.
                if version != 1 {
                    let (prefix, checksum) = tensor_checksum(version);
                    for tensor in &expected {
                        let name = &tensor.names[0];
                        let data = file.read_f32_vec(name)?;
                        let key = format!("{prefix}{name}");
                        let Some(want) = meta.get(&key) else {
                            return Err(bad(format!(
                                "lacks the checksum of {name}; it is damaged"
                            )));
                        };
                        let have = checksum(&data);
                        if *want != have {
                            return Err(bad(format!(
                                "is damaged: tensor {name} has checksum {have}, but {want} \
                                 was written; resume from an earlier checkpoint"
                            )));
                        }
                    }
                }
                1
            }
            Source::Shards(shards) => shards.ranks(),
        };
        Ok(Self {
            path: path.to_path_buf(),
            progress,
            run: header.run,
            ranks,
            source,
        })
    }

    /// Elements `range` of the checkpoint's tensor `name`: sliced from the tensor of a
    /// single file, read from the shards that hold them (each block checked) of a sharded
    /// one.
    fn read(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        match &self.source {
            Source::File(file) => {
                let whole = file.read_f32_vec(name)?;
                whole
                    .get(range.clone())
                    .map(<[f32]>::to_vec)
                    .ok_or_else(|| {
                        RuntimeError::Shape(format!(
                            "elements {range:?} of {name} were asked for, the checkpoint holds {}",
                            whole.len()
                        ))
                    })
            }
            Source::Shards(shards) => {
                let index = shards
                    .find(name)
                    .ok_or_else(|| RuntimeError::BadCheckpoint {
                        path: self.path.clone(),
                        problem: format!(
                            "has no tensor {name}; restore it into the schedule it was loaded for"
                        ),
                    })?;
                shards.read(index, range)
            }
        }
    }

    /// Puts the checkpoint's parameters, optimizer state and step count into `executor`, so
    /// its next step is the one the checkpointed run would have taken next. Each rank reads
    /// only the elements it holds under `executor`'s schedule, whatever the number of ranks
    /// that wrote the checkpoint, and every rank of a data-parallel schedule must call it:
    /// the ranks then agree whether all of them restored their part, so when one rank finds
    /// damage ([`RuntimeError::BadCheckpoint`]) every rank fails with that kind of error and
    /// [`restore_latest`] falls back to the same earlier checkpoint on every rank. Parameters
    /// that are not finite are refused, naming the first.
    pub fn restore<B: Backend>(&self, executor: &mut Executor<'_, B>) -> Result<()> {
        let origin = format!("the checkpoint {}", self.path.display());
        let tensors = executor.state_tensors();
        let n_params = executor.schedule().graph.params().len();
        let mut restored = || -> Result<()> {
            for (i, t) in tensors.iter().enumerate() {
                executor.load_held(i, &mut |range| {
                    let data = self.read(&t.name, range)?;
                    if i < n_params {
                        if let Some(&value) = data.iter().find(|v| !v.is_finite()) {
                            return Err(RuntimeError::NonFiniteWeights {
                                origin: origin.clone(),
                                name: t.name.clone(),
                                value,
                                count: data.iter().filter(|v| !v.is_finite()).count(),
                                len: data.len(),
                            });
                        }
                    }
                    Ok(data)
                })?;
            }
            Ok(())
        };
        let result = restored();
        // Each rank's outcome (0: restored; 1: damaged, so fall back; 2: another failure)
        // and the start of its error, so rank 0's message names what a worker found.
        let mut send = vec![0u8; 1 + REPORT_BYTES];
        if let Err(e) = &result {
            send[0] = match e {
                RuntimeError::BadCheckpoint { .. } => 1,
                _ => 2,
            };
            let text = e.to_string();
            let mut end = text.len().min(REPORT_BYTES);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            send[1..1 + end].copy_from_slice(&text.as_bytes()[..end]);
        }
        let all = executor.exchange(&send)?;
        result?;
        if let Some((q, s)) = all.iter().enumerate().find(|(_, s)| s[0] != 0) {
            let text = String::from_utf8_lossy(&s[1..]);
            let text = text.trim_end_matches('\0');
            return Err(match s[0] {
                1 => RuntimeError::BadCheckpoint {
                    path: self.path.clone(),
                    problem: format!("could not be read on rank {q}: {text}"),
                },
                _ => RuntimeError::Collective {
                    rank: q,
                    problem: format!(
                        "could not restore its part of {}: {text}",
                        self.path.display()
                    ),
                },
            });
        }
        match &self.progress.scaler {
            Some(sc) => executor.set_steps(self.progress.step, sc.updates),
            None => executor.set_step(self.progress.step),
        }
        Ok(())
    }
}

/// The tensors a checkpoint of `graph`'s run holds: every parameter, then every
/// optimizer-state value, with their shapes.
fn expected_tensors(graph: &Graph) -> Vec<ExpectedTensor> {
    let dims = |id: ValueId| -> Vec<usize> {
        graph
            .value(id)
            .ty
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect()
    };
    graph
        .params()
        .map(|(_, p)| ExpectedTensor::new(p.name.clone(), dims(p.value)))
        .chain(
            state_values(graph)
                .map(|id| ExpectedTensor::new(graph.value(id).name.clone(), dims(id))),
        )
        .collect()
}

/// The problems (how many, and the first few listed) of a sharded checkpoint's tensors
/// against the tensors `expected`: missing, of another shape, or not expected.
fn manifest_mismatch(shards: &Shards, expected: &[ExpectedTensor]) -> Option<(usize, String)> {
    // The lines `WeightFile::check_against` gives for a single file.
    let mut problems = Vec::new();
    for e in expected {
        let name = &e.names[0];
        match shards.find(name) {
            None => problems.push(format!("  missing: `{name}` {:?}", e.shape)),
            Some(i) if shards.manifest.tensors[i].shape != e.shape => problems.push(format!(
                "  wrong shape: `{name}` is {:?} in the file, the model expects {:?}",
                shards.manifest.tensors[i].shape, e.shape
            )),
            Some(_) => {}
        }
    }
    for t in &shards.manifest.tensors {
        if !expected.iter().any(|e| e.names[0] == t.name) {
            problems.push(format!(
                "  unexpected: `{}` {:?} is not a tensor of the model",
                t.name, t.shape
            ));
        }
    }
    let count = problems.len();
    problems.truncate(5);
    if count > 5 {
        problems.push(format!("  ... and {} more", count - 5));
    }
    (count > 0).then(|| (count, problems.join("\n")))
}

/// Restores the newest checkpoint in `dir` that loads for `executor`'s schedule and whose
/// data every rank reads intact ([`Checkpoint::restore`]), and returns it with a warning for
/// each newer one that was damaged and skipped, as [`load_latest`] skips them. Every rank of
/// a data-parallel schedule must call it; they skip the same checkpoints.
pub fn restore_latest<B: Backend>(
    dir: &Path,
    executor: &mut Executor<'_, B>,
) -> Result<(Checkpoint, Vec<String>)> {
    newest(
        dir,
        |e| {
            matches!(
                e,
                RuntimeError::CheckpointMismatch { .. }
                    | RuntimeError::NonFiniteWeights { .. }
                    | RuntimeError::Collective { .. }
            )
        },
        |path| {
            let ckpt = Checkpoint::load(path, executor.schedule())?;
            ckpt.restore(executor)?;
            Ok(ckpt)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_hash_is_fnv1a() {
        // Published FNV-1a 64 test vectors: a change of hash would orphan every checkpoint.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn only_complete_checkpoint_names_count() {
        assert_eq!(step_of(&file_name(40)), Some(40));
        assert_eq!(step_of("step-123456789.safetensors"), Some(123_456_789));
        // A sharded checkpoint counts by its manifest; its shard files do not count.
        assert_eq!(step_of(&manifest_name(40)), Some(40));
        for name in [
            "step-00000040.rank-0-of-4.safetensors",
            ".step-00000040.manifest.json.a1B2c3.tmp",
            "step-00000040.manifest.json.tmp",
            "step-00000040.safetensors.tmp",
            ".step-00000040.safetensors.a1B2c3.tmp",
            "step-.safetensors",
            "step-00x1.safetensors",
            "model.safetensors",
            ".step-00000040.safetensors",
        ] {
            assert_eq!(step_of(name), None, "{name}");
        }
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_metadata_checksum_covers_every_key_and_value_but_its_own() {
        let base = [("a", "1"), ("step", "40"), (METADATA_CHECKSUM_KEY, "x")];
        let sum = metadata_checksum(base);
        // Order and the checksum's own entry do not matter.
        assert_eq!(sum, metadata_checksum([("step", "40"), ("a", "1")]));
        for changed in [
            [("a", "1"), ("step", "41")],
            [("a", "2"), ("step", "40")],
            [("b", "1"), ("step", "40")],
            // Lengths are hashed: moving a byte from a key to its value changes the sum.
            [("a1", ""), ("step", "40")],
        ] {
            assert_ne!(sum, metadata_checksum(changed), "{changed:?}");
        }
        assert_ne!(sum, metadata_checksum([("a", "1")]), "a key left out");
    }

    #[test]
    fn list_ignores_temporaries_and_prune_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [5, 10, 15] {
            std::fs::write(dir.path().join(file_name(step)), b"x").unwrap();
        }
        std::fs::write(dir.path().join(format!("{}.tmp", file_name(20))), b"half").unwrap();
        let steps: Vec<u64> = list(dir.path()).unwrap().iter().map(|s| s.0).collect();
        assert_eq!(steps, [5, 10, 15]);
        assert_eq!(latest(dir.path()).unwrap(), dir.path().join(file_name(15)));
        prune(dir.path(), 2).unwrap();
        let steps: Vec<u64> = list(dir.path()).unwrap().iter().map(|s| s.0).collect();
        assert_eq!(steps, [10, 15]);
        let e = latest(&dir.path().join("none")).unwrap_err().to_string();
        assert!(e.contains("no checkpoint"), "{e}");
    }
}
