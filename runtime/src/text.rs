//! Text corpora: tokenized once with a Hugging Face `tokenizer.json` into a token file cached
//! beside the corpus, which is then read like any other token file.
//!
//! # Documents and the end-of-text token
//!
//! A corpus is UTF-8 text (a leading byte-order mark is skipped), read as lines ended by `\n`.
//! When the tokenizer defines an end-of-text token (the first of [`END_OF_TEXT_NAMES`] that is a
//! *special* added token of the tokenizer.json), a line whose text (less its `\n` and then less
//! one `\r`) is exactly that token's text separates documents, as in TinyStories' text files.
//! The line break that ends a document right before a separator (`\n` or `\r\n`) belongs to the
//! separator. Each document is encoded on its own, without the tokenizer's post-processor
//! specials (`add_special_tokens = false`, like nanoGPT's `encode_ordinary`); documents that
//! yield no tokens are dropped; the end-of-text id goes *between* consecutive documents, not
//! after the last. Without an end-of-text token the whole corpus is one document and no line is
//! special. Inside a document, text that spells an added token becomes that token's id, as
//! `Tokenizer::encode` does. The tokenizer's truncation and padding settings are switched off:
//! a corpus is never cut to a model's maximum length.
//!
//! `runtime/tests/fixtures/text/make_fixtures.py` implements the same rule with Python's
//! `tokenizers`, and the tests hold the ids produced here to the ids produced there.
//!
//! # Pieces: bounded memory
//!
//! The corpus is read in pieces of at most [`TextOptions::piece_bytes`] and each piece is cut
//! into segments of about 64 KiB that are encoded in parallel, so memory does not grow with the
//! corpus. Pieces and segments end where encoding pieces separately gives the same ids as
//! encoding the whole document: after a separator line, or at the start of a line that begins
//! with a character that is not white space. GPT-2-style byte-level BPE (GPT-2, GPT-NeoX,
//! Llama 3 and their pre-tokenizer patterns) always splits words there, so for those
//! tokenizers the ids equal encoding each document whole. Only where a piece holds no such
//! place does the cut fall elsewhere: before its last complete line that is not a separator;
//! or, when one line is longer than a piece, before a line break or between two characters.
//! Documents and separators are found all the same. Tokenizers that add a prefix space to every
//! input (SentencePiece's `Metaspace`) see each segment as a new input, so their ids may differ
//! from whole-document encoding at segment starts.
//!
//! # The cache
//!
//! Tokens go to `CORPUS.TTTTTTTTTTTTTTTT-SSSSSSSSSSSSSSSS.tokens.bin` beside the corpus (raw
//! little-endian `u16`, the format [`TokenStream::open`] reads), where `T…` is a 64-bit FNV-1a
//! hash of the tokenizer.json's bytes and `S…` a hash of the corpus's size, its modification time
//! and the version of the rule above. A tokenizer with more than 65,536 ids writes a `.npy` of
//! `u32` instead (`.tokens.npy`). A cache whose name matches is reused; a changed tokenizer or a
//! corpus with another size or time gets a new name and is tokenized again, and the caches of
//! older versions of the same corpus are deleted once the new one is written. (A corpus
//! rewritten with the same size within the file system's time resolution is not noticed; touch
//! it.) The file is written atomically ([`write_atomic_checked`]): a crash leaves no partial
//! cache under the final name.
//!
//! When the corpus's directory cannot take the cache (read-only, not permitted, or the name is
//! taken by something that is not a regular file), the cache goes to
//! [`TextOptions::fallback_dir`] (by default `protrain-token-cache` in the system temporary
//! directory) under a name that also holds a hash of the corpus's full path, and
//! [`Tokenized::fallback_reason`] says why. Lookups try beside the corpus first, then there. A
//! failure after tokenizing began (a full disk) is an error, not a fallback.

use std::fs::File;
use std::hash::Hasher;
use std::io::{BufWriter, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use fnv::FnvHasher;
use protrain_ir::output::{check_target, write_atomic_checked};
use rayon::prelude::*;
use tokenizers::Tokenizer;

use crate::data::TokenStream;
use crate::error::{Result, RuntimeError};

/// The texts that mark a tokenizer's end-of-text token, in the order they are looked for among
/// its special added tokens: GPT-2 and GPT-NeoX, Llama 3, Llama 2, Mistral and OPT, Gemma.
pub const END_OF_TEXT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// The default for [`TextOptions::piece_bytes`].
pub const DEFAULT_PIECE_BYTES: usize = 4 << 20;

/// The smallest piece [`tokenize`] reads, whatever [`TextOptions::piece_bytes`] says: a
/// separator line must fit in a piece to be seen as one.
pub const MIN_PIECE_BYTES: usize = 64;

/// The size segments of a piece grow to before one is cut off to be encoded on its own thread.
const SEGMENT_BYTES: usize = 64 << 10;

/// The most ids a `u16` token file holds.
const U16_IDS: usize = 1 << 16;

/// The version of the document and cut rules. A cache written under another version has another
/// name, so changing the rules re-tokenizes every corpus.
const RULE_VERSION: u64 = 1;

/// The byte-order mark some editors write at the start of UTF-8 files.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A tokenizer's end-of-text token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOfText {
    /// Its text, such as `<|endoftext|>`; a corpus line of exactly this text separates
    /// documents.
    pub text: String,
    /// Its id.
    pub id: u32,
}

