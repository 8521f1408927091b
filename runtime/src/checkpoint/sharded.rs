//! Sharded checkpoints: each rank of a data-parallel run writes its own shard file, rank 0 a
//! manifest naming them.
//!
//! After step `N` of a run of `W` ranks, rank `r` writes `step-NNNNNNNN.rank-r-of-W.safetensors`
//! (atomically, as every checkpoint file): the pieces of the training state it *owns*, each
//! tensor's piece stored under the tensor's name as a flat f32 tensor, its first element in
//! the metadata (`start.NAME`) and the FNV-1a checksum of every [`BLOCK`]-element block of it
//! (`blocks.NAME`, 16 hex digits a block). A rank owns the elements it holds of a tensor in a
//! sharded chunk (its slice of the chunk); a tensor every rank holds whole (a persistent or
//! replicated chunk's) is owned by the lowest rank holding it, rank 0, so replicated state is
//! written once. No rank gathers anything: each writes what it holds.
//!
//! The ranks then exchange each shard's size and the checksum of its header (the safetensors
//! header, whose block checksums cover every byte of its data), and rank 0 writes
//! `step-NNNNNNNN.manifest.json` last, atomically: the run's metadata (as a single-file
//! checkpoint's, plus `ranks`), every tensor with its shape and pieces (shard, first element,
//! length), every shard file with its size and header checksum, and the checksum of the
//! manifest itself. Only a manifest makes a sharded checkpoint count ([`super::list`]): a
//! run killed while its ranks write leaves shard files and no manifest, which are ignored
//! and pruned with the checkpoints older than the kept ones.
//!
//! Reading ([`Shards::open`]) checks the manifest's checksum, that its pieces tile every
//! tensor, and that every shard file is there with its size, header checksum, step and rank;
//! the data is checked when it is read ([`Shards::read`]), block by block, so a rank that
//! resumes reads (and checks) only the blocks holding the elements it needs, whatever the
//! number of ranks that wrote the checkpoint. A damaged block is an error naming the shard
//! file ([`RuntimeError::BadCheckpoint`]), which every rank learns of before it trains
//! ([`super::Checkpoint::restore`]), so all of them fall back to the checkpoint before it.

use super::{fnv1a, metadata_checksum, METADATA_CHECKSUM_KEY, PREFIX};
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::executor::{Executor, StateTensor};
use crate::weights::{save_safetensors_streamed, StorageDtype, WeightFile};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Elements per checksummed block of a piece: a reader checks (and so reads) whole blocks,
/// 256 KiB of f32 at most beyond each end of the elements it needs.
pub(super) const BLOCK: usize = 1 << 16;

/// The file name suffix of a sharded checkpoint's manifest.
pub(super) const MANIFEST_SUFFIX: &str = ".manifest.json";

/// The value of a manifest's `format` field, with its layout version.
const MANIFEST_FORMAT: &str = "protrain.sharded-checkpoint/1";

/// The metadata key that marks a shard file; its value is the layout version.
const SHARD_KEY: &str = "protrain.checkpoint_shard";

/// The shard layout this build writes and reads.
const SHARD_VERSION: &str = "1";

/// The metadata key prefix of a piece's first element.
const START_PREFIX: &str = "start.";

/// The metadata key prefix of a piece's block checksums.
const BLOCKS_PREFIX: &str = "blocks.";

/// The manifest of the checkpoint after `step`: `step-00000040.manifest.json`.
pub fn manifest_name(step: u64) -> String {
    format!("{PREFIX}{step:08}{MANIFEST_SUFFIX}")
}

/// Rank `rank`'s shard file of the checkpoint after `step` of a run of `ranks` ranks:
/// `step-00000040.rank-1-of-4.safetensors`.
pub fn shard_name(step: u64, rank: usize, ranks: usize) -> String {
    format!("{PREFIX}{step:08}.rank-{rank}-of-{ranks}.safetensors")
}

/// The step of a shard file's name ([`shard_name`]); `None` for any other name.
pub(super) fn shard_step(name: &str) -> Option<u64> {
    let rest = name.strip_prefix(PREFIX)?.strip_suffix(".safetensors")?;
    let (digits, rank) = rest.split_once(".rank-")?;
    let (r, w) = rank.split_once("-of-")?;
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (numeric(digits) && numeric(r) && numeric(w))
        .then(|| digits.parse().ok())
        .flatten()
}

