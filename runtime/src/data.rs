//! Token streams: `.npy` and raw `u16` `.bin` files, batched per step.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use npyz::{DType, Endianness, NpyHeader, TypeChar};

use crate::error::{DataLabel, Result, RuntimeError};

/// The magic number at the start of llm.c's token files, which carry a 1024-byte header that a
/// raw `.bin` reader would otherwise take for tokens.
const LLMC_MAGIC: u32 = 20240520;

/// A sequence of token ids: a token file memory-mapped (so memory does not grow with the
/// corpus: pages are read as batches touch them and the kernel may drop them again), or ids
/// held in memory.
///
/// Built from a file with [`TokenStream::open`] or from ids with [`TokenStream::from_tokens`].
/// It does not check ids against a vocabulary: [`TokenStream::check_vocab`] and
/// [`Batch::check_vocab`] do, once the model's vocabulary size is known.
#[derive(Debug, Clone)]
pub struct TokenStream {
    storage: Storage,
    source: Option<PathBuf>,
}

/// Where a stream's ids are.
#[derive(Debug, Clone)]
enum Storage {
    /// Ids in memory.
    Owned(Vec<u32>),
    /// Integers of `width` bytes at `offset` in a mapped file (`signed`: two's complement),
    /// checked as they are read, not at open, so opening a huge file reads only its header.
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
        width: usize,
        big_endian: bool,
        signed: bool,
    },
}

impl PartialEq for TokenStream {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
            && self.len() == other.len()
            && (0..self.len()).all(|i| self.get(i) == other.get(i))
    }
}

impl Eq for TokenStream {}