/// A Hugging Face tokenizer loaded from a `tokenizer.json`, with what the text pipeline needs to
/// know about it: how many ids it uses, its end-of-text token and a hash of its file.
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    path: PathBuf,
    content_hash: u64,
    vocab_size: usize,
    end_of_text: Option<EndOfText>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("content_hash", &format_args!("{:016x}", self.content_hash))
            .field("vocab_size", &self.vocab_size)
            .field("end_of_text", &self.end_of_text)
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Loads a `tokenizer.json` (the file transformers' `save_pretrained` and the `tokenizers`
    /// library write). Its truncation and padding are switched off. A missing file, one that is
    /// not a regular file, or one that is not a tokenizer is an error naming the path.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
        if !meta.is_file() {
            return Err(bad_file(
                path,
                "is not a regular file; give the tokenizer.json file saved with the model",
            ));
        }
        // A tokenizer.json of a 256k vocabulary is tens of MiB; a file far past that is not one.
        const MAX_TOKENIZER_BYTES: u64 = 1 << 30;
        if meta.len() > MAX_TOKENIZER_BYTES {
            return Err(bad_file(
                path,
                format!(
                    "is {} bytes, more than the 1 GiB a tokenizer.json may hold; give the \
                     tokenizer.json file saved with the model",
                    meta.len()
                ),
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
        // Parsed as JSON first, every string decoded: the tokenizers crate panics on a syntax
        // error inside its `decoder` entry, or an escape that is no character there (an
        // `expect` in its deserializer), instead of returning it.
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(&bytes) {
            return Err(bad_file(
                path,
                format!(
                    "is not a Hugging Face tokenizer.json: it is not JSON ({e}); give the \
                     tokenizer.json that transformers' `save_pretrained` or the `tokenizers` \
                     library writes"
                ),
            ));
        }
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
            bad_file(
                path,
                format!(
                    "is not a Hugging Face tokenizer.json ({e}); give the tokenizer.json that \
                     transformers' `save_pretrained` or the `tokenizers` library writes, not \
                     tokenizer_config.json, vocab.json or a SentencePiece .model file"
                ),
            )
        })?;
        tokenizer.with_truncation(None).map_err(|e| {
            bad_file(
                path,
                format!("has truncation settings that cannot be removed ({e})"),
            )
        })?;
        tokenizer.with_padding(None);
        let vocab_size = tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        if vocab_size == 0 {
            return Err(bad_file(
                path,
                "defines no tokens; give the tokenizer.json the model was trained with",
            ));
        }
        let added = tokenizer.get_added_tokens_decoder();
        let end_of_text = END_OF_TEXT_NAMES.iter().find_map(|name| {
            added
                .iter()
                .filter(|(_, token)| token.special && token.content == *name)
                .map(|(&id, token)| EndOfText {
                    text: token.content.clone(),
                    id,
                })
                .min_by_key(|eot| eot.id)
        });
        Ok(TextTokenizer {
            tokenizer,
            path: path.to_path_buf(),
            content_hash: fnv(&bytes),
            vocab_size,
            end_of_text,
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number of ids it can produce: its largest id (text or added token) plus one.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Its end-of-text token, if it has one (see the module doc for how it is found).
    pub fn end_of_text(&self) -> Option<&EndOfText> {
        self.end_of_text.as_ref()
    }

    /// The 64-bit FNV-1a hash of the tokenizer.json's bytes, which names its caches.
    pub fn content_hash(&self) -> u64 {
        self.content_hash
    }

    /// Fails unless every id the tokenizer can produce is below `model_vocab`, the model's
    /// `vocab_size`. Call it before [`tokenize`], so a mismatch is found before a long corpus
    /// is read; the error names both sizes.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        if self.vocab_size <= model_vocab {
            return Ok(());
        }
        Err(bad_file(
            &self.path,
            format!(
                "has {} token ids (0..={}) but the model's vocabulary has {model_vocab}, so \
                 its tokens would index past the embedding; use the tokenizer the model was \
                 made for, or a model config with vocab_size >= {}",
                self.vocab_size,
                self.vocab_size - 1,
                self.vocab_size
            ),
        ))
    }

    /// The ids of `text` encoded as one document: no post-processor specials, no end-of-text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| bad_file(&self.path, format!("cannot encode text: {e}")))
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, false).map_err(|e| {
            bad_file(
                &self.path,
                format!("cannot decode ids: {e}; check that they were made by this tokenizer"),
            )
        })
    }
}