/// A sharded checkpoint's manifest, as its JSON file holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Manifest {
    /// [`MANIFEST_FORMAT`].
    format: String,
    /// What a single-file checkpoint's metadata holds (step, data position, fingerprint,
    /// settings, the metadata's own checksum), and `ranks`.
    pub metadata: BTreeMap<String, String>,
    /// Every tensor of the training state, parameters first, in the writer's order.
    pub tensors: Vec<ManifestTensor>,
    /// Every rank's shard file, in rank order.
    pub shards: Vec<ManifestShard>,
    /// FNV-1a (64-bit, 16 hex digits) of the manifest's JSON with this field empty.
    checksum: String,
}

/// A tensor of a sharded checkpoint and the pieces of it the shards hold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct ManifestTensor {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its pieces, by first element; together they hold every element once.
    pub pieces: Vec<Piece>,
}

/// Elements `start..start + len` of a tensor, held by shard `shard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Piece {
    /// The shard (the rank that wrote it).
    pub shard: usize,
    /// Its first element.
    pub start: usize,
    /// Its elements.
    pub len: usize,
}

/// A shard file as the manifest names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct ManifestShard {
    /// Its file name, in the checkpoint directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// FNV-1a (64-bit, 16 hex digits) of its first `8 + header length` bytes: the
    /// safetensors header, whose block checksums cover its data.
    pub checksum: String,
}

impl Manifest {
    /// The checksum of the manifest's JSON with its checksum field empty.
    fn compute_checksum(&self) -> String {
        let blank = Manifest {
            checksum: String::new(),
            ..self.clone()
        };
        let text = serde_json::to_string(&blank).expect("a manifest encodes as JSON");
        format!("{:016x}", fnv1a(text.as_bytes()))
    }
}

/// The pieces of each tensor and who writes them: rank `q` owns the elements it holds unless a
/// lower rank holds any of them (every rank holds a replicated tensor whole: rank 0 owns it).
/// A schedule whose ranks together do not hold every element of a tensor once is refused.
fn pieces(tensors: &[StateTensor]) -> Result<Vec<Vec<Piece>>> {
    tensors
        .iter()
        .map(|t| {
            let mut owned: Vec<Piece> = Vec::new();
            for (q, held) in t.held.iter().enumerate() {
                let overlaps = t.held[..q]
                    .iter()
                    .any(|p| p.start < held.end && held.start < p.end);
                if !held.is_empty() && !overlaps {
                    owned.push(Piece {
                        shard: q,
                        start: held.start,
                        len: held.len(),
                    });
                }
            }
            owned.sort_by_key(|p| p.start);
            check_tiling(&t.name, t.len, &owned).map_err(|problem| {
                RuntimeError::BadSchedule(format!(
                    "the ranks do not hold every element of {} once ({problem}), so no \
                     checkpoint of their shards can hold it; recompile the schedule with this \
                     protrain",
                    t.name
                ))
            })?;
            Ok(owned)
        })
        .collect()
}

/// Whether `pieces` (by first element) hold elements `0..len` once each; what is wrong when
/// they do not.
fn check_tiling(name: &str, len: usize, pieces: &[Piece]) -> std::result::Result<(), String> {
    let mut next = 0usize;
    for p in pieces {
        if p.start != next {
            return Err(format!(
                "{name}: a piece starts at element {} where {next} was expected",
                p.start
            ));
        }
        next = p
            .start
            .checked_add(p.len)
            .ok_or_else(|| format!("{name}: a piece of {} elements overflows", p.len))?;
    }
    if next != len {
        return Err(format!(
            "{name}: the pieces hold {next} of its {len} elements"
        ));
    }
    Ok(())
}

/// The block checksums of `values`, concatenated (16 hex digits a block).
fn block_checksums(values: &[f32]) -> String {
    let mut out = String::with_capacity(values.len().div_ceil(BLOCK) * 16);
    let mut bytes = Vec::with_capacity(4 * BLOCK);
    for block in values.chunks(BLOCK) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
        out.push_str(&format!("{:016x}", fnv1a(&bytes)));
    }
    out
}