impl TokenStream {
    /// Opens a token file, choosing the format by extension, and maps it into memory:
    ///
    /// - `.npy`: a 1-D array of any integer dtype (`i1`..`i8`, `u1`..`u8`, either byte order).
    ///   A value outside `0..2^32` is no token id; it is found where a vocabulary check reads
    ///   it ([`TokenStream::get`]), not here, so opening reads the header alone. Floats and
    ///   arrays of more than one dimension are rejected.
    /// - `.bin`: raw little-endian `u16` tokens with no header (nanoGPT's `train.bin`).
    ///
    /// Any other extension is an error naming the two accepted formats, and so is a path that
    /// is not a regular file (a FIFO or device would be read until memory runs out).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let format = match path.extension().and_then(|e| e.to_str()) {
            Some(f @ ("npy" | "bin")) => f,
            _ => {
                return Err(RuntimeError::UnknownTokenFormat {
                    path: path.to_path_buf(),
                })
            }
        };
        let map = map_file(path)?;
        let storage = match format {
            "npy" => read_npy(path, map)?,
            _ => read_bin(path, map)?,
        };
        Ok(TokenStream {
            storage,
            source: Some(path.to_path_buf()),
        })
    }

    /// Wraps token ids held in memory (the synthetic corpus, tests).
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        TokenStream {
            storage: Storage::Owned(tokens),
            source: None,
        }
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Owned(t) => t.len(),
            Storage::Mapped { len, .. } => *len,
        }
    }

    /// Whether the stream holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id at `index`. Panics when `index >= len()`, as slice indexing does. A value of
    /// the file that is no token id (negative, or `2^32` and above) reads as `u32::MAX`,
    /// which no vocabulary holds, so a vocabulary check refuses it ([`TokenStream::raw`]
    /// gives the value itself).
    pub fn get(&self, index: usize) -> u32 {
        u32::try_from(self.raw(index)).unwrap_or(u32::MAX)
    }

    /// The integer the stream holds at `index`, as the file stores it. Panics when
    /// `index >= len()`, as slice indexing does.
    pub fn raw(&self, index: usize) -> i128 {
        match &self.storage {
            Storage::Owned(t) => i128::from(t[index]),
            Storage::Mapped {
                map,
                offset,
                len,
                width,
                big_endian,
                signed,
            } => {
                assert!(index < *len, "token {index} of {len}");
                let at = offset + index * width;
                let raw = decode(&map[at..at + width], *big_endian);
                match signed {
                    true => {
                        let shift = 64 - 8 * *width as u32;
                        i128::from(((raw << shift) as i64) >> shift)
                    }
                    false => i128::from(raw),
                }
            }
        }
    }

    /// All token ids, in file order: borrowed when they are in memory, decoded (and so
    /// allocated) from a mapped file. For tests and small streams; batches read only their
    /// window.
    pub fn tokens(&self) -> Cow<'_, [u32]> {
        match &self.storage {
            Storage::Owned(t) => Cow::Borrowed(t),
            Storage::Mapped { .. } => Cow::Owned((0..self.len()).map(|i| self.get(i)).collect()),
        }
    }

    /// Appends the ids at `start..start + count` to `out`.
    fn extend(&self, start: usize, count: usize, out: &mut Vec<u32>) {
        match &self.storage {
            Storage::Owned(t) => out.extend_from_slice(&t[start..start + count]),
            Storage::Mapped { .. } => out.extend((start..start + count).map(|i| self.get(i))),
        }
    }

    /// The file the stream was loaded from, if any.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// A checksum of the stream's contents that reads a bounded sample, not the whole file:
    /// FNV-1a (64-bit) of the length and of [`SAMPLE_WINDOWS`] windows of
    /// [`SAMPLE_TOKENS`] ids spread evenly from the first id to the last (the whole stream
    /// when it is shorter than the windows together), as 16 hex digits. A file replaced by
    /// another of the same length differs in a window unless the two agree in all of them,
    /// so a resumed run can tell (see [`crate::train::RunSettings::data_checksum`]) at the
    /// cost of reading 64 Ki ids, whatever the file's size.
    pub fn sample_checksum(&self) -> String {
        use std::hash::Hasher;
        let mut hasher = fnv::FnvHasher::default();
        let len = self.len();
        hasher.write(&(len as u64).to_le_bytes());
        let mut hash = |range: std::ops::Range<usize>| {
            for i in range {
                hasher.write(&self.get(i).to_le_bytes());
            }
        };
        let windows = SAMPLE_WINDOWS;
        if len <= windows * SAMPLE_TOKENS {
            hash(0..len);
        } else {
            // Window w starts at w / (windows - 1) of the way to the last full window.
            let last = len - SAMPLE_TOKENS;
            for w in 0..windows {
                let start = (last as u128 * w as u128 / (windows - 1) as u128) as usize;
                hash(start..start + SAMPLE_TOKENS);
            }
        }
        format!("{:016x}", hasher.finish())
    }

    /// Checks every token of the stream against a vocabulary of `vocab` ids; the error names the
    /// first offending token's index in the stream and its value (and the file it is in).
    /// Reads the whole stream: training and evaluation check each batch as they read it
    /// instead ([`Batcher::check_batch`]).
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        match &self.storage {
            Storage::Owned(t) => check_ids(t, 0, vocab),
            Storage::Mapped { .. } => {
                match (0..self.len()).find(|&i| self.get(i) as usize >= vocab) {
                    Some(i) => Err(RuntimeError::DataOutOfVocab {
                        data: DataLabel::Words(
                            self.source
                                .as_deref()
                                .map_or(String::new(), |p| p.display().to_string()),
                        ),
                        token: self.raw(i).to_string(),
                        position: i,
                        vocab,
                    }),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Windows [`TokenStream::sample_checksum`] reads.
pub const SAMPLE_WINDOWS: usize = 16;
/// Ids in each window of [`TokenStream::sample_checksum`].
pub const SAMPLE_TOKENS: usize = 4096;

/// The integer in `bytes` (1, 2, 4 or 8 of them) in the given byte order, zero-extended.
fn decode(bytes: &[u8], big_endian: bool) -> u64 {
    let mut wide = [0u8; 8];
    if big_endian {
        wide[8 - bytes.len()..].copy_from_slice(bytes);
        u64::from_be_bytes(wide)
    } else {
        wide[..bytes.len()].copy_from_slice(bytes);
        u64::from_le_bytes(wide)
    }
}

/// Maps a token file read-only. Refuses anything but a regular file.
fn map_file(path: &Path) -> Result<Option<Arc<Mmap>>> {
    // Stat before opening: opening a FIFO blocks until something writes to it.
    let meta = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
    if !meta.is_file() {
        return Err(bad_file(
            path,
            "is not a regular file (a device, FIFO or directory); give a token file",
        ));
    }
    if meta.len() == 0 {
        // An empty mapping is an error on some systems; there is nothing to map.
        return Ok(None);
    }
    let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    // SAFETY: the map is read-only; like every reader of a file, it assumes nobody truncates
    // the file while training reads it (the weights are mapped the same way).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| io_error(path, e))?;
    Ok(Some(Arc::new(map)))
}

/// The inputs and targets of one training step.
///
/// `inputs` holds `batch * seq` ids in row-major `[batch, seq]` order; `targets[i]` is the token
/// that follows `inputs[i]` in the stream, so `targets` is `inputs` shifted by one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input ids, `[batch, seq]` row-major.
    pub inputs: Vec<u32>,
    /// Target ids, `[batch, seq]` row-major: the stream shifted by one.
    pub targets: Vec<u32>,
    /// Rows (`B`).
    pub batch: usize,
    /// Sequence length (`T`).
    pub seq: usize,
    /// Index in the stream of `inputs[0]`; `targets[i]` is at `position + 1 + i`.
    pub position: usize,
}

impl Batch {
    /// Writes the inputs and targets as the executor takes them (i32 ids) into `inputs` and
    /// `targets`, reusing their memory.
    pub fn ids_into(&self, inputs: &mut Vec<i32>, targets: &mut Vec<i32>) {
        inputs.clear();
        inputs.extend(self.inputs.iter().map(|&t| t as i32));
        targets.clear();
        targets.extend(self.targets.iter().map(|&t| t as i32));
    }

    /// Checks that every id is below `vocab`. The error names the token's absolute index in
    /// the stream (so it can be found in the file), its value and the vocabulary size.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        check_ids(&self.inputs, self.position, vocab)?;
        // Every target but the last is also an input; only the last is new.
        match self.targets.last() {
            Some(last) => check_ids(
                std::slice::from_ref(last),
                self.position + self.targets.len(),
                vocab,
            ),
            None => Ok(()),
        }
    }
}

/// Rank `rank`'s rows of a global batch, for `ranks` ranks of `micro_batches` micro-batches
/// each: `global` (ids of one step's global batch, `ranks * micro_batches` micro-batches of
/// equal size, in order) cut into those micro-batches, and rank `r`'s micro-batch `m` the
/// global micro-batch `m * ranks + r`, written into `out` (reusing its memory) in the order
/// the rank's executor feeds them.
///
/// Interleaved so that, micro-batch after micro-batch, the ranks together sum the global
/// micro-batches in their order: `W` ranks of `A` micro-batches, each summing every
/// micro-batch's gradients over the ranks into its accumulator in rank order, make the very
/// sums one rank of `W * A` micro-batches makes (whatever `W` and `A`, the same rows a
/// single rank reads). With one micro-batch, rank `r` reads the `r`-th of `ranks` equal
/// parts of the batch.
///
/// Fails when `global` does not cut into `ranks * micro_batches` equal micro-batches.
pub fn rank_rows(
    global: &[i32],
    rank: usize,
    ranks: usize,
    micro_batches: usize,
    out: &mut Vec<i32>,
) -> Result<()> {
    let parts = ranks.saturating_mul(micro_batches);
    if parts == 0 || rank >= ranks || !global.len().is_multiple_of(parts) {
        return Err(RuntimeError::Shape(format!(
            "a global batch of {} ids for rank {rank} of {ranks} ranks of {micro_batches} \
             micro-batches each: it must cut into ranks x micro-batches equal micro-batches; \
             give the schedule's batch x micro-batches x ranks rows",
            global.len()
        )));
    }
    let per = global.len() / parts;
    out.clear();
    for m in 0..micro_batches {
        let g = m * ranks + rank;
        out.extend_from_slice(&global[g * per..(g + 1) * per]);
    }
    Ok(())
}

/// Cuts a [`TokenStream`] into per-step batches of `batch` rows of `seq` tokens.
///
/// The rule, a pure function of the step so that a resumed run reads exactly what the
/// original would have:
///
/// ```text
/// n     = batch * seq
/// start = (step * n) mod len           (computed without overflow)
/// if start + n + 1 > len { start = 0 } (wrap: too few tokens remain)
/// inputs  = stream[start .. start + n]         reshaped [batch, seq]
/// targets = stream[start + 1 .. start + n + 1] reshaped [batch, seq]
/// ```
///
/// After a wrap, starts are not realigned to multiples of `n`: step `s` always starts at
/// `(s * n) mod len` unless that window would run past the end. The tail of the stream past the
/// last full window of a pass is skipped in that pass.
#[derive(Debug, Clone)]
pub struct Batcher {
    stream: TokenStream,
    batch: usize,
    seq: usize,
}

impl Batcher {
    /// Checks that `batch` and `seq` are at least 1 and that the stream holds at least
    /// `batch * seq + 1` tokens.
    pub fn new(stream: TokenStream, batch: usize, seq: usize) -> Result<Self> {
        let needed = batch
            .checked_mul(seq)
            .and_then(|n| n.checked_add(1))
            .filter(|_| batch > 0 && seq > 0);
        let Some(needed) = needed else {
            return Err(RuntimeError::InvalidBatchShape { batch, seq });
        };
        if stream.len() < needed {
            return Err(RuntimeError::TokenStreamTooShort {
                len: stream.len(),
                batch,
                seq,
                needed,
            });
        }
        Ok(Batcher { stream, batch, seq })
    }

    /// The stream being batched.
    pub fn stream(&self) -> &TokenStream {
        &self.stream
    }

    /// Rows per batch (`B`).
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Tokens per row (`T`).
    pub fn seq_len(&self) -> usize {
        self.seq
    }

    /// The index in the stream of the first input token of `step` (see the type's doc for the
    /// rule). Checkpoints record it; it depends only on the step, the shape and the stream
    /// length.
    pub fn position_for_step(&self, step: u64) -> usize {
        let n = self.batch * self.seq;
        let len = self.stream.len();
        let start = (u128::from(step) * n as u128 % len as u128) as usize;
        if start + n + 1 > len {
            0
        } else {
            start
        }
    }

    /// The pass over the stream (1-based) that batch `step` belongs to: a pass starts where a
    /// batch goes back to the stream's start, which with the rule above is batch `s` where
    /// the window after it, `(s + 1) * n`, reaches a multiple of the length; so batch `s`
    /// is in pass `floor((s + 1) * n / len) + 1`. Batch `s > 0` starts a pass when its pass
    /// is later than batch `s - 1`'s.
    pub fn epoch_of(&self, step: u64) -> u64 {
        let n = (self.batch * self.seq) as u128;
        let passes = (u128::from(step) + 1) * n / self.stream.len().max(1) as u128;
        u64::try_from(passes).unwrap_or(u64::MAX).saturating_add(1)
    }

    /// Checks that every id of `batch` (read by this batcher) is below `vocab`; the error
    /// names the data (`data`: the setting that named the file and its path, or words), the
    /// id's index in the stream and the value the file holds there.
    pub fn check_batch(&self, batch: &Batch, vocab: usize, data: &DataLabel) -> Result<()> {
        batch.check_vocab(vocab).map_err(|e| match e {
            RuntimeError::TokenOutOfRange {
                position, vocab, ..
            } => RuntimeError::DataOutOfVocab {
                data: data.clone(),
                token: self.stream.raw(position).to_string(),
                position,
                vocab,
            },
            other => other,
        })
    }

    /// The batch of `step`, freshly allocated.
    pub fn batch(&self, step: u64) -> Batch {
        let n = self.batch * self.seq;
        let mut batch = Batch {
            inputs: vec![0; n],
            targets: vec![0; n],
            batch: self.batch,
            seq: self.seq,
            position: 0,
        };
        self.fill(step, &mut batch);
        batch
    }

    /// Overwrites `out` with the batch of `step`, reusing its buffers (no allocation once they
    /// have the right size).
    pub fn fill(&self, step: u64, out: &mut Batch) {
        let n = self.batch * self.seq;
        let start = self.position_for_step(step);
        out.inputs.clear();
        self.stream.extend(start, n, &mut out.inputs);
        out.targets.clear();
        self.stream.extend(start + 1, n, &mut out.targets);
        out.batch = self.batch;
        out.seq = self.seq;
        out.position = start;
    }
}

/// Checks `ids` (which start at index `offset` of the stream) against `vocab`.
fn check_ids(ids: &[u32], offset: usize, vocab: usize) -> Result<()> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(RuntimeError::TokenOutOfRange {
            token: i64::from(ids[i]),
            position: offset + i,
            vocab,
        }),
        None => Ok(()),
    }
}