/// How [`tokenize`] reads a corpus and where it may put the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextOptions {
    /// The most corpus bytes held in memory at once (at least [`MIN_PIECE_BYTES`] are read).
    /// It bounds memory; it changes no id as long as every piece holds a place where a cut
    /// changes none (see the module doc), which the default's 4 MiB nearly always do.
    pub piece_bytes: usize,
    /// Where the cache goes when the corpus's directory cannot take it.
    pub fallback_dir: PathBuf,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions {
            piece_bytes: DEFAULT_PIECE_BYTES,
            fallback_dir: std::env::temp_dir().join("protrain-token-cache"),
        }
    }
}

/// What [`tokenize`] did when it read a corpus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeReport {
    /// Bytes of corpus read.
    pub bytes: u64,
    /// Token ids written, end-of-text ids included.
    pub tokens: u64,
    /// Documents that yielded tokens.
    pub documents: u64,
    /// Pieces the corpus was read in.
    pub pieces: u64,
    /// The largest piece, in bytes: at most [`TextOptions::piece_bytes`] (or
    /// [`MIN_PIECE_BYTES`]).
    pub largest_piece: usize,
}

/// A tokenized corpus: its token stream, mapped from the cache, and where that cache is.
#[derive(Debug)]
pub struct Tokenized {
    /// The tokens; its [`TokenStream::source`] is the cache file.
    pub stream: TokenStream,
    /// The cache file.
    pub cache: PathBuf,
    /// What tokenizing did, or `None` when an existing cache was reused.
    pub written: Option<TokenizeReport>,
    /// Why the cache was written to [`TextOptions::fallback_dir`] instead of beside the corpus,
    /// when it was in this call.
    pub fallback_reason: Option<String>,
}

impl TokenStream {
    /// Tokenizes a UTF-8 text corpus with a Hugging Face tokenizer, once: the ids are cached in
    /// a token file beside the corpus and mapped from there, and later calls reuse that file
    /// while neither the corpus nor the tokenizer.json changes. [`crate::text`] has the rules
    /// (documents and the end-of-text token between them, the cache's name, the fallback
    /// directory when the corpus's directory is not writable). `progress(bytes_done,
    /// bytes_total)` is called as the corpus is read, not when the cache is reused.
    ///
    /// Check the tokenizer against the model first ([`TextTokenizer::check_vocab`]);
    /// [`crate::text::tokenize`] does the same as this and also says where the cache is.
    pub fn from_text(
        corpus: impl AsRef<Path>,
        tokenizer: &TextTokenizer,
        progress: impl FnMut(u64, u64),
    ) -> Result<Self> {
        let options = TextOptions::default();
        Ok(tokenize(corpus.as_ref(), tokenizer, &options, progress)?.stream)
    }
}

