//! Hugging Face safetensors weights: memory-mapped reading (single or sharded), writing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensors;

use crate::error::{Result, RuntimeError};
use protrain_ir::output::write_atomic;

pub use safetensors::Dtype;

/// The file name transformers gives a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The file name transformers gives the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// How many problems a mismatch error lists before summarising the rest.
const LISTED_PROBLEMS: usize = 5;

/// Name suffixes of buffers that checkpoints carry but that are not parameters (GPT-2's causal
/// mask, LLaMA's RoPE frequencies); they are never reported as unexpected.
const NON_PARAMETER_SUFFIXES: [&str; 3] =
    [".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"];

/// Elements converted per parallel task.
const CONVERT_CHUNK: usize = 1 << 16;

/// A set of tensors in safetensors format: one file or the shards of an index, memory-mapped.
///
/// Opening parses and validates every header (offsets, sizes, dtypes) but reads no tensor
/// data; [`WeightFile::read_f32`] copies one tensor out, converting it to `f32`. The files must
/// not be modified while open: the maps would change under the reader (files written by
/// [`save_safetensors`] are replaced by rename, which is safe).
#[derive(Debug)]
pub struct WeightFile {
    source: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
    metadata: BTreeMap<String, String>,
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: Mmap,
}

#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the shard's map.
    bytes: Range<usize>,
}