fn bad_file(path: &Path, problem: impl Into<String>) -> RuntimeError {
    RuntimeError::BadTokenFile {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> RuntimeError {
    RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The stream of a mapped raw little-endian `u16` token file.
fn read_bin(path: &Path, map: Option<Arc<Mmap>>) -> Result<Storage> {
    let Some(map) = map else {
        return Ok(Storage::Owned(Vec::new()));
    };
    let bytes: &[u8] = &map;
    if bytes.len() >= 8 {
        let words: &[[u8; 4]] = bytemuck::cast_slice(&bytes[..8]);
        let (magic, version) = (u32::from_le_bytes(words[0]), u32::from_le_bytes(words[1]));
        if magic == LLMC_MAGIC && version == 1 {
            return Err(bad_file(
                path,
                "starts with llm.c's 1024-byte token-file header, which is not tokens; \
                 strip it (`tail -c +1025 IN.bin > OUT.bin`) to get raw u16 tokens",
            ));
        }
    }
    if !bytes.len().is_multiple_of(2) {
        return Err(bad_file(
            path,
            format!(
                "has an odd number of bytes ({}), but a `.bin` token file is raw little-endian \
                 u16, 2 bytes per token; the file is truncated or holds another dtype (save \
                 other dtypes as `.npy`)",
                bytes.len()
            ),
        ));
    }
    let len = bytes.len() / 2;
    Ok(Storage::Mapped {
        map,
        offset: 0,
        len,
        width: 2,
        big_endian: false,
        signed: false,
    })
}

/// The stream of a mapped 1-D integer `.npy` array (its values are checked as they are read).
fn read_npy(path: &Path, map: Option<Arc<Mmap>>) -> Result<Storage> {
    let empty: &[u8] = &[];
    let bytes: &[u8] = map.as_deref().map_or(empty, |m| m);
    let mut data: &[u8] = bytes;
    let header = NpyHeader::from_reader(&mut data).map_err(|e| {
        bad_file(
            path,
            format!(
                "is not a readable .npy file ({e}); write token arrays with `numpy.save`, \
                 or use a raw u16 `.bin` file"
            ),
        )
    })?;
    let shape = header.shape();
    if shape.len() != 1 {
        return Err(bad_file(
            path,
            format!(
                "holds a {}-D array of shape {shape:?}, but token files must be 1-D; \
                 flatten it first (`numpy.save(path, arr.reshape(-1))`)",
                shape.len()
            ),
        ));
    }
    let count = shape[0];
    let DType::Plain(ty) = header.dtype() else {
        return Err(bad_file(
            path,
            format!(
                "holds a structured dtype ({}), but token files must hold plain integers; \
                 save a 1-D integer array",
                header.dtype().descr()
            ),
        ));
    };
    let signed = match ty.type_char() {
        TypeChar::Int => true,
        TypeChar::Uint => false,
        _ => {
            return Err(bad_file(
                path,
                format!(
                    "holds dtype `{ty}`, but token ids must be integers; convert it \
                     (`arr.astype(numpy.uint32)`) and save it again"
                ),
            ))
        }
    };
    let width = match ty.num_bytes() {
        Some(w @ (1 | 2 | 4 | 8)) => w,
        _ => {
            return Err(bad_file(
                path,
                format!(
                    "holds integer dtype `{ty}` of an unsupported width; use 1, 2, 4 or 8 bytes"
                ),
            ))
        }
    };
    let expected = u128::from(count) * width as u128;
    if data.len() as u128 != expected {
        return Err(bad_file(
            path,
            format!(
                "has a header promising {count} tokens of {width} bytes ({expected} bytes of \
                 data) but {} bytes follow it; the file is truncated or damaged, write it again",
                data.len()
            ),
        ));
    }
    let offset = bytes.len() - data.len();
    let big_endian = ty.endianness() == Endianness::Big;
    match map {
        Some(map) if count > 0 => Ok(Storage::Mapped {
            map,
            offset,
            len: count as usize,
            width,
            big_endian,
            signed,
        }),
        _ => Ok(Storage::Owned(Vec::new())),
    }
}

/// The vocabulary the schedule's token ids must fall in: the smallest embedding table or logit
/// width that indexes with them.
pub fn vocab_of(graph: &protrain_ir::Graph) -> Option<usize> {
    graph
        .ops()
        .filter_map(|(_, op)| match op.kind {
            protrain_ir::OpKind::Embedding { .. } => Some(graph.value(op.inputs[1]).ty.shape[0]),
            protrain_ir::OpKind::CrossEntropy => Some(graph.value(op.inputs[0]).ty.last_dim()),
            _ => None,
        })
        .min()
        .map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a `.npy` file image: version 1.0 header for `descr` and `shape`, then `data`.
    fn npy_bytes(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut dict =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        // magic (6) + version (2) + header length (2) + dict + '\n', padded to 64 bytes.
        while (10 + dict.len() + 1) % 64 != 0 {
            dict.push(' ');
        }
        dict.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((dict.len() as u16).to_le_bytes());
        out.extend(dict.as_bytes());
        out.extend(data);
        out
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn open_err(name: &str, bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, name, bytes);
        match TokenStream::open(&path) {
            Ok(s) => panic!("{name} loaded as {:?}, expected an error", s.tokens()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn npy_integer_dtypes_load() {
        let dir = tempfile::tempdir().unwrap();
        let ids: [u32; 4] = [0, 1, 100, 127];
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("|i1", ids.iter().map(|&v| v as u8).collect()),
            ("|u1", ids.iter().map(|&v| v as u8).collect()),
            (
                "<i2",
                ids.iter().flat_map(|&v| (v as i16).to_le_bytes()).collect(),
            ),
            (
                "<u2",
                ids.iter().flat_map(|&v| (v as u16).to_le_bytes()).collect(),
            ),
            (
                ">u2",
                ids.iter().flat_map(|&v| (v as u16).to_be_bytes()).collect(),
            ),
            (
                "<i4",
                ids.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
            ),
            ("<u4", ids.iter().flat_map(|&v| v.to_le_bytes()).collect()),
            (
                ">i8",
                ids.iter()
                    .flat_map(|&v| i64::from(v).to_be_bytes())
                    .collect(),
            ),
            (
                "<u8",
                ids.iter()
                    .flat_map(|&v| u64::from(v).to_le_bytes())
                    .collect(),
            ),
        ];
        for (descr, data) in cases {
            let path = write(&dir, "t.npy", &npy_bytes(descr, "(4,)", &data));
            let stream = TokenStream::open(&path).unwrap_or_else(|e| panic!("{descr}: {e}"));
            assert_eq!(*stream.tokens(), ids, "{descr}");
            assert_eq!(stream.source(), Some(path.as_path()));
        }
    }

    #[test]
    fn npy_written_by_npyz_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.npy");
        npyz::to_file_1d(&path, vec![5u16, 6, 7]).unwrap();
        assert_eq!(*TokenStream::open(&path).unwrap().tokens(), [5, 6, 7]);
    }

    #[test]
    fn npy_rejections_say_why() {
        let float = npy_bytes("<f4", "(2,)", &[0; 8]);
        let e = open_err("f.npy", &float);
        assert!(e.contains("`<f4`") && e.contains("must be integers"), "{e}");

        let two_d = npy_bytes("<u2", "(2, 2)", &[0; 8]);
        let e = open_err("m.npy", &two_d);
        assert!(e.contains("2-D") && e.contains("must be 1-D"), "{e}");

        // Values that are no token ids open (only the header is read) and are refused
        // where they are read, by their value.
        let dir = tempfile::tempdir().unwrap();
        let negative = write(
            &dir,
            "n.npy",
            &npy_bytes("<i2", "(2,)", &[1, 0, 0xff, 0xff]),
        );
        let stream = TokenStream::open(&negative).unwrap();
        let e = stream.check_vocab(100).unwrap_err().to_string();
        assert!(e.contains("token -1 at position 1"), "{e}");
        let huge = write(
            &dir,
            "h.npy",
            &npy_bytes("<u8", "(1,)", &u64::MAX.to_le_bytes()),
        );
        let stream = TokenStream::open(&huge).unwrap();
        let e = stream.check_vocab(100).unwrap_err().to_string();
        assert!(
            e.contains(&format!("token {} at position 0", u64::MAX)),
            "{e}"
        );

        let truncated = npy_bytes("<u2", "(3,)", &[0; 4]);
        let e = open_err("t.npy", &truncated);
        assert!(e.contains("3 tokens") && e.contains("truncated"), "{e}");

        let e = open_err("g.npy", b"not numpy at all");
        assert!(e.contains("not a readable .npy file"), "{e}");
    }

    #[test]
    fn bin_is_raw_little_endian_u16() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "t.bin", &[1, 0, 0x34, 0x12, 0xff, 0xff]);
        assert_eq!(
            *TokenStream::open(&path).unwrap().tokens(),
            [1, 0x1234, 0xffff]
        );

        let e = open_err("odd.bin", &[1, 0, 2]);
        assert!(e.contains("odd number of bytes (3)"), "{e}");

        let mut llmc = LLMC_MAGIC.to_le_bytes().to_vec();
        llmc.extend(1u32.to_le_bytes());
        let e = open_err("llmc.bin", &llmc);
        assert!(e.contains("llm.c") && e.contains("tail -c +1025"), "{e}");
    }

    #[test]
    fn unknown_extension_names_both_formats() {
        let e = open_err("tokens.txt", b"1 2 3");
        assert!(
            e.contains("tokens.txt") && e.contains(".npy") && e.contains(".bin"),
            "{e}"
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = TokenStream::open("/nonexistent/tokens.bin")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/tokens.bin"), "{e}");
    }

    /// One check per step: (batch, seq, stream length, step) -> expected start.
    fn check_position(batch: usize, seq: usize, len: usize, step: u64, expect: usize) {
        let b = Batcher::new(
            TokenStream::from_tokens((0..len as u32).collect()),
            batch,
            seq,
        )
        .unwrap();
        assert_eq!(
            b.position_for_step(step),
            expect,
            "B={batch} T={seq} len={len} s={step}"
        );
        let got = b.batch(step);
        let n = batch * seq;
        // The stream is 0..len, so every token equals its index.
        let want: Vec<u32> = (expect as u32..(expect + n) as u32).collect();
        assert_eq!(got.inputs, want);
        assert_eq!(got.targets, want.iter().map(|t| t + 1).collect::<Vec<_>>());
        assert_eq!((got.batch, got.seq, got.position), (batch, seq, expect));
    }

    #[test]
    fn batching_follows_the_documented_rule() {
        // len 100, n = 30: 0, 30, 60, then 90 + 31 > 100 wraps to 0, then 120 % 100 = 20 ...
        check_position(3, 10, 100, 0, 0);
        check_position(3, 10, 100, 1, 30);
        check_position(3, 10, 100, 2, 60);
        check_position(3, 10, 100, 3, 0);
        check_position(3, 10, 100, 4, 20);
        check_position(3, 10, 100, 5, 50);
        check_position(3, 10, 100, 6, 0);
        check_position(3, 10, 100, 7, 10);
        // A window ending exactly at the last token does not wrap: 2 * 4 + 4 + 1 = 13 = len.
        check_position(2, 2, 13, 2, 8);
        // The shortest stream: every step reads the whole stream.
        check_position(2, 3, 7, 0, 0);
        check_position(2, 3, 7, 1, 0);
        check_position(2, 3, 7, 5, 0);
        // Huge steps do not overflow: (u64::MAX * 6) mod 7 = 6, and 6 + 7 > 7 wraps.
        check_position(2, 3, 7, u64::MAX, 0);
        check_position(1, 1, 1000, u64::MAX, (u64::MAX % 1000) as usize);
    }

    #[test]
    fn batch_rows_are_row_major_and_fill_reuses_buffers() {
        let b = Batcher::new(TokenStream::from_tokens((0..50).collect()), 2, 3).unwrap();
        let batch = b.batch(1);
        assert_eq!(batch.inputs, [6, 7, 8, 9, 10, 11]);
        assert_eq!(batch.targets, [7, 8, 9, 10, 11, 12]);
        let mut reused = b.batch(0);
        let capacity = reused.inputs.as_ptr();
        b.fill(1, &mut reused);
        assert_eq!(reused, batch);
        assert_eq!(reused.inputs.as_ptr(), capacity);
    }

    #[test]
    fn short_stream_and_empty_shapes_are_errors() {
        let e = Batcher::new(TokenStream::from_tokens(vec![0; 8]), 2, 4).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("8 tokens") && e.contains("needs 9"), "{e}");
        let e = Batcher::new(TokenStream::from_tokens(vec![0; 8]), 0, 4).unwrap_err();
        assert!(e.to_string().contains("batch 0"), "{e}");
        let e = Batcher::new(TokenStream::from_tokens(vec![0; 8]), usize::MAX, 4).unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidBatchShape { .. }), "{e}");
    }

    #[test]
    fn vocab_check_names_absolute_position_value_and_vocab() {
        let mut tokens: Vec<u32> = vec![1; 40];
        tokens[25] = 300;
        let b = Batcher::new(TokenStream::from_tokens(tokens.clone()), 2, 5).unwrap();
        assert!(b.batch(0).check_vocab(256).is_ok());
        // Step 2 reads inputs 20..30: the bad token is an input.
        let e = b.batch(2).check_vocab(256).unwrap_err().to_string();
        assert!(
            e.contains("300") && e.contains("position 25") && e.contains("256"),
            "{e}"
        );
        // Step 1 reads inputs 10..20 and the last target is token 20: fine.
        assert!(b.batch(1).check_vocab(256).is_ok());
        // A stream whose bad token is only the last target of a batch.
        tokens[25] = 1;
        tokens[10] = 256;
        let b = Batcher::new(TokenStream::from_tokens(tokens.clone()), 1, 10).unwrap();
        let e = b.batch(0).check_vocab(256).unwrap_err();
        assert!(matches!(
            e,
            RuntimeError::TokenOutOfRange {
                token: 256,
                position: 10,
                vocab: 256
            }
        ));
        let e = TokenStream::from_tokens(tokens)
            .check_vocab(256)
            .unwrap_err();
        assert!(e.to_string().contains("position 10"), "{e}");
    }

    #[test]
    fn a_batch_check_names_the_data_and_the_value_the_file_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut ids: Vec<i32> = (0..21).collect();
        ids[15] = -5;
        let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let path = write(&dir, "t.npy", &npy_bytes("<i4", "(21,)", &bytes));
        let b = Batcher::new(TokenStream::open(&path).unwrap(), 1, 10).unwrap();
        let label = DataLabel::File {
            setting: crate::error::Setting::Data,
            path: "t.npy".into(),
        };
        assert!(b.check_batch(&b.batch(0), 256, &label).is_ok());
        let e = b.check_batch(&b.batch(1), 256, &label).unwrap_err();
        let library = e.to_string();
        assert!(
            library.starts_with("data t.npy: token -5 at position 15"),
            "{library}"
        );
        let worded = e.worded(|_| "--data".into());
        assert!(
            worded.starts_with("--data t.npy: token -5 at position 15"),
            "{worded}"
        );
    }

    /// Anonymous resident memory of this process, from /proc/self/status (Linux).
    fn rss_anon_kib() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    #[test]
    fn a_token_file_is_mapped_not_read_into_memory() {
        // 64 MiB of u16 tokens: read whole and widened to u32 this took about 192 MiB of
        // anonymous memory; mapped, batches touch only their window.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.bin");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(64 << 20).unwrap();
        drop(file);
        let Some(before) = rss_anon_kib() else {
            return; // not Linux: nothing to measure
        };
        let stream = TokenStream::open(&path).unwrap();
        assert_eq!(stream.len(), 32 << 20);
        let batcher = Batcher::new(stream, 4, 64).unwrap();
        assert_eq!(batcher.batch(1000).inputs.len(), 256);
        let grown = rss_anon_kib().unwrap().saturating_sub(before);
        assert!(grown < 16 << 10, "anonymous memory grew by {grown} KiB");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_not_a_token_file() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("zero.bin");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = TokenStream::open(&link).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    /// Rank `r`'s micro-batch `m` is the global micro-batch `m * W + r`: with 2 ranks of 2
    /// micro-batches of 2 ids, rank 0 reads micro-batches 0 and 2, rank 1 reads 1 and 3; with
    /// one micro-batch a rank reads its contiguous part; every id is read once over the ranks.
    #[test]
    fn ranks_read_the_global_micro_batches_interleaved() {
        let global: Vec<i32> = (0..8).collect();
        let mut out = Vec::new();
        let cases: [(usize, usize, usize, &[i32]); 5] = [
            (0, 2, 2, &[0, 1, 4, 5]),
            (1, 2, 2, &[2, 3, 6, 7]),
            (1, 2, 1, &[4, 5, 6, 7]),
            (3, 4, 1, &[6, 7]),
            (0, 1, 4, &[0, 1, 2, 3, 4, 5, 6, 7]),
        ];
        for (rank, ranks, k, want) in cases {
            rank_rows(&global, rank, ranks, k, &mut out).unwrap();
            assert_eq!(out, want, "rank {rank} of {ranks} x {k}");
        }
        let mut seen: Vec<i32> = Vec::new();
        for rank in 0..4 {
            rank_rows(&global, rank, 4, 2, &mut out).unwrap();
            seen.extend(&out);
        }
        seen.sort_unstable();
        assert_eq!(seen, global);
        for (rank, ranks, k) in [(0, 3, 1), (2, 2, 1), (0, 0, 1), (0, 2, 0)] {
            let e = rank_rows(&global, rank, ranks, k, &mut out)
                .unwrap_err()
                .to_string();
            assert!(e.contains("batch x micro-batches x ranks rows"), "{e}");
        }
    }
}