/// Tokenizes `corpus` with `tokenizer` into a cached token file, or reuses the cache written
/// by an earlier call for the same corpus and tokenizer (the module doc has the rules).
/// `progress(bytes_done, bytes_total)` is called after each piece; it is not called when the
/// cache is reused.
///
/// Errors: a corpus that is missing, not a regular file, empty, not UTF-8 (the error names the
/// byte offset) or without any text the tokenizer turns into tokens; a cache that can be
/// written neither beside the corpus nor in the fallback directory. It does not check the
/// tokenizer's ids against a model: [`TextTokenizer::check_vocab`] does, and the stream may be
/// too short for a batch: [`crate::data::Batcher::new`] says so.
pub fn tokenize(
    corpus: &Path,
    tokenizer: &TextTokenizer,
    options: &TextOptions,
    mut progress: impl FnMut(u64, u64),
) -> Result<Tokenized> {
    let meta = std::fs::metadata(corpus).map_err(|e| io_error(corpus, e))?;
    if !meta.is_file() {
        return Err(bad_file(
            corpus,
            "is not a regular file (a device, FIFO or directory); give a UTF-8 text file",
        ));
    }
    if meta.len() == 0 {
        return Err(bad_file(
            corpus,
            "is empty; give a UTF-8 text file that holds the training text",
        ));
    }
    let Some(name) = corpus.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Err(bad_file(
            corpus,
            "has no file name; give a path to a text file",
        ));
    };
    let names = CacheNames::new(corpus, &name, &meta, tokenizer, options);
    for candidate in [&names.beside, &names.fallback] {
        if let Ok(stream) = TokenStream::open(candidate) {
            if !stream.is_empty() {
                return Ok(Tokenized {
                    stream,
                    cache: candidate.clone(),
                    written: None,
                    fallback_reason: None,
                });
            }
        }
    }

    let job = Job {
        corpus,
        total: meta.len(),
        tokenizer,
        piece_bytes: options.piece_bytes.max(MIN_PIECE_BYTES),
        wide: tokenizer.vocab_size > U16_IDS,
    };
    let (cache, report, fallback_reason) = match job.write(&names.beside, &mut progress) {
        Ok(report) => (names.beside.clone(), report, None),
        Err(WriteError::Failed(e)) => return Err(e),
        Err(WriteError::Unwritable(beside_error)) => {
            let written = std::fs::create_dir_all(&options.fallback_dir)
                .map_err(WriteError::Unwritable)
                .and_then(|()| job.write(&names.fallback, &mut progress));
            match written {
                Ok(report) => {
                    let why = format!(
                        "{} could not be written ({beside_error}), so the tokens are cached in \
                         {} instead",
                        names.beside.display(),
                        options.fallback_dir.display()
                    );
                    (names.fallback.clone(), report, Some(why))
                }
                Err(WriteError::Failed(e)) => return Err(e),
                Err(WriteError::Unwritable(fallback_error)) => {
                    return Err(RuntimeError::Io {
                        path: names.beside.clone(),
                        source: std::io::Error::new(
                            beside_error.kind(),
                            format!(
                                "{beside_error}, and the fallback cache {} could not be \
                                 written either ({fallback_error}); make the corpus's \
                                 directory or the temporary directory writable",
                                names.fallback.display()
                            ),
                        ),
                    });
                }
            }
        }
    };
    names.remove_stale(&cache);
    let stream = TokenStream::open(&cache)?;
    Ok(Tokenized {
        stream,
        cache,
        written: Some(report),
        fallback_reason,
    })
}

/// The cache's two possible paths for one corpus, tokenizer and corpus version.
struct CacheNames {
    beside: PathBuf,
    fallback: PathBuf,
    /// The file name prefix of every cache of this corpus beside it.
    beside_prefix: String,
    /// The same in the fallback directory.
    fallback_prefix: String,
    /// The corpus-version hash in the current names.
    stamp: String,
}

impl CacheNames {
    fn new(
        corpus: &Path,
        name: &str,
        meta: &std::fs::Metadata,
        tokenizer: &TextTokenizer,
        options: &TextOptions,
    ) -> Self {
        let mut stamp = FnvHasher::default();
        stamp.write_u64(RULE_VERSION);
        stamp.write_u64(meta.len());
        match meta.modified().map(|t| t.duration_since(UNIX_EPOCH)) {
            Ok(Ok(after)) => stamp.write_u128(after.as_nanos()),
            Ok(Err(before)) => {
                stamp.write_u8(1);
                stamp.write_u128(before.duration().as_nanos());
            }
            // No modification times on this platform: the size alone tells versions apart.
            Err(_) => {}
        }
        let stamp = format!("{:016x}", stamp.finish());
        let full = std::fs::canonicalize(corpus).unwrap_or_else(|_| corpus.to_path_buf());
        let key = fnv(full.as_os_str().as_encoded_bytes());
        let ext = if tokenizer.vocab_size > U16_IDS {
            "npy"
        } else {
            "bin"
        };
        let tail = format!("{:016x}-{stamp}.tokens.{ext}", tokenizer.content_hash());
        let beside_prefix = format!("{name}.");
        let fallback_prefix = format!("{name}.{key:016x}.");
        let dir = corpus
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        CacheNames {
            beside: dir.join(format!("{beside_prefix}{tail}")),
            fallback: options
                .fallback_dir
                .join(format!("{fallback_prefix}{tail}")),
            beside_prefix,
            fallback_prefix,
            stamp,
        }
    }