/// The JSON index of a sharded checkpoint, as transformers writes it.
#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl WeightFile {
    /// Opens weights at `path`: a `.safetensors` file, a sharded checkpoint's
    /// `*.safetensors.index.json` (its `weight_map` names each tensor's shard, relative to the
    /// index), or a directory holding `model.safetensors.index.json` or `model.safetensors`
    /// (the index is preferred when both are there).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join(INDEX_FILE);
            let single = path.join(SINGLE_FILE);
            return if index.is_file() {
                Self::open_index(&index)
            } else if single.is_file() {
                Self::open_single(&single)
            } else {
                Err(RuntimeError::WeightsNotFound {
                    path: path.to_path_buf(),
                    problem: format!(
                        "the directory holds neither {INDEX_FILE} nor {SINGLE_FILE}{}; pass the \
                         path of the .safetensors file or of the index",
                        match safetensors_in(path).as_slice() {
                            [] => String::new(),
                            found => format!(" (it holds {})", found.join(", ")),
                        }
                    ),
                })
            };
        }
        if !path.exists() {
            return Err(RuntimeError::WeightsNotFound {
                path: path.to_path_buf(),
                problem: "no such file or directory; pass a .safetensors file, a \
                          model.safetensors.index.json or a directory holding one"
                    .into(),
            });
        }
        // Checked before opening: opening a FIFO blocks until something writes to it.
        if !path.is_file() {
            return Err(RuntimeError::WeightsNotFound {
                path: path.to_path_buf(),
                problem: "is not a regular file (a device, FIFO or socket); pass a \
                          .safetensors file, a model.safetensors.index.json or a directory \
                          holding one"
                    .into(),
            });
        }
        if path.to_string_lossy().ends_with(".json") {
            Self::open_index(path)
        } else {
            Self::open_single(path)
        }
    }

    fn open_single(path: &Path) -> Result<Self> {
        let mut file = WeightFile {
            source: path.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            metadata: BTreeMap::new(),
        };
        let (shard, metadata) = map_shard(path)?;
        file.add_shard(shard, &metadata, None)?;
        Ok(file)
    }

    fn open_index(path: &Path) -> Result<Self> {
        // An index names each tensor's shard: a few hundred KiB for the largest models.
        const MAX_INDEX_BYTES: u64 = 64 << 20;
        let io = |source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_INDEX_BYTES {
            return Err(RuntimeError::WeightsNotFound {
                path: path.to_path_buf(),
                problem: format!(
                    "is {len} bytes, more than the 64 MiB a safetensors index may hold; pass \
                     the model.safetensors.index.json saved with the weights"
                ),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let index: Index =
            serde_json::from_str(&text).map_err(|e| RuntimeError::BadWeightFile {
                path: path.to_path_buf(),
                problem: format!(
                    "not a safetensors shard index ({e}); it must be JSON with a \"weight_map\" \
                 object from tensor name to shard file, as transformers writes it"
                ),
            })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut by_shard: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (name, shard) in &index.weight_map {
            by_shard.entry(shard).or_default().insert(name);
        }
        let mut file = WeightFile {
            source: path.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            metadata: BTreeMap::new(),
        };
        for (shard_name, names) in by_shard {
            let shard_path = dir.join(shard_name);
            if !shard_path.is_file() {
                return Err(RuntimeError::WeightsNotFound {
                    path: shard_path,
                    problem: format!(
                        "shard named by {} (for {} tensors) is missing; download every shard \
                         into the directory of the index",
                        path.display(),
                        names.len()
                    ),
                });
            }
            let (shard, metadata) = map_shard(&shard_path)?;
            file.add_shard(shard, &metadata, Some(&names))?;
        }
        Ok(file)
    }

    /// Records a mapped shard's tensors; with `only`, just those names, each of which must be
    /// present.
    fn add_shard(
        &mut self,
        shard: Shard,
        metadata: &(usize, Metadata),
        only: Option<&BTreeSet<&str>>,
    ) -> Result<()> {
        let (header_len, metadata) = metadata;
        let data_start = 8 + header_len;
        let index = self.shards.len();
        let all = metadata.tensors();
        let names: Vec<&str> = match only {
            Some(only) => only.iter().copied().collect(),
            None => all.keys().map(String::as_str).collect(),
        };
        for name in names {
            let Some(info) = all.get(name) else {
                return Err(RuntimeError::BadWeightFile {
                    path: shard.path.clone(),
                    problem: format!(
                        "the index {} puts tensor `{name}` in this shard, but the shard does \
                         not hold it; the index and shards are from different checkpoints: \
                         download them again together",
                        self.source.display()
                    ),
                });
            };
            let TensorInfo {
                dtype,
                shape,
                data_offsets: (begin, end),
            } = (*info).clone();
            self.tensors.insert(
                name.to_string(),
                Entry {
                    shard: index,
                    dtype,
                    shape,
                    bytes: data_start + begin..data_start + end,
                },
            );
        }
        if let Some(extra) = metadata.metadata() {
            self.metadata
                .extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        self.shards.push(shard);
        Ok(())
    }

    /// The path that was opened (a file or an index).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The shard files, in the order their tensors were indexed.
    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> + '_ {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.tensors.keys().map(String::as_str)
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Whether a tensor of this name is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The `__metadata__` string map of the file (of all shards, merged).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// A tensor's shape.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    /// A tensor's stored dtype.
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.entry(name)?.dtype)
    }

    /// Copies a tensor into `out` as `f32`, converting from F32, BF16 or F16 (exactly: every
    /// value of those types is an `f32`). `out` must have exactly as many elements as the
    /// tensor; other stored dtypes are an error naming the tensor and the dtype.
    pub fn read_f32(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let entry = self.entry(name)?;
        let count: usize = entry.shape.iter().product();
        if out.len() != count {
            return Err(RuntimeError::TensorSizeMismatch {
                name: name.to_string(),
                shape: entry.shape.clone(),
                expected: count,
                got: out.len(),
            });
        }
        let bytes = &self.shards[entry.shard].map[entry.bytes.clone()];
        let size = match entry.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(RuntimeError::UnsupportedTensorDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let dtype = entry.dtype;
        out.par_chunks_mut(CONVERT_CHUNK)
            .zip(bytes.par_chunks(CONVERT_CHUNK * size))
            .for_each(|(out, bytes)| match dtype {
                // Stored little-endian, and at any alignment: read as byte arrays.
                Dtype::F32 => {
                    let words: &[[u8; 4]] = bytemuck::cast_slice(bytes);
                    for (o, w) in out.iter_mut().zip(words) {
                        *o = f32::from_le_bytes(*w);
                    }
                }
                Dtype::BF16 => {
                    let halves: &[[u8; 2]] = bytemuck::cast_slice(bytes);
                    for (o, h) in out.iter_mut().zip(halves) {
                        *o = bf16::from_le_bytes(*h).to_f32();
                    }
                }
                _ => {
                    let halves: &[[u8; 2]] = bytemuck::cast_slice(bytes);
                    for (o, h) in out.iter_mut().zip(halves) {
                        *o = f16::from_le_bytes(*h).to_f32();
                    }
                }
            });
        Ok(())
    }

    /// Reads a tensor into a new `Vec<f32>`; see [`WeightFile::read_f32`].
    pub fn read_f32_vec(&self, name: &str) -> Result<Vec<f32>> {
        let mut out = vec![0.0; self.entry(name)?.shape.iter().product()];
        self.read_f32(name, &mut out)?;
        Ok(out)
    }

    /// Matches the file against the tensors a model expects and returns, for each expected
    /// tensor in order, the name it is stored under: the first of its `names` present.
    ///
    /// It is an error, listing the first few problems and the total, if any expected tensor has
    /// none of its names present (the closest name present is suggested), is stored with
    /// another shape, is stored in a dtype [`WeightFile::read_f32`] cannot convert, or if the
    /// file holds tensors no expected tensor names. Names ending in `.attn.bias`,
    /// `.attn.masked_bias` or `rotary_emb.inv_freq` are buffers, not parameters, and are
    /// ignored; so is a second alias of an expected tensor (a tied `lm_head.weight` stored
    /// beside the embedding), which is not read or checked.
    pub fn check_against(&self, expected: &[ExpectedTensor]) -> Result<Vec<String>> {
        let mut resolved = Vec::with_capacity(expected.len());
        let mut missing = Vec::new();
        let mut problems = Vec::new();
        for tensor in expected {
            let Some(found) = tensor.names.iter().find(|n| self.contains(n)) else {
                missing.push(tensor);
                continue;
            };
            let entry = &self.tensors[found.as_str()];
            if entry.shape != tensor.shape {
                problems.push(format!(
                    "  wrong shape: `{found}` is {:?} in the file, the model expects {:?}",
                    entry.shape, tensor.shape
                ));
            } else if !matches!(entry.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                problems.push(format!(
                    "  unsupported dtype: `{found}` is stored as {:?} (F32, BF16 or F16 load)",
                    entry.dtype
                ));
            }
            resolved.push(found.clone());
        }

        let known: HashSet<&str> = expected
            .iter()
            .flat_map(|t| t.names.iter().map(String::as_str))
            .collect();
        let extras: Vec<&str> = self
            .names()
            .filter(|n| !known.contains(n) && !is_non_parameter(n))
            .collect();

        let mut report: Vec<String> = missing
            .iter()
            .map(|tensor| {
                let name = tensor.names.first().map_or("(unnamed)", String::as_str);
                let hint = closest(name, extras.iter().copied())
                    .map(|c| format!(" (closest present: `{c}`)"))
                    .unwrap_or_default();
                let aliases = match tensor.names.len() {
                    0 | 1 => String::new(),
                    _ => format!(" or its aliases {:?}", &tensor.names[1..]),
                };
                format!("  missing: `{name}`{aliases} {:?}{hint}", tensor.shape)
            })
            .collect();
        report.append(&mut problems);
        report.extend(extras.iter().map(|&name| {
            let entry = &self.tensors[name];
            format!(
                "  unexpected: `{name}` {:?} is not a tensor of the model",
                entry.shape
            )
        }));
        if report.is_empty() {
            return Ok(resolved);
        }
        let count = report.len();
        report.truncate(LISTED_PROBLEMS);
        if count > LISTED_PROBLEMS {
            report.push(format!("  ... and {} more", count - LISTED_PROBLEMS));
        }
        Err(RuntimeError::WeightsMismatch {
            count,
            report: report.join("\n"),
        })
    }

    /// The stored bytes of an F32 tensor (little-endian), straight from the map: a reader
    /// that needs part of a tensor touches only those bytes. Another dtype is an error naming
    /// the tensor and its dtype.
    pub fn f32_bytes(&self, name: &str) -> Result<&[u8]> {
        let entry = self.entry(name)?;
        if entry.dtype != Dtype::F32 {
            return Err(RuntimeError::UnsupportedTensorDtype {
                name: name.to_string(),
                dtype: format!("{:?} (F32 expected here)", entry.dtype),
            });
        }
        Ok(&self.shards[entry.shard].map[entry.bytes.clone()])
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.tensors
            .get(name)
            .ok_or_else(|| RuntimeError::TensorNotFound {
                name: name.to_string(),
                hint: closest(name, self.names())
                    .map(|c| format!("; did you mean `{c}`?"))
                    .unwrap_or_default(),
            })
    }
}

/// A tensor a model expects: its canonical Hugging Face name first, then accepted aliases
/// (older or differently wrapped checkpoints: GPT-2's `transformer.wte.weight` stored as
/// `wte.weight`), and its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// Canonical name, then aliases, in order of preference.
    pub names: Vec<String>,
    /// The shape the model needs.
    pub shape: Vec<usize>,
}

impl ExpectedTensor {
    /// A tensor known by one name.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>) -> Self {
        ExpectedTensor {
            names: vec![name.into()],
            shape: shape.into(),
        }
    }

    /// Adds an accepted alias, tried after the names already given.
    pub fn alias(mut self, name: impl Into<String>) -> Self {
        self.names.push(name.into());
        self
    }
}