/// The size of the file at `path` and the checksum of its safetensors header (its first
/// `8 + n` bytes, `n` the little-endian u64 it starts with).
fn header_checksum(path: &Path) -> Result<(u64, String)> {
    let io = |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let n = u64::from_le_bytes(len);
    if n.checked_add(8).is_none_or(|end| end > size) {
        return Err(RuntimeError::BadCheckpoint {
            path: path.to_path_buf(),
            problem: format!(
                "is damaged: its header claims {n} bytes of a {size}-byte file; resume from an \
                 earlier checkpoint"
            ),
        });
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    let mut bytes = len.to_vec();
    bytes.extend_from_slice(&header);
    Ok((size, format!("{:016x}", fnv1a(&bytes))))
}

/// Writes this rank's shard of the checkpoint after `step` to `dir`; every rank of the run
/// must call it at the same step. `metadata` is the run's (what a single-file checkpoint
/// records, but the tensor checksums and the metadata's own). Rank 0 writes the manifest
/// once every rank's shard is written and returns its path; the others return `None`. When a
/// rank fails to write its shard, every rank fails and no manifest is written.
pub(super) fn write<B: Backend>(
    dir: &Path,
    executor: &Executor<'_, B>,
    step: u64,
    metadata: Vec<(String, String)>,
) -> Result<Option<PathBuf>> {
    let (rank, ranks) = executor.rank();
    let tensors = executor.state_tensors();
    let pieces = pieces(&tensors)?;
    let shard_path = dir.join(shard_name(step, rank, ranks));
    let written = write_shard(&shard_path, executor, step, &tensors, &pieces);
    // Each rank's outcome, its shard's size and header checksum: 1 + 8 + 8 bytes.
    let mut send = vec![0u8; 17];
    if let Ok((bytes, sum)) = &written {
        send[0] = 1;
        send[1..9].copy_from_slice(&bytes.to_le_bytes());
        let sum = u64::from_str_radix(sum, 16).expect("a checksum is 16 hex digits");
        send[9..].copy_from_slice(&sum.to_le_bytes());
    }
    let all = executor.exchange(&send)?;
    written?;
    let manifest_path = dir.join(manifest_name(step));
    if let Some(q) = all.iter().position(|s| s[0] != 1) {
        return Err(RuntimeError::BadCheckpoint {
            path: manifest_path,
            problem: format!(
                "was not written: rank {q} could not write its shard ({}); its error says \
                 why",
                shard_name(step, q, ranks)
            ),
        });
    }
    if rank != 0 {
        return Ok(None);
    }
    let u64_at =
        |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    let shards = all
        .iter()
        .enumerate()
        .map(|(q, s)| ManifestShard {
            file: shard_name(step, q, ranks),
            bytes: u64_at(s, 1),
            checksum: format!("{:016x}", u64_at(s, 9)),
        })
        .collect();
    let mut metadata: BTreeMap<String, String> = metadata.into_iter().collect();
    metadata.insert("ranks".into(), ranks.to_string());
    let sum = metadata_checksum(metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    metadata.insert(METADATA_CHECKSUM_KEY.into(), sum);
    let mut manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        metadata,
        tensors: tensors
            .iter()
            .zip(pieces)
            .map(|(t, pieces)| ManifestTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                pieces,
            })
            .collect(),
        shards,
        checksum: String::new(),
    };
    manifest.checksum = manifest.compute_checksum();
    let text = serde_json::to_string_pretty(&manifest).expect("a manifest encodes as JSON");
    protrain_ir::output::write_atomic(&manifest_path, |w| w.write_all(text.as_bytes())).map_err(
        |source| RuntimeError::Io {
            path: manifest_path.clone(),
            source,
        },
    )?;
    Ok(Some(manifest_path))
}