    /// Deletes, in the directory of `written`, the caches of older versions of this corpus:
    /// files named like a cache of it whose corpus hash is not the current one. Caches of the
    /// current corpus made with other tokenizers stay. Failures are ignored: a stale cache only
    /// takes space.
    fn remove_stale(&self, written: &Path) {
        let prefix = if written == self.beside {
            &self.beside_prefix
        } else {
            &self.fallback_prefix
        };
        let Some(dir) = written.parent() else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(rest) = file_name
                .to_str()
                .and_then(|n| n.strip_prefix(prefix.as_str()))
            else {
                continue;
            };
            if let Some(stamp) = cache_stamp(rest) {
                if stamp != self.stamp && entry.file_type().is_ok_and(|t| t.is_file()) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// The corpus hash of a cache name's tail `TTTTTTTTTTTTTTTT-SSSSSSSSSSSSSSSS.tokens.EXT`, or
/// `None` when `tail` is not such a name.
fn cache_stamp(tail: &str) -> Option<&str> {
    let hashes = tail
        .strip_suffix(".tokens.bin")
        .or_else(|| tail.strip_suffix(".tokens.npy"))?;
    let (tok, stamp) = hashes.split_once('-')?;
    let hex = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(tok) && hex(stamp)).then_some(stamp)
}

/// Why a cache was not written.
enum WriteError {
    /// The target could not be created, before any tokenizing: try elsewhere.
    Unwritable(std::io::Error),
    /// Tokenizing failed, or writing failed after it began: report it.
    Failed(RuntimeError),
}

/// One corpus to tokenize.
struct Job<'a> {
    corpus: &'a Path,
    total: u64,
    tokenizer: &'a TextTokenizer,
    piece_bytes: usize,
    /// Whether ids need 32 bits (a `.npy` of `u32`) rather than 16 (a `.bin`).
    wide: bool,
}

impl Job<'_> {
    /// Tokenizes the corpus into the cache file `target`.
    fn write(
        &self,
        target: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> std::result::Result<TokenizeReport, WriteError> {
        let inputs = [self.corpus, self.tokenizer.path()];
        if self.wide {
            return self.write_wide(target, &inputs, progress);
        }
        let mut outcome = None;
        let written = write_atomic_checked(target, &inputs, |w| {
            let mut bytes = Vec::new();
            let result = self.run(target, progress, &mut |ids| {
                bytes.clear();
                for &id in ids {
                    // Below vocab_size <= 2^16: the tokenizer makes no other ids.
                    let id = u16::try_from(id).map_err(|_| {
                        std::io::Error::other(format!("token id {id} does not fit in 16 bits"))
                    })?;
                    bytes.extend_from_slice(&id.to_le_bytes());
                }
                w.write_all(&bytes)
            });
            let failed = result.is_err();
            outcome = Some(result);
            if failed {
                Err(std::io::Error::other("tokenizing failed"))
            } else {
                Ok(())
            }
        });
        match (outcome, written) {
            (Some(Err(e)), _) => Err(WriteError::Failed(e)),
            (Some(Ok(report)), Ok(())) => Ok(report),
            (Some(Ok(_)), Err(e)) => Err(WriteError::Failed(io_error(target, e))),
            (None, written) => {
                Err(WriteError::Unwritable(written.err().unwrap_or_else(|| {
                    std::io::Error::other("the cache writer did not run")
                })))
            }
        }
    }

    /// [`Job::write`] for ids of 32 bits: a `.npy` file, whose header holds the count, so the
    /// ids go to an unnamed temporary file beside `target` first and are copied after the
    /// header once they are all known.
    fn write_wide(
        &self,
        target: &Path,
        inputs: &[&Path],
        progress: &mut dyn FnMut(u64, u64),
    ) -> std::result::Result<TokenizeReport, WriteError> {
        check_target(target, inputs).map_err(WriteError::Unwritable)?;
        let dir = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut ids_file = tempfile::tempfile_in(dir).map_err(WriteError::Unwritable)?;
        let failed = |e| WriteError::Failed(io_error(target, e));
        let report = {
            let mut w = BufWriter::with_capacity(1 << 20, &mut ids_file);
            let mut bytes = Vec::new();
            let report = self
                .run(target, progress, &mut |ids| {
                    bytes.clear();
                    bytes.extend(ids.iter().flat_map(|id| id.to_le_bytes()));
                    w.write_all(&bytes)
                })
                .map_err(WriteError::Failed)?;
            w.flush().map_err(failed)?;
            report
        };
        ids_file.rewind().map_err(failed)?;
        write_atomic_checked(target, inputs, |w| {
            w.write_all(&npy_u32_header(report.tokens))?;
            std::io::copy(&mut ids_file, w).map(|_| ())
        })
        .map_err(failed)?;
        Ok(report)
    }

    /// Reads the corpus piece by piece and hands each piece's ids to `sink`; `target` names
    /// the file in write errors.
    fn run(
        &self,
        target: &Path,
        progress: &mut dyn FnMut(u64, u64),
        sink: &mut dyn FnMut(&[u32]) -> std::io::Result<()>,
    ) -> Result<TokenizeReport> {
        let corpus = self.corpus;
        let mut file = File::open(corpus).map_err(|e| io_error(corpus, e))?;
        let eot = self.tokenizer.end_of_text();
        let mut buf = vec![0u8; self.piece_bytes];
        let (mut filled, mut offset, mut eof) = (0usize, 0u64, false);
        let mut docs = DocState::default();
        let mut line_start = true;
        let mut report = TokenizeReport {
            bytes: 0,
            tokens: 0,
            documents: 0,
            pieces: 0,
            largest_piece: 0,
        };
        loop {
            while filled < buf.len() && !eof {
                match file.read(&mut buf[filled..]) {
                    Ok(0) => eof = true,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_error(corpus, e)),
                }
            }
            if offset == 0 && buf[..filled].starts_with(BOM) {
                buf.copy_within(BOM.len()..filled, 0);
                filled -= BOM.len();
                offset = BOM.len() as u64;
            }
            if filled == 0 {
                break;
            }
            let cut = if eof {
                filled
            } else {
                choose_cut(&buf[..filled], eot, line_start)
            };
            let text = std::str::from_utf8(&buf[..cut]).map_err(|e| {
                let at = offset + e.valid_up_to() as u64;
                let problem = match e.error_len() {
                    Some(_) => format!(
                        "is not UTF-8 text: the byte at offset {at} (0x{:02x}) is not part of a \
                         UTF-8 character; convert the file to UTF-8 (for example `iconv -f \
                         LATIN1 -t UTF-8 IN > OUT`)",
                        buf[e.valid_up_to()]
                    ),
                    None => format!(
                        "ends inside a UTF-8 character that starts at byte offset {at}; the \
                         file is truncated or not UTF-8 text"
                    ),
                };
                bad_file(corpus, problem)
            })?;
            let ids = self.encode_piece(text, eof, line_start, offset, &mut docs)?;
            sink(&ids).map_err(|e| io_error(target, e))?;
            report.tokens += ids.len() as u64;
            report.pieces += 1;
            report.largest_piece = report.largest_piece.max(cut);
            line_start = buf[cut - 1] == b'\n';
            offset += cut as u64;
            buf.copy_within(cut..filled, 0);
            filled -= cut;
            progress(offset, self.total);
        }
        if !docs.seen_tokens {
            return Err(bad_file(
                corpus,
                format!(
                    "holds no text that the tokenizer {} turns into tokens (only end-of-text \
                     separator lines, or only characters it drops); give a corpus with text",
                    self.tokenizer.path().display()
                ),
            ));
        }
        report.bytes = offset;
        report.documents = docs.documents;
        Ok(report)
    }