/// The element type [`save_safetensors`] stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageDtype {
    /// 32-bit float, exact.
    F32,
    /// bfloat16, rounded to nearest even.
    BF16,
    /// IEEE half, rounded to nearest even (overflow gives infinity).
    F16,
}

impl StorageDtype {
    /// The safetensors dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            StorageDtype::F32 => Dtype::F32,
            StorageDtype::BF16 => Dtype::BF16,
            StorageDtype::F16 => Dtype::F16,
        }
    }

    fn size(self) -> usize {
        match self {
            StorageDtype::F32 => 4,
            StorageDtype::BF16 | StorageDtype::F16 => 2,
        }
    }
}

/// Writes `tensors` (name, shape, row-major values) to a safetensors file at `path`, each
/// stored as `dtype`, with the string map `metadata` plus `"format": "pt"` (as transformers
/// writes; a caller's own `format` entry wins).
///
/// The write is atomic ([`write_atomic`]): a crash leaves the old file or the new one, never a
/// torn one. Tensors are laid out sorted by name, as the safetensors crate does, and
/// converted in bounded pieces, so memory stays small however large the tensors.
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(&str, &[usize], &[f32])],
    dtype: StorageDtype,
    metadata: &[(&str, &str)],
) -> Result<()> {
    for &(name, shape, values) in tensors {
        let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if count != Some(values.len()) {
            return Err(RuntimeError::InvalidTensorToSave {
                name: name.to_string(),
                problem: format!(
                    "shape {shape:?} has {} elements but {} values were given; pass values of \
                     the shape's size",
                    count.map_or("too many".to_string(), |c| c.to_string()),
                    values.len()
                ),
            });
        }
    }
    let specs: Vec<(&str, &[usize])> = tensors.iter().map(|&(n, s, _)| (n, s)).collect();
    save_safetensors_streamed(path, &specs, dtype, metadata, &mut |i| {
        Ok(tensors[i].2.to_vec())
    })
}