/// Writes the pieces `pieces` says this rank owns to `path`, with their first elements and
/// block checksums; returns the file's size and header checksum. Each piece is read twice
/// from the executor (for its checksums, which the header holds, then for the data), so the
/// rank never holds more than one piece beyond its state.
fn write_shard<B: Backend>(
    path: &Path,
    executor: &Executor<'_, B>,
    step: u64,
    tensors: &[StateTensor],
    pieces: &[Vec<Piece>],
) -> Result<(u64, String)> {
    let (rank, ranks) = executor.rank();
    let mine: Vec<(usize, Piece)> = pieces
        .iter()
        .enumerate()
        .flat_map(|(i, ps)| ps.iter().filter(|p| p.shard == rank).map(move |&p| (i, p)))
        .collect();
    let mut metadata: Vec<(String, String)> = vec![
        (SHARD_KEY.into(), SHARD_VERSION.into()),
        ("step".into(), step.to_string()),
        ("rank".into(), rank.to_string()),
        ("ranks".into(), ranks.to_string()),
    ];
    for &(i, p) in &mine {
        let name = &tensors[i].name;
        let values = executor.read_held(i)?;
        if values.len() != p.len {
            return Err(RuntimeError::BadSchedule(format!(
                "rank {rank} read {} elements of {name} where it holds {}; recompile the \
                 schedule with this protrain",
                values.len(),
                p.len
            )));
        }
        metadata.push((format!("{START_PREFIX}{name}"), p.start.to_string()));
        metadata.push((format!("{BLOCKS_PREFIX}{name}"), block_checksums(&values)));
    }
    let shapes: Vec<[usize; 1]> = mine.iter().map(|(_, p)| [p.len]).collect();
    let specs: Vec<(&str, &[usize])> = mine
        .iter()
        .zip(&shapes)
        .map(|((i, _), s)| (tensors[*i].name.as_str(), s.as_slice()))
        .collect();
    let metadata: Vec<(&str, &str)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    save_safetensors_streamed(path, &specs, StorageDtype::F32, &metadata, &mut |k| {
        executor.read_held(mine[k].0)
    })?;
    header_checksum(path)
}

/// A sharded checkpoint opened and checked but for its data: the manifest, and each shard
/// file mapped.
#[derive(Debug)]
pub(super) struct Shards {
    /// The manifest.
    pub manifest: Manifest,
    /// Each shard, in rank order.
    files: Vec<WeightFile>,
    /// Each tensor's index in the manifest by name.
    by_name: BTreeMap<String, usize>,
}