    /// The ids of one piece (`text`, at byte `offset` of the corpus, starting a line when
    /// `line_start`), with end-of-text ids between documents; `docs` carries the document state
    /// from piece to piece.
    fn encode_piece(
        &self,
        text: &str,
        at_eof: bool,
        line_start: bool,
        offset: u64,
        docs: &mut DocState,
    ) -> Result<Vec<u32>> {
        let eot = self.tokenizer.end_of_text();
        let segment_bytes = SEGMENT_BYTES.min(self.piece_bytes);
        let mut items = Vec::new();
        let mut segment_start = 0;
        let mut pos = 0;
        let mut lines = text.split_inclusive('\n').peekable();
        while let Some(line) = lines.next() {
            let (start, end) = (pos, pos + line.len());
            pos = end;
            let whole = (start > 0 || line_start) && (at_eof || line.ends_with('\n'));
            if whole && is_separator(line.as_bytes(), eot) {
                let document = strip_line_break(&text[segment_start..start]);
                if !document.is_empty() {
                    items.push(Item::Text(document));
                }
                items.push(Item::DocumentEnd);
                segment_start = end;
            } else if end - segment_start >= segment_bytes {
                let cut_here = lines.peek().is_some_and(|next| {
                    starts_safely(next.as_bytes())
                        && !(next.ends_with('\n') && is_separator(next.as_bytes(), eot))
                });
                if cut_here {
                    items.push(Item::Text(&text[segment_start..end]));
                    segment_start = end;
                }
            }
        }
        if segment_start < text.len() {
            items.push(Item::Text(&text[segment_start..]));
        }

        let encoded: Vec<Result<Vec<u32>>> = items
            .par_iter()
            .map(|item| match item {
                Item::Text(segment) => self.tokenizer.encode(segment).map_err(|e| {
                    let from = offset + (segment.as_ptr() as usize - text.as_ptr() as usize) as u64;
                    bad_file(
                        self.corpus,
                        format!(
                            "could not be tokenized at bytes {from}..{}: {e}",
                            from + segment.len() as u64
                        ),
                    )
                }),
                Item::DocumentEnd => Ok(Vec::new()),
            })
            .collect();
        let mut out = Vec::new();
        for (item, ids) in items.iter().zip(encoded) {
            let ids = ids?;
            match item {
                Item::DocumentEnd => docs.in_document = false,
                Item::Text(_) if ids.is_empty() => {}
                Item::Text(_) => {
                    if !docs.in_document {
                        if let (true, Some(eot)) = (docs.seen_tokens, eot) {
                            out.push(eot.id);
                        }
                        docs.in_document = true;
                        docs.documents += 1;
                    }
                    out.extend_from_slice(&ids);
                    docs.seen_tokens = true;
                }
            }
        }
        Ok(out)
    }
}