/// [`save_safetensors`] of tensors given by name and shape (`specs`), whose values `values`
/// hands over one tensor at a time when it is written (its index into `specs`), in the order
/// the file lays them out ([`safetensors_order`]): the writer holds one tensor at a time,
/// however many there are. A tensor of the wrong length is an error naming it; the file is
/// then not written (nor is it when `values` fails).
pub fn save_safetensors_streamed(
    path: impl AsRef<Path>,
    specs: &[(&str, &[usize])],
    dtype: StorageDtype,
    metadata: &[(&str, &str)],
    values: &mut dyn FnMut(usize) -> Result<Vec<f32>>,
) -> Result<()> {
    let path = path.as_ref();
    let order = safetensors_order(specs.iter().map(|s| s.0));
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    for (k, &i) in order.iter().enumerate() {
        let (name, shape) = specs[i];
        let invalid = |problem: String| RuntimeError::InvalidTensorToSave {
            name: name.to_string(),
            problem,
        };
        if k > 0 && specs[order[k - 1]].0 == name {
            return Err(invalid(
                "the name is given twice; tensor names must be unique".into(),
            ));
        }
        if name == "__metadata__" {
            return Err(invalid(
                "the name is reserved by the safetensors format".into(),
            ));
        }
        let count = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| invalid(format!("shape {shape:?} has too many elements")))?;
        let end = offset + count * dtype.size();
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: dtype.dtype(),
                shape: shape.to_vec(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }

    let mut extra: HashMap<String, String> = metadata
        .iter()
        .map(|&(k, v)| (k.to_string(), v.to_string()))
        .collect();
    extra
        .entry("format".to_string())
        .or_insert_with(|| "pt".to_string());
    let invalid_header = |e: &dyn std::fmt::Display| RuntimeError::InvalidTensorToSave {
        name: "__metadata__".into(),
        problem: format!("the header cannot be built ({e})"),
    };
    let header = Metadata::new(Some(extra), infos).map_err(|e| invalid_header(&e))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| invalid_header(&e))?;
    // The format wants the data to start 8-byte aligned; pad the JSON with spaces, as the
    // safetensors crate does.
    header.resize(header.len().next_multiple_of(8), b' ');

    // An error of `values` (or a wrong length) is kept here; the I/O error that stops the
    // write only carries it out of `write_atomic`, which then removes its temporary file.
    let mut failed: Option<RuntimeError> = None;
    let written = write_atomic(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        // Values are converted a piece at a time to little-endian bit patterns, then written
        // as bytes.
        let mut bits32: Vec<u32> = Vec::with_capacity(CONVERT_CHUNK);
        let mut bits16: Vec<u16> = Vec::with_capacity(CONVERT_CHUNK);
        for &i in &order {
            let (name, shape) = specs[i];
            let want: usize = shape.iter().product();
            let data = match values(i) {
                Ok(data) if data.len() == want => data,
                Ok(data) => {
                    failed = Some(RuntimeError::InvalidTensorToSave {
                        name: name.to_string(),
                        problem: format!(
                            "shape {shape:?} has {want} elements but {} values were given; \
                             pass values of the shape's size",
                            data.len()
                        ),
                    });
                    return Err(std::io::Error::other("a tensor of the wrong size"));
                }
                Err(e) => {
                    failed = Some(e);
                    return Err(std::io::Error::other("reading a tensor failed"));
                }
            };
            for piece in data.chunks(CONVERT_CHUNK) {
                match dtype {
                    StorageDtype::F32 => {
                        bits32.clear();
                        bits32.extend(piece.iter().map(|v| v.to_bits().to_le()));
                        w.write_all(bytemuck::cast_slice(&bits32))?;
                    }
                    StorageDtype::BF16 | StorageDtype::F16 => {
                        bits16.clear();
                        bits16.extend(piece.iter().map(|&v| {
                            let bits = match dtype {
                                StorageDtype::BF16 => bf16::from_f32(v).to_bits(),
                                _ => f16::from_f32(v).to_bits(),
                            };
                            bits.to_le()
                        }));
                        w.write_all(bytemuck::cast_slice(&bits16))?;
                    }
                }
            }
        }
        Ok(())
    });
    if let Some(e) = failed {
        return Err(e);
    }
    written.map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The order [`save_safetensors`] lays tensors out in, as indices into `names`: sorted by