impl Shards {
    /// Opens the sharded checkpoint whose manifest is at `path` and checks everything but
    /// its data: the manifest's checksum and format, that the pieces tile every tensor, that
    /// every shard file is there with the size and header checksum the manifest names, and
    /// that each says the manifest's step and its own rank and holds its pieces with their
    /// first elements and block checksums.
    pub fn open(path: &Path) -> Result<Self> {
        let manifest = read_manifest(path)?;
        let bad = |problem: String| RuntimeError::BadCheckpoint {
            path: path.to_path_buf(),
            problem,
        };
        let ranks = manifest.shards.len();
        let mut by_name = BTreeMap::new();
        for (i, t) in manifest.tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(bad(format!(
                    "is damaged: it names tensor {} twice; resume from an earlier checkpoint",
                    t.name
                )));
            }
            let len = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let tiled = len
                .ok_or_else(|| format!("{}: its shape overflows", t.name))
                .and_then(|len| check_tiling(&t.name, len, &t.pieces));
            if let Some(p) = t.pieces.iter().find(|p| p.shard >= ranks) {
                return Err(bad(format!(
                    "is damaged: a piece of {} is in shard {}, but it names {ranks} shards; \
                     resume from an earlier checkpoint",
                    t.name, p.shard
                )));
            }
            tiled.map_err(|problem| {
                bad(format!(
                    "is damaged: its pieces do not hold every element once ({problem}); resume \
                     from an earlier checkpoint"
                ))
            })?;
        }
        let recorded = manifest.metadata.get("ranks");
        if recorded != Some(&ranks.to_string()) {
            return Err(bad(format!(
                "is damaged: it records {} rank(s) but names {ranks} shard file(s); resume from \
                 an earlier checkpoint",
                recorded.map_or("no", String::as_str)
            )));
        }
        let step = manifest.metadata.get("step").cloned().unwrap_or_default();
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut files = Vec::with_capacity(ranks);
        for (q, shard) in manifest.shards.iter().enumerate() {
            let file_path = dir.join(&shard.file);
            let bad_shard = |problem: String| RuntimeError::BadCheckpoint {
                path: file_path.clone(),
                problem: format!("{problem}; resume from an earlier checkpoint"),
            };
            if shard.file.contains(['/', '\\']) || shard.file.starts_with('.') {
                return Err(bad(format!(
                    "is damaged: it names shard file {:?} outside its directory; resume from \
                     an earlier checkpoint",
                    shard.file
                )));
            }
            let (size, sum) = match header_checksum(&file_path) {
                Ok(found) => found,
                Err(RuntimeError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    return Err(bad_shard(format!(
                        "is missing (the manifest {} names it as rank {q}'s shard)",
                        path.display()
                    )))
                }
                Err(RuntimeError::Io { source, .. }) => {
                    return Err(bad_shard(format!("cannot be read ({source})")))
                }
                Err(e) => return Err(e),
            };
            if size != shard.bytes {
                return Err(bad_shard(format!(
                    "is damaged: it has {size} bytes, the manifest says {}",
                    shard.bytes
                )));
            }
            if sum != shard.checksum {
                return Err(bad_shard(format!(
                    "is damaged: its header has checksum {sum}, the manifest says {}",
                    shard.checksum
                )));
            }
            let file = WeightFile::open(&file_path)?;
            let meta = file.metadata();
            let field = |key: &str| meta.get(key).map_or("(none)", String::as_str);
            for (key, want) in [
                (SHARD_KEY, SHARD_VERSION.to_string()),
                ("step", step.clone()),
                ("rank", q.to_string()),
                ("ranks", ranks.to_string()),
            ] {
                if field(key) != want {
                    return Err(bad_shard(format!(
                        "is not the shard the manifest names: its `{key}` is {}, not {want}",
                        field(key)
                    )));
                }
            }
            files.push(file);
        }
        for t in &manifest.tensors {
            for p in &t.pieces {
                let file = &files[p.shard];
                let problem = |what: String| RuntimeError::BadCheckpoint {
                    path: file.source().to_path_buf(),
                    problem: format!(
                        "is damaged: its piece of {} {what}; resume from an earlier \
                             checkpoint",
                        t.name
                    ),
                };
                let meta = file.metadata();
                let start = meta.get(&format!("{START_PREFIX}{}", t.name));
                if start != Some(&p.start.to_string()) {
                    return Err(problem(format!(
                        "starts at element {}, the manifest says {}",
                        start.map_or("(none)", String::as_str),
                        p.start
                    )));
                }
                let blocks = meta
                    .get(&format!("{BLOCKS_PREFIX}{}", t.name))
                    .map_or(0, String::len);
                if blocks != 16 * p.len.div_ceil(BLOCK) {
                    return Err(problem("lacks block checksums".into()));
                }
                let bytes = file
                    .f32_bytes(&t.name)
                    .map_err(|e| problem(e.to_string()))?;
                if bytes.len() != 4 * p.len {
                    return Err(problem(format!(
                        "holds {} bytes, the manifest says {} elements",
                        bytes.len(),
                        p.len
                    )));
                }
            }
        }
        Ok(Self {
            manifest,
            files,
            by_name,
        })
    }

    /// The ranks that wrote the checkpoint.
    pub fn ranks(&self) -> usize {
        self.files.len()
    }

    /// The tensor named `name`: its index in the manifest, when it has one.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Elements `range` of tensor `index` (of the manifest), read from the shards that hold
    /// them; every block read is checked against its checksum first, and only the blocks
    /// holding elements of `range` are read.
    pub fn read(&self, index: usize, range: Range<usize>) -> Result<Vec<f32>> {
        let t = &self.manifest.tensors[index];
        let mut out = vec![0.0f32; range.len()];
        for p in &t.pieces {
            let (a, z) = (range.start.max(p.start), range.end.min(p.start + p.len));
            if a >= z {
                continue;
            }
            let file = &self.files[p.shard];
            let bytes = file.f32_bytes(&t.name)?;
            let sums = &file.metadata()[&format!("{BLOCKS_PREFIX}{}", t.name)];
            let (first, last) = ((a - p.start) / BLOCK, (z - 1 - p.start) / BLOCK);
            for b in first..=last {
                let block = b * BLOCK..((b + 1) * BLOCK).min(p.len);
                let data = &bytes[4 * block.start..4 * block.end];
                let have = format!("{:016x}", fnv1a(data));
                let want = &sums[16 * b..16 * b + 16];
                if have != want {
                    return Err(RuntimeError::BadCheckpoint {
                        path: file.source().to_path_buf(),
                        problem: format!(
                            "is damaged: block {b} of {} (elements {}..{}) has checksum \
                             {have}, but {want} was written; resume from an earlier checkpoint",
                            t.name,
                            p.start + block.start,
                            p.start + block.end
                        ),
                    });
                }
                // The elements of this block that `range` wants.
                let lo = (p.start + block.start).max(a);
                let hi = (p.start + block.end).min(z);
                for e in lo..hi {
                    let at = 4 * (e - p.start);
                    out[e - range.start] =
                        f32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
                }
            }
        }
        Ok(out)
    }
}