/// A piece cut into what is encoded on its own.
enum Item<'a> {
    /// Text of one document, encoded as one input.
    Text(&'a str),
    /// A separator line: the document ends.
    DocumentEnd,
}

/// Where tokenizing stands between pieces.
#[derive(Default)]
struct DocState {
    /// Whether any document has yielded tokens.
    seen_tokens: bool,
    /// Whether the current document has yielded tokens (so it has had its end-of-text).
    in_document: bool,
    /// Documents that yielded tokens.
    documents: u64,
}

/// Where to end a full piece `buf` (the corpus goes on after it; `line_start` says whether
/// `buf` starts a line): the last place where encoding on either side separately gives the ids
/// of encoding across (see the module doc); else the start of the last complete line that is
/// not a separator (never right before a separator, so that the line break before it can still
/// be dropped); else, when a line longer than the piece fills it, before the last line break
/// (which then goes with the next piece, and with it any separator after it) or before the
/// last character, which may be incomplete.
fn choose_cut(buf: &[u8], eot: Option<&EndOfText>, line_start: bool) -> usize {
    let mut best = None;
    let mut fallback = None;
    let mut last_break = None;
    let mut start = 0;
    while let Some(len) = buf[start..].iter().position(|&b| b == b'\n') {
        let end = start + len + 1;
        if (start > 0 || line_start) && is_separator(&buf[start..end], eot) {
            best = Some(end);
        } else if start > 0 {
            if starts_safely(&buf[start..end]) {
                best = Some(start);
            }
            fallback = Some(start);
        }
        last_break = Some(end - 1);
        start = end;
    }
    if let Some(cut) = best.or(fallback) {
        return cut;
    }
    if let Some(at) = last_break.filter(|&at| at > 0) {
        return at;
    }
    // No line break but maybe at 0, after which the rest is longer than a separator: cut before
    // the last character's lead byte. Invalid UTF-8 (no lead byte in reach) is left to the UTF-8
    // check.
    let lead = buf
        .iter()
        .rposition(|&b| b & 0xC0 != 0x80)
        .filter(|&at| buf.len() - at <= 4);
    match lead {
        Some(at) if at > 0 => at,
        _ => buf.len(),
    }
}

/// Whether `line` (which may end in `\n`) is a separator: its text, less `\n` and then less one
/// `\r`, is the end-of-text token's.
fn is_separator(line: &[u8], eot: Option<&EndOfText>) -> bool {
    let Some(eot) = eot else { return false };
    let body = line.strip_suffix(b"\n").unwrap_or(line);
    let body = body.strip_suffix(b"\r").unwrap_or(body);
    body == eot.text.as_bytes()
}

/// Whether a line starts with a character that is not white space (Unicode's `White_Space`,
/// what pre-tokenizer patterns mean by `\s`), so that a word split always falls before it.
fn starts_safely(line: &[u8]) -> bool {
    let width = match line.first() {
        Some(&b) if b < 0x80 => 1,
        Some(&b) if b >= 0xF0 => 4,
        Some(&b) if b >= 0xE0 => 3,
        Some(_) => 2,
        None => return false,
    };
    line.get(..width)
        .and_then(|head| std::str::from_utf8(head).ok())
        .and_then(|head| head.chars().next())
        .is_some_and(|c| !c.is_whitespace())
}

/// `document` less one final line break (`\n` or `\r\n`), which belongs to the separator line
/// after it.
fn strip_line_break(document: &str) -> &str {
    match document.strip_suffix('\n') {
        Some(rest) => rest.strip_suffix('\r').unwrap_or(rest),
        None => document,
    }
}

/// The header of a `.npy` file holding `count` little-endian `u32`s, as `npyz` writes it
/// (version 1.0, padded to 64 bytes as numpy pads it).
fn npy_u32_header(count: u64) -> Vec<u8> {
    use npyz::WriterBuilder;
    let mut out = Vec::new();
    npyz::WriteOptions::new_header_only()
        .dtype(npyz::DType::Plain(
            "<u4".parse().expect("`<u4` is a numpy type string"),
        ))
        .shape(&[count])
        .writer(&mut out)
        .write_header_only()
        .expect("writing to memory does not fail");
    out
}