/// name, as the safetensors crate does (a stable sort, so duplicates keep their order).
pub fn safetensors_order<'a>(names: impl Iterator<Item = &'a str>) -> Vec<usize> {
    let names: Vec<&str> = names.collect();
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by_key(|&i| names[i]);
    order
}

/// Maps a safetensors file and validates its header.
fn map_shard(path: &Path) -> Result<(Shard, (usize, Metadata))> {
    let file = File::open(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is read-only and lives as long as the `WeightFile`; the type's
    // contract is that its files are not modified while open (the project's own writer
    // replaces files by rename, which leaves existing maps intact).
    let map = unsafe { Mmap::map(&file) }.map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let metadata = SafeTensors::read_metadata(&map).map_err(|e| RuntimeError::BadWeightFile {
        path: path.to_path_buf(),
        problem: format!(
            "not a valid safetensors file ({e}; {} bytes); it is truncated, damaged or another \
             format: download or write it again",
            map.len()
        ),
    })?;
    Ok((
        Shard {
            path: path.to_path_buf(),
            map,
        },
        metadata,
    ))
}

/// The `.safetensors` files in a directory, for error messages.
fn safetensors_in(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".safetensors") || n.ends_with(".index.json"))
        .collect();
    found.sort();
    found
}

fn is_non_parameter(name: &str) -> bool {
    NON_PARAMETER_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// The candidate most like `name`, if any is close: one is the other with leading dotted
/// components added or removed (`wte.weight` / `transformer.wte.weight`), or the edit distance
/// is at most a third of the longer name. Ties go to the first candidate.
fn closest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let dotted_suffix = |long: &str, short: &str| {
        long.len() > short.len()
            && long.ends_with(short)
            && long.as_bytes()[long.len() - short.len() - 1] == b'.'
    };
    candidates
        .filter_map(|c| {
            let score = if dotted_suffix(name, c) || dotted_suffix(c, name) {
                0
            } else {
                let d = edit_distance(name, c);
                if d * 3 > name.len().max(c.len()) {
                    return None;
                }
                d
            };
            Some((score, c))
        })
        .min_by_key(|&(score, _)| score)
        .map(|(_, c)| c)
}