/// Reads and checks the manifest at `path`: JSON of the manifest layout, its format, its
/// checksum.
pub(super) fn read_manifest(path: &Path) -> Result<Manifest> {
    let bad = |problem: String| RuntimeError::BadCheckpoint {
        path: path.to_path_buf(),
        problem,
    };
    // A manifest lists the checkpoint's tensors and shards: far under this for any model.
    const MAX_MANIFEST_BYTES: u64 = 256 << 20;
    let io = |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() || meta.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "is not a regular file of at most 256 MiB ({} bytes); it is damaged, resume from \
             an earlier checkpoint",
            meta.len()
        )));
    }
    let text = std::fs::read(path).map_err(io)?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| {
        bad(format!(
            "is not a readable manifest ({e}); it is damaged, resume from an earlier checkpoint"
        ))
    })?;
    if manifest.format != MANIFEST_FORMAT {
        return Err(bad(format!(
            "has manifest format {:?}, this build reads {MANIFEST_FORMAT:?}; resume it with \
             the protrain that wrote it",
            manifest.format
        )));
    }
    let have = manifest.compute_checksum();
    if have != manifest.checksum {
        return Err(bad(format!(
            "is damaged: the manifest has checksum {have}, but {} was written; resume from an \
             earlier checkpoint",
            manifest.checksum
        )));
    }
    Ok(manifest)
}

/// Every shard file in `dir` as `(step, path)`: those of complete checkpoints and those a
/// killed save left without a manifest.
pub(super) fn shard_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
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
        if let Some(step) = entry.file_name().to_str().and_then(shard_step) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, len: usize, held: &[Range<usize>]) -> StateTensor {
        StateTensor {
            name: name.into(),
            shape: vec![len],
            len,
            held: held.to_vec(),
        }
    }

    #[test]
    fn ranks_own_their_slices_and_rank_0_the_replicated_tensors() {
        let t = [
            tensor("whole", 10, &[0..10, 0..10, 0..10]),
            tensor("split", 10, &[0..4, 4..8, 8..10]),
            // A small tensor inside rank 2's slice alone.
            tensor("tail", 3, &[0..0, 0..0, 0..3]),
        ];
        let p = pieces(&t).unwrap();
        let owners = |i: usize| {
            p[i].iter()
                .map(|p| (p.shard, p.start, p.len))
                .collect::<Vec<_>>()
        };
        assert_eq!(owners(0), [(0, 0, 10)]);
        assert_eq!(owners(1), [(0, 0, 4), (1, 4, 4), (2, 8, 2)]);
        assert_eq!(owners(2), [(2, 0, 3)]);
        // Ranks that leave elements out cannot be checkpointed.
        let e = pieces(&[tensor("gap", 10, &[0..4, 5..10])]).unwrap_err();
        assert!(
            e.to_string().contains("gap: a piece starts at element 5"),
            "{e}"
        );
    }

    #[test]
    fn shard_names_round_trip_and_nothing_else_is_a_shard() {
        assert_eq!(shard_step(&shard_name(40, 1, 4)), Some(40));
        assert_eq!(
            shard_name(40, 1, 4),
            "step-00000040.rank-1-of-4.safetensors"
        );
        for name in [
            "step-00000040.safetensors",
            "step-00000040.manifest.json",
            ".step-00000040.rank-1-of-4.safetensors.a1B2c3.tmp",
            "step-00000040.rank-x-of-4.safetensors",
            "step-00000040.rank-1-of-.safetensors",
        ] {
            assert_eq!(shard_step(name), None, "{name}");
        }
    }

    #[test]
    fn block_checksums_are_fnv1a_of_each_blocks_bytes() {
        let values: Vec<f32> = (0..BLOCK + 3).map(|i| i as f32).collect();
        let sums = block_checksums(&values);
        assert_eq!(sums.len(), 32);
        let bytes: Vec<u8> = values[BLOCK..]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(&sums[16..], format!("{:016x}", fnv1a(&bytes)));
    }
}