/// The 64-bit FNV-1a hash of `bytes`.
fn fnv(bytes: &[u8]) -> u64 {
    let mut hasher = FnvHasher::default();
    hasher.write(bytes);
    hasher.finish()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn eot() -> EndOfText {
        EndOfText {
            text: "<|endoftext|>".into(),
            id: 9,
        }
    }

    #[test]
    fn cuts_fall_after_separators_or_before_safe_lines() {
        let e = eot();
        // The last safe place: before "b", not before the indented line nor inside the last.
        assert_eq!(choose_cut(b"a\nb\n  c\nd", Some(&e), true), 2);
        // After a separator line, even when the next line starts with white space.
        assert_eq!(choose_cut(b"a\n<|endoftext|>\n  c\n", Some(&e), true), 16);
        // Not before a separator line: the line break before it belongs to it.
        assert_eq!(choose_cut(b"a\nb\n<|endoftext|>\r\nc", Some(&e), true), 19);
        assert_eq!(choose_cut(b"a\nb\n<|endoftext|>", Some(&e), true), 2);
        // Without an end-of-text token that line is text like any other.
        assert_eq!(choose_cut(b"a\nb\n<|endoftext|>\n  c", None, true), 4);
        // Only indented lines: the start of the last complete line.
        assert_eq!(choose_cut(b" a\n b\n c\n d", Some(&e), true), 6);
        // ... that is not a separator: the line break before one belongs to it.
        assert_eq!(choose_cut(b" a\n b\n<|endoftext|>", Some(&e), true), 3);
        assert_eq!(choose_cut(b" a\n b\n<|endoftext|>\n", Some(&e), true), 20);
        // A single complete line and a partial one: no place to cut between lines.
        assert_eq!(choose_cut(b" a\n b", Some(&e), true), 2);
        // A long line's end, then the start of what may be a separator: before the break.
        assert_eq!(choose_cut(b"long line\n<|endoftext", Some(&e), false), 9);
        // A piece that starts inside a line does not start with a separator.
        assert_eq!(choose_cut(b"<|endoftext|>\n  b", Some(&e), false), 13);
        assert_eq!(choose_cut(b"<|endoftext|>\n  b", Some(&e), true), 14);
        // A line break first, then a line longer than a separator: inside that line.
        assert_eq!(
            choose_cut(b"\nabcdefghijklmnopqrstuvwxyz", Some(&e), false),
            26
        );
        // A line with a non-breaking space first is not safe either.
        assert_eq!(choose_cut("a\nb\n\u{a0}c\nd".as_bytes(), None, true), 2);
        // No line break: before the last character, whole or not.
        assert_eq!(choose_cut("abcé".as_bytes(), None, true), 3);
        assert_eq!(choose_cut(&"abcé".as_bytes()[..4], None, true), 3);
        assert_eq!(choose_cut(b"abcd", None, true), 3);
        assert_eq!(choose_cut(b"\x80\x80\x80\x80\x80", None, true), 5);
    }

    #[test]
    fn separators_and_line_breaks() {
        let e = eot();
        assert!(is_separator(b"<|endoftext|>\n", Some(&e)));
        assert!(is_separator(b"<|endoftext|>\r\n", Some(&e)));
        assert!(is_separator(b"<|endoftext|>", Some(&e)));
        assert!(!is_separator(b" <|endoftext|>\n", Some(&e)));
        assert!(!is_separator(b"<|endoftext|>x\n", Some(&e)));
        assert!(!is_separator(b"<|endoftext|>\n", None));
        assert_eq!(strip_line_break("a\r\n"), "a");
        assert_eq!(strip_line_break("a\n\n"), "a\n");
        assert_eq!(strip_line_break("a\r"), "a\r");
    }

    #[test]
    fn cache_names_parse() {
        let good = "0123456789abcdef-fedcba9876543210.tokens.bin";
        assert_eq!(cache_stamp(good), Some("fedcba9876543210"));
        assert_eq!(
            cache_stamp("0123456789abcdef-fedcba9876543210.tokens.npy"),
            Some("fedcba9876543210")
        );
        assert_eq!(
            cache_stamp("0123456789abcdef-fedcba987654321.tokens.bin"),
            None
        );
        assert_eq!(cache_stamp("0123456789abcdef-fedcba9876543210.bin"), None);
        assert_eq!(
            cache_stamp("0123456789abcdefXfedcba9876543210.tokens.bin"),
            None
        );
    }

    #[test]
    fn npy_header_is_aligned_and_readable() {
        for count in [0u64, 7, 123_456_789_012] {
            let header = npy_u32_header(count);
            assert_eq!(header.len() % 64, 0);
            let parsed = npyz::NpyHeader::from_reader(&mut &header[..]).unwrap();
            assert_eq!(parsed.shape(), [count]);
            assert_eq!(parsed.dtype().descr(), "'<u4'");
        }
    }
}