/// Levenshtein distance over bytes (tensor names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 - n as f32 / 2.0) * scale)
            .collect()
    }

    /// A small GPT-2-like set: (name, shape, values).
    fn gpt2ish() -> Vec<(String, Vec<usize>, Vec<f32>)> {
        vec![
            (
                "transformer.wte.weight".into(),
                vec![10, 4],
                values(40, 0.01),
            ),
            (
                "transformer.h.0.ln_1.weight".into(),
                vec![4],
                values(4, 0.5),
            ),
            (
                "transformer.h.0.attn.c_attn.weight".into(),
                vec![4, 12],
                values(48, 0.02),
            ),
            (
                "transformer.h.0.attn.bias".into(),
                vec![1, 1, 3, 3],
                vec![1.0; 9],
            ),
        ]
    }

    fn save(path: &Path, set: &[(String, Vec<usize>, Vec<f32>)], dtype: StorageDtype) {
        let refs: Vec<(&str, &[usize], &[f32])> = set
            .iter()
            .map(|(n, s, v)| (n.as_str(), s.as_slice(), v.as_slice()))
            .collect();
        save_safetensors(path, &refs, dtype, &[("step", "7")]).unwrap();
    }

    fn expected() -> Vec<ExpectedTensor> {
        vec![
            ExpectedTensor::new("transformer.wte.weight", [10, 4]).alias("wte.weight"),
            ExpectedTensor::new("transformer.h.0.ln_1.weight", [4]).alias("h.0.ln_1.weight"),
            ExpectedTensor::new("transformer.h.0.attn.c_attn.weight", [4, 12])
                .alias("h.0.attn.c_attn.weight"),
        ]
    }

    #[test]
    fn round_trips_in_every_storage_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let set = gpt2ish();
        for dtype in [StorageDtype::F32, StorageDtype::BF16, StorageDtype::F16] {
            let path = dir.path().join(format!("{dtype:?}.safetensors"));
            save(&path, &set, dtype);
            let leftovers = std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .ends_with(".tmp")
                })
                .count();
            assert_eq!(leftovers, 0);
            let file = WeightFile::open(&path).unwrap();
            assert_eq!(file.len(), set.len());
            assert_eq!(
                file.metadata().get("format").map(String::as_str),
                Some("pt")
            );
            assert_eq!(file.metadata().get("step").map(String::as_str), Some("7"));
            for (name, shape, want) in &set {
                assert_eq!(file.shape(name).unwrap(), shape.as_slice());
                assert_eq!(file.dtype(name).unwrap(), dtype.dtype());
                let got = file.read_f32_vec(name).unwrap();
                let round = |v: f32| match dtype {
                    StorageDtype::F32 => v,
                    StorageDtype::BF16 => bf16::from_f32(v).to_f32(),
                    StorageDtype::F16 => f16::from_f32(v).to_f32(),
                };
                let want: Vec<f32> = want.iter().map(|&v| round(v)).collect();
                assert_eq!(got, want, "{name} as {dtype:?}");
            }
            // The safetensors crate itself accepts what we wrote.
            let bytes = std::fs::read(&path).unwrap();
            let parsed = SafeTensors::deserialize(&bytes).unwrap();
            assert_eq!(parsed.len(), set.len());
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_like_half() {
        // (f32 bits, bf16 bits): ties go to the even neighbour, above-half rounds up.
        let cases: [(u32, u16); 6] = [
            (0x3f80_8000, 0x3f80), // tie, 0x3f80 is even: down
            (0x3f81_8000, 0x3f82), // tie, 0x3f81 is odd: up
            (0x3f80_8001, 0x3f81), // just above the tie: up
            (0x3f80_7fff, 0x3f80), // just below: down
            (0x7f7f_ffff, 0x7f80), // f32::MAX rounds to infinity
            (0xbf80_0000, 0xbf80), // -1.0 exact
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.safetensors");
        let inputs: Vec<f32> = cases.iter().map(|c| f32::from_bits(c.0)).collect();
        save_safetensors(&path, &[("x", &[6], &inputs)], StorageDtype::BF16, &[]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let parsed = SafeTensors::deserialize(&bytes).unwrap();
        let stored: Vec<u16> = parsed
            .tensor("x")
            .unwrap()
            .data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        for (i, &(from, to)) in cases.iter().enumerate() {
            assert_eq!(stored[i], to, "{from:#010x}");
            assert_eq!(stored[i], bf16::from_f32(f32::from_bits(from)).to_bits());
        }
    }

    #[test]
    fn opens_a_sharded_index_and_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let set = gpt2ish();
        save(
            &dir.path().join("model-00001-of-00002.safetensors"),
            &set[..2],
            StorageDtype::F32,
        );
        save(
            &dir.path().join("model-00002-of-00002.safetensors"),
            &set[2..],
            StorageDtype::BF16,
        );
        let weight_map: BTreeMap<&str, String> = set
            .iter()
            .enumerate()
            .map(|(i, (n, _, _))| {
                let shard = if i < 2 { 1 } else { 2 };
                (
                    n.as_str(),
                    format!("model-0000{shard}-of-00002.safetensors"),
                )
            })
            .collect();
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        // A stray single file: the index must win.
        save(&dir.path().join(SINGLE_FILE), &set[..1], StorageDtype::F32);

        for path in [dir.path().join(INDEX_FILE), dir.path().to_path_buf()] {
            let file = WeightFile::open(&path).unwrap();
            assert_eq!(file.source(), dir.path().join(INDEX_FILE));
            assert_eq!(file.shard_paths().count(), 2);
            assert_eq!(file.len(), 4);
            assert_eq!(
                file.dtype("transformer.h.0.attn.bias").unwrap(),
                Dtype::BF16
            );
            let got = file.read_f32_vec("transformer.wte.weight").unwrap();
            assert_eq!(got, set[0].2);
            let resolved = file.check_against(&expected()).unwrap();
            assert_eq!(resolved[0], "transformer.wte.weight");
        }

        // Without the index, the directory falls back to model.safetensors.
        std::fs::remove_file(dir.path().join(INDEX_FILE)).unwrap();
        assert_eq!(WeightFile::open(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn index_naming_a_tensor_its_shard_lacks_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        save(
            &dir.path().join("a.safetensors"),
            &gpt2ish()[..1],
            StorageDtype::F32,
        );
        let index = r#"{"weight_map": {"transformer.wte.weight": "a.safetensors",
                                       "lm_head.weight": "a.safetensors"}}"#;
        std::fs::write(dir.path().join(INDEX_FILE), index).unwrap();
        let e = WeightFile::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("`lm_head.weight`") && e.contains("different checkpoints"),
            "{e}"
        );

        let index = r#"{"weight_map": {"transformer.wte.weight": "b.safetensors"}}"#;
        std::fs::write(dir.path().join(INDEX_FILE), index).unwrap();
        let e = WeightFile::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("b.safetensors") && e.contains("missing"), "{e}");

        std::fs::write(dir.path().join(INDEX_FILE), "{\"weights\": {}}").unwrap();
        let e = WeightFile::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("weight_map"), "{e}");
    }

    #[test]
    fn aliases_resolve_and_buffers_and_tied_copies_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.safetensors");
        // An old-style checkpoint: no `transformer.` prefix, a tied lm_head stored beside wte,
        // and the attention mask buffer.
        let set = vec![
            ("wte.weight".to_string(), vec![10, 4], values(40, 0.1)),
            ("lm_head.weight".to_string(), vec![10, 4], values(40, 0.1)),
            ("h.0.ln_1.weight".to_string(), vec![4], values(4, 1.0)),
            (
                "h.0.attn.c_attn.weight".to_string(),
                vec![4, 12],
                values(48, 1.0),
            ),
            ("h.0.attn.masked_bias".to_string(), vec![1], vec![-1e4]),
        ];
        save(&path, &set, StorageDtype::F32);
        let file = WeightFile::open(&path).unwrap();
        let mut want = expected();
        want[0] = want[0].clone().alias("lm_head.weight");
        let resolved = file.check_against(&want).unwrap();
        assert_eq!(
            resolved,
            ["wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight"]
        );
    }

    #[test]
    fn mismatch_error_lists_problems_with_names_and_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("other.safetensors");
        let set = vec![
            // Wrong shape.
            (
                "transformer.wte.weight".to_string(),
                vec![12, 4],
                values(48, 0.1),
            ),
            // Missing `transformer.h.0.ln_1.weight`; a misspelt one is present.
            (
                "transformer.h.0.ln1.weight".to_string(),
                vec![4],
                values(4, 1.0),
            ),
            (
                "transformer.h.0.attn.c_attn.weight".to_string(),
                vec![4, 12],
                values(48, 1.0),
            ),
            // Extra tensors from a bigger model.
            (
                "transformer.h.1.ln_1.weight".to_string(),
                vec![4],
                values(4, 1.0),
            ),
            (
                "transformer.h.1.ln_2.weight".to_string(),
                vec![4],
                values(4, 1.0),
            ),
            (
                "transformer.h.1.mlp.c_fc.weight".to_string(),
                vec![4, 16],
                values(64, 1.0),
            ),
            (
                "transformer.h.1.mlp.c_proj.weight".to_string(),
                vec![16, 4],
                values(64, 1.0),
            ),
        ];
        save(&path, &set, StorageDtype::F32);
        let e = WeightFile::open(&path)
            .unwrap()
            .check_against(&expected())
            .unwrap_err();
        let RuntimeError::WeightsMismatch { count, .. } = &e else {
            panic!("expected a mismatch, got {e}");
        };
        assert_eq!(*count, 7, "{e}");
        let text = e.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "the weights do not match the model: 7 problem(s)");
        assert_eq!(
            lines[1],
            "  missing: `transformer.h.0.ln_1.weight` or its aliases [\"h.0.ln_1.weight\"] [4] \
             (closest present: `transformer.h.0.ln1.weight`)"
        );
        assert_eq!(
            lines[2],
            "  wrong shape: `transformer.wte.weight` is [12, 4] in the file, the model expects \
             [10, 4]"
        );
        assert!(
            lines[3].starts_with("  unexpected: `transformer.h.0.ln1.weight` [4]"),
            "{text}"
        );
        assert_eq!(lines[6], "  ... and 2 more", "{text}");
        assert!(text.contains("pass the config that matches it"), "{text}");
    }

    #[test]
    fn unsupported_dtype_and_bad_buffers_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ints.safetensors");
        let ids: Vec<u8> = (0..8i64).flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::I64, vec![8], &ids).unwrap();
        safetensors::serialize_to_file([("position_ids", view)], None, &path).unwrap();
        let file = WeightFile::open(&path).unwrap();
        let e = file.read_f32_vec("position_ids").unwrap_err().to_string();
        assert!(e.contains("`position_ids`") && e.contains("I64"), "{e}");
        let e = file
            .check_against(&[ExpectedTensor::new("position_ids", [8])])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unsupported dtype: `position_ids` is stored as I64"),
            "{e}"
        );

        let path = dir.path().join("w.safetensors");
        save(&path, &gpt2ish(), StorageDtype::F32);
        let file = WeightFile::open(&path).unwrap();
        let e = file
            .read_f32("transformer.wte.weight", &mut [0.0; 3])
            .unwrap_err();
        assert!(e.to_string().contains("40 elements") && e.to_string().contains("holds 3"));
        let e = file
            .shape("transformer.wte.weights")
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `transformer.wte.weight`"), "{e}");
    }

    #[test]
    fn save_rejects_malformed_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let check = |tensors: &[(&str, &[usize], &[f32])], want: &str| {
            let e = save_safetensors(&path, tensors, StorageDtype::F32, &[]).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
            assert!(!path.exists());
        };
        check(
            &[("a", &[2, 2], &[1.0; 3])],
            "shape [2, 2] has 4 elements but 3 values",
        );
        check(&[("a", &[1], &[1.0]), ("a", &[1], &[1.0])], "given twice");
        check(&[("__metadata__", &[1], &[1.0])], "reserved");
        check(&[("a", &[usize::MAX, 2], &[])], "too many elements");
    }

    #[test]
    fn missing_truncated_and_foreign_files_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let e = WeightFile::open(dir.path().join("nope.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nope.safetensors") && e.contains("no such file"),
            "{e}"
        );
        let e = WeightFile::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains(INDEX_FILE) && e.contains(SINGLE_FILE), "{e}");

        let path = dir.path().join("w.safetensors");
        save(&path, &gpt2ish(), StorageDtype::F32);
        let bytes = std::fs::read(&path).unwrap();
        // Cut in the data, in the header, in the length prefix, and empty.
        for cut in [bytes.len() - 1, bytes.len() / 2, 20, 3, 0] {
            let cut_path = dir.path().join(format!("cut{cut}.safetensors"));
            std::fs::write(&cut_path, &bytes[..cut]).unwrap();
            let e = WeightFile::open(&cut_path).unwrap_err().to_string();
            assert!(
                e.contains(&format!("cut{cut}")) && e.contains("truncated"),
                "{cut}: {e}"
            );
        }
        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"\xff\xff\xff\xff\xff\xff\xff\xffPK\x03\x04").unwrap();
        let e = WeightFile::open(&junk).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors file"), "{e}");
    }

    #[test]
    fn closest_name_heuristic() {
        let names = [
            "transformer.h.0.ln_1.weight",
            "lm_head.weight",
            "h.0.mlp.c_fc.weight",
        ];
        let pick = |n: &str| closest(n, names.iter().copied());
        assert_eq!(
            pick("transformer.h.0.ln_1.bias"),
            Some("transformer.h.0.ln_1.weight")
        );
        assert_eq!(
            pick("transformer.h.0.mlp.c_fc.weight"),
            Some("h.0.mlp.c_fc.weight")
        );
        assert_eq!(pick("model.embed_tokens.weight"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
