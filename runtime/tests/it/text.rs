//! Text corpora with a Hugging Face tokenizer: ids equal to Python `tokenizers`' for the
//! committed fixtures, documents that decode back to their text, the cache (reuse,
//! invalidation, fallback), bounded memory, and every error a user can hit.
//!
//! The fixtures under tests/fixtures/text/ were made by make_fixtures.py beside them, which
//! also wrote the expected ids with Python's `tokenizers`.

use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use protrain_runtime::data::{Batcher, TokenStream};
use protrain_runtime::text::{tokenize, TextOptions, TextTokenizer, Tokenized};
use protrain_runtime::RuntimeError;
use serde_json::Value;

/// Held for writing by the test that measures the process's memory, for reading by the others,
/// so their allocations do not count against it.
static MEMORY: RwLock<()> = RwLock::new(());

/// A share of [`MEMORY`]; a test that failed holding one does not fail the others.
fn shared() -> RwLockReadGuard<'static, ()> {
    MEMORY.read().unwrap_or_else(PoisonError::into_inner)
}

/// [`MEMORY`] alone.
fn alone() -> RwLockWriteGuard<'static, ()> {
    MEMORY.write().unwrap_or_else(PoisonError::into_inner)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/text")
        .join(name)
}

/// What make_fixtures.py recorded for one tokenizer.
struct Expected {
    eot: Option<u32>,
    vocab: usize,
    documents: Vec<String>,
    ids: Vec<u32>,
}

fn expected(tokenizer: &str) -> Expected {
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let e = &all[tokenizer];
    Expected {
        eot: e["eot"].as_u64().map(|id| id as u32),
        vocab: e["vocab"].as_u64().unwrap() as usize,
        documents: e["documents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap().to_owned())
            .collect(),
        ids: e["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap() as u32)
            .collect(),
    }
}

/// A temporary directory holding `corpus.txt` with `text`, and options whose fallback
/// directory is inside it.
struct Setup {
    dir: tempfile::TempDir,
    corpus: PathBuf,
    options: TextOptions,
}

fn setup(text: &[u8]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, text).unwrap();
    let options = TextOptions {
        fallback_dir: dir.path().join("fallback"),
        ..TextOptions::default()
    };
    Setup {
        dir,
        corpus,
        options,
    }
}

fn corpus_text() -> Vec<u8> {
    std::fs::read(fixture("corpus.txt")).unwrap()
}

fn load(name: &str) -> TextTokenizer {
    TextTokenizer::load(fixture(name)).unwrap()
}

fn run(s: &Setup, tokenizer: &TextTokenizer) -> Result<Tokenized, RuntimeError> {
    tokenize(&s.corpus, tokenizer, &s.options, |_, _| {})
}

/// The files in `dir` whose names end in `suffix`, sorted.
fn files_ending(dir: &Path, suffix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(suffix))
        .collect();
    names.sort();
    names
}

#[test]
fn ids_equal_python_tokenizers_for_every_fixture_and_piece_size() {
    let _shared = shared();
    for name in ["tokenizer.json", "gpt2-format.json", "no-eot.json"] {
        let want = expected(name);
        let tokenizer = load(name);
        assert_eq!(tokenizer.vocab_size(), want.vocab, "{name}");
        assert_eq!(tokenizer.end_of_text().map(|e| e.id), want.eot, "{name}");
        // Pieces from ones that hold a few lines (a cut every few lines) to the default (one
        // piece). Each holds a line that starts a word, so every cut is one that cannot change
        // the ids.
        for piece_bytes in [256, 333, 1024, 4 << 20] {
            let mut s = setup(&corpus_text());
            s.options.piece_bytes = piece_bytes;
            let t = run(&s, &tokenizer).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                *t.stream.tokens(),
                want.ids,
                "{name} with pieces of {piece_bytes} bytes"
            );
            let report = t.written.unwrap();
            assert_eq!(report.tokens, want.ids.len() as u64);
            assert_eq!(report.documents, want.documents.len() as u64);
            assert_eq!(report.bytes, corpus_text().len() as u64);
            assert!(report.largest_piece <= piece_bytes, "{report:?}");
        }
    }
}

#[test]
fn each_document_decodes_to_its_text() {
    let _shared = shared();
    for name in ["tokenizer.json", "gpt2-format.json", "no-eot.json"] {
        let want = expected(name);
        let tokenizer = load(name);
        let s = setup(&corpus_text());
        let tokens = run(&s, &tokenizer).unwrap().stream.tokens().into_owned();
        let documents: Vec<&[u32]> = match want.eot {
            Some(eot) => tokens.split(|&id| id == eot).collect(),
            None => vec![&tokens[..]],
        };
        assert_eq!(documents.len(), want.documents.len(), "{name}");
        for (ids, text) in documents.iter().zip(&want.documents) {
            assert_eq!(&tokenizer.decode(ids).unwrap(), text, "{name}");
            assert_eq!(&tokenizer.encode(text).unwrap(), ids, "{name}");
        }
    }
}

#[test]
fn pieces_smaller_than_a_line_still_cover_every_byte() {
    let _shared = shared();
    // Pieces of 64 to 320 bytes cut inside lines and before indented ones, where the ids may
    // differ from whole-document encoding; documents and separators still come out whole, and
    // the byte-level tokenizers lose no text.
    for name in ["tokenizer.json", "gpt2-format.json"] {
        let want = expected(name);
        let eot = want.eot.unwrap();
        let tokenizer = load(name);
        for piece_bytes in (64..=320).step_by(11) {
            let mut s = setup(&corpus_text());
            s.options.piece_bytes = piece_bytes;
            let t = run(&s, &tokenizer).unwrap();
            assert!(t.written.unwrap().largest_piece <= piece_bytes);
            let tokens = t.stream.tokens();
            let documents: Vec<String> = tokens
                .split(|&id| id == eot)
                .map(|ids| tokenizer.decode(ids).unwrap())
                .collect();
            assert_eq!(documents, want.documents, "{name}, pieces of {piece_bytes}");
        }
    }
}

#[test]
fn gpt2_layout_loads_and_round_trips_text_it_never_saw() {
    let _shared = shared();
    // The layout of GPT-2's own tokenizer.json: no model type, merges as "a b" strings, the
    // GPT-2 pattern with a look-ahead (which needs fancy-regex), every byte in the alphabet.
    let tokenizer = load("gpt2-format.json");
    let eot = tokenizer.end_of_text().unwrap();
    assert_eq!((eot.text.as_str(), eot.id), ("<|endoftext|>", 299));
    let text = "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 🎉 ∑ 𝔘\t\r\n  x";
    let ids = tokenizer.encode(text).unwrap();
    assert!(ids.iter().all(|&id| id < 299), "{ids:?}");
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    // The pattern's `\s+(?!\S)`: two spaces before a word are one token and a word-leading
    // space, as GPT-2 splits them.
    let spaced = tokenizer.encode("a  b").unwrap();
    let pieces: Vec<String> = spaced
        .iter()
        .map(|&id| tokenizer.decode(&[id]).unwrap())
        .collect();
    assert_eq!(pieces, ["a", " ", " b"]);
}

#[test]
fn the_cache_is_reused_until_the_corpus_or_tokenizer_changes() {
    let _shared = shared();
    let s = setup(&corpus_text());
    let tokenizer = load("tokenizer.json");
    let mut calls = Vec::new();
    let first = tokenize(&s.corpus, &tokenizer, &s.options, |done, total| {
        calls.push((done, total))
    })
    .unwrap();
    let total = corpus_text().len() as u64;
    assert_eq!(calls.last(), Some(&(total, total)));
    assert!(calls.windows(2).all(|w| w[0].0 < w[1].0), "{calls:?}");
    assert_eq!(first.cache.parent(), Some(s.dir.path()));
    assert_eq!(first.stream.source(), Some(first.cache.as_path()));
    assert!(first.written.is_some() && first.fallback_reason.is_none());
    let name = first
        .cache
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        name.starts_with("corpus.txt.") && name.ends_with(".tokens.bin"),
        "{name}"
    );

    // Unchanged: reused, without reading the corpus.
    let mut called = false;
    let again = tokenize(&s.corpus, &tokenizer, &s.options, |_, _| called = true).unwrap();
    assert!(again.written.is_none() && !called);
    assert_eq!(again.cache, first.cache);
    assert_eq!(again.stream.tokens(), first.stream.tokens());
    // The same tokenizer.json at another path is the same tokenizer.
    let copy = s.dir.path().join("copy.json");
    std::fs::copy(fixture("tokenizer.json"), &copy).unwrap();
    assert!(run(&s, &TextTokenizer::load(&copy).unwrap())
        .unwrap()
        .written
        .is_none());

    // Another tokenizer: its own cache, and the first one stays.
    let other = run(&s, &load("gpt2-format.json")).unwrap();
    assert!(other.written.is_some());
    assert_ne!(other.cache, first.cache);
    assert!(first.cache.exists());
    // A changed tokenizer.json (one byte more) is another tokenizer too.
    let mut bytes = std::fs::read(fixture("tokenizer.json")).unwrap();
    bytes.push(b'\n');
    std::fs::write(&copy, bytes).unwrap();
    let changed = run(&s, &TextTokenizer::load(&copy).unwrap()).unwrap();
    assert!(changed.written.is_some());
    assert_eq!(changed.stream.tokens(), first.stream.tokens());
    assert_eq!(files_ending(s.dir.path(), ".tokens.bin").len(), 3);

    // A changed corpus: tokenized again, and the caches of the old version are gone.
    let mut text = corpus_text();
    text.extend_from_slice(b"\n<|endoftext|>\nA new entry.");
    std::fs::write(&s.corpus, &text).unwrap();
    let fresh = run(&s, &tokenizer).unwrap();
    assert!(fresh.written.is_some());
    assert_ne!(fresh.cache, first.cache);
    let mut want = expected("tokenizer.json").ids;
    want.push(255);
    want.extend(tokenizer.encode("A new entry.").unwrap());
    assert_eq!(*fresh.stream.tokens(), want);
    assert_eq!(
        files_ending(s.dir.path(), ".tokens.bin"),
        [fresh.cache.file_name().unwrap().to_str().unwrap()]
    );

    // Same size, another modification time: tokenized again.
    let file = std::fs::File::options()
        .write(true)
        .open(&s.corpus)
        .unwrap();
    file.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1 << 30))
        .unwrap();
    drop(file);
    let touched = run(&s, &tokenizer).unwrap();
    assert!(touched.written.is_some());
    assert_ne!(touched.cache, fresh.cache);
    assert!(!fresh.cache.exists());
}

#[test]
fn a_damaged_cache_is_written_again() {
    let _shared = shared();
    let s = setup(&corpus_text());
    let tokenizer = load("tokenizer.json");
    let first = run(&s, &tokenizer).unwrap();
    // An odd byte count is not a u16 token file: it is replaced, not an error.
    std::fs::write(&first.cache, [1, 2, 3]).unwrap();
    let second = run(&s, &tokenizer).unwrap();
    assert!(second.written.is_some());
    assert_eq!(*second.stream.tokens(), expected("tokenizer.json").ids);
}

#[test]
fn an_unwritable_corpus_directory_falls_back_to_the_cache_directory() {
    let _shared = shared();
    let s = setup(&corpus_text());
    let tokenizer = load("tokenizer.json");
    // Find the cache's name, then take it with a directory so nothing can be written there
    // (chmod would not stop root, who runs CI).
    let beside = run(&s, &tokenizer).unwrap().cache;
    std::fs::remove_file(&beside).unwrap();
    std::fs::create_dir(&beside).unwrap();

    let t = run(&s, &tokenizer).unwrap();
    assert_eq!(t.cache.parent(), Some(s.options.fallback_dir.as_path()));
    let why = t.fallback_reason.unwrap();
    assert!(
        why.contains(&beside.display().to_string()) && why.contains("directory"),
        "{why}"
    );
    assert_eq!(*t.stream.tokens(), expected("tokenizer.json").ids);
    // Found there next time.
    let again = run(&s, &tokenizer).unwrap();
    assert!(again.written.is_none());
    assert_eq!(again.cache, t.cache);

    // When the fallback cannot be written either, the error names both places.
    std::fs::remove_dir_all(&s.options.fallback_dir).unwrap();
    std::fs::write(&s.options.fallback_dir, b"a file, not a directory").unwrap();
    let e = run(&s, &tokenizer).unwrap_err().to_string();
    assert!(
        e.contains(&beside.display().to_string())
            && e.contains(&s.options.fallback_dir.display().to_string())
            && e.contains("writable"),
        "{e}"
    );
}

#[test]
fn tokenizer_file_errors_name_the_file_and_the_fix() {
    let _shared = shared();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let e = TextTokenizer::load(&missing).unwrap_err().to_string();
    assert!(
        e.contains("missing.json") && e.contains("check the path"),
        "{e}"
    );

    let e = TextTokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");

    for (name, bytes) in [
        ("garbage.json", &b"not json"[..]),
        (
            "tokenizer_config.json",
            &br#"{"model_max_length": 1024, "eos_token": "<|endoftext|>"}"#[..],
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let e = TextTokenizer::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains("is not a Hugging Face tokenizer.json"),
            "{e}"
        );
    }
}

#[test]
fn corpus_errors_name_the_file_the_place_and_the_fix() {
    let _shared = shared();
    let tokenizer = load("tokenizer.json");

    let s = setup(b"");
    let e = run(&s, &tokenizer).unwrap_err().to_string();
    assert!(e.contains("corpus.txt is empty"), "{e}");

    let e = tokenize(
        &s.dir.path().join("nope.txt"),
        &tokenizer,
        &s.options,
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("nope.txt") && e.contains("check the path"),
        "{e}"
    );

    let e = tokenize(s.dir.path(), &tokenizer, &s.options, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a regular file"), "{e}");

    // Latin-1 at a known offset, in the first piece and in a later one; nothing is cached.
    for piece_bytes in [4 << 20, 64] {
        let mut text = corpus_text();
        text[2000] = 0xE9;
        let mut s = setup(&text);
        s.options.piece_bytes = piece_bytes;
        let e = run(&s, &tokenizer).unwrap_err().to_string();
        assert!(
            e.contains("not UTF-8") && e.contains("offset 2000") && e.contains("iconv"),
            "{e}"
        );
        assert!(files_ending(s.dir.path(), ".bin").is_empty());
        assert!(files_ending(s.dir.path(), ".tmp").is_empty());
    }
    // A character cut off at the end.
    let mut text = b"the sea".to_vec();
    text.extend_from_slice(&"é".as_bytes()[..1]);
    let e = run(&setup(&text), &tokenizer).unwrap_err().to_string();
    assert!(
        e.contains("byte offset 7") && e.contains("truncated"),
        "{e}"
    );

    // Only separators: no text.
    let s = setup(b"<|endoftext|>\n<|endoftext|>\n");
    let e = run(&s, &tokenizer).unwrap_err().to_string();
    assert!(e.contains("holds no text"), "{e}");
    assert!(files_ending(s.dir.path(), ".bin").is_empty());
}

#[test]
fn a_corpus_too_short_for_one_batch_says_how_short() {
    let _shared = shared();
    let tokenizer = load("tokenizer.json");
    let s = setup(b"The sea.");
    let stream = run(&s, &tokenizer).unwrap().stream;
    let len = stream.len();
    assert!(len > 0 && len < 65, "{len}");
    let e = Batcher::new(stream, 4, 16).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{len} tokens")) && e.contains("needs 65"),
        "{e}"
    );
}

#[test]
fn a_tokenizer_larger_than_the_model_names_both_sizes() {
    let _shared = shared();
    // The tiny presets have 256 ids.
    load("tokenizer.json").check_vocab(256).unwrap();
    let e = load("gpt2-format.json")
        .check_vocab(256)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gpt2-format.json")
            && e.contains("300 token ids")
            && e.contains("vocabulary has 256")
            && e.contains("vocab_size >= 300"),
        "{e}"
    );
    load("gpt2-format.json").check_vocab(300).unwrap();
    // GPT-2's padded vocabulary takes GPT-2-sized tokenizers.
    load("gpt2-format.json").check_vocab(50304).unwrap();
}

#[test]
fn from_text_is_tokenize_with_the_defaults() {
    let _shared = shared();
    let s = setup(&corpus_text());
    let stream = TokenStream::from_text(&s.corpus, &load("tokenizer.json"), |_, _| {}).unwrap();
    assert_eq!(*stream.tokens(), expected("tokenizer.json").ids);
    assert_eq!(stream.source().and_then(Path::parent), Some(s.dir.path()));
}

#[test]
fn a_byte_order_mark_is_skipped() {
    let _shared = shared();
    let mut text = b"\xEF\xBB\xBF".to_vec();
    text.extend(corpus_text());
    let s = setup(&text);
    let t = run(&s, &load("tokenizer.json")).unwrap();
    assert_eq!(*t.stream.tokens(), expected("tokenizer.json").ids);
}

#[test]
fn tokenizers_with_more_than_65536_ids_write_u32_npy() {
    let _shared = shared();
    // A word-level tokenizer whose ids go past 16 bits, its end-of-text last (`tokenizers`
    // numbers added tokens after the model's vocabulary, so the vocabulary is filled in).
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert("sea".into(), 1.into());
    for id in 2..70000 {
        vocab.insert(format!("w{id}"), id.into());
    }
    vocab.insert("lamp".into(), 70000.into());
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 70001, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
    .to_string();
    let s = setup(b"sea lamp sea\n<|endoftext|>\nlamp gull\n");
    let path = s.dir.path().join("wide.json");
    std::fs::write(&path, json).unwrap();
    let tokenizer = TextTokenizer::load(&path).unwrap();
    assert_eq!(tokenizer.vocab_size(), 70002);
    let t = run(&s, &tokenizer).unwrap();
    assert_eq!(t.cache.extension().unwrap(), "npy");
    assert_eq!(*t.stream.tokens(), [1, 70000, 1, 70001, 70000, 0]);
    let reopened = TokenStream::open(&t.cache).unwrap();
    assert_eq!(*reopened.tokens(), [1, 70000, 1, 70001, 70000, 0]);
    assert!(run(&s, &tokenizer).unwrap().written.is_none());
}

/// Anonymous resident memory of this process, from /proc/self/status (Linux).
fn rss_anon_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn a_corpus_larger_than_a_piece_is_read_in_bounded_memory() {
    let _alone = alone();
    // 2,400 copies of the corpus (8 MiB), one document apart, read in 256 KiB pieces.
    let copies = 2400;
    let one = corpus_text();
    let mut text = Vec::with_capacity(copies * (one.len() + 15));
    for i in 0..copies {
        if i > 0 {
            text.extend_from_slice(b"\n<|endoftext|>\n");
        }
        text.extend_from_slice(&one);
    }
    let mut s = setup(&text);
    let corpus_bytes = text.len();
    drop(text);
    s.options.piece_bytes = 256 << 10;
    let tokenizer = load("tokenizer.json");
    // Warm up the thread pool and the tokenizer's caches, which hold a bounded amount.
    run(&setup(&one), &tokenizer).unwrap();

    let before = rss_anon_kib();
    let t = run(&s, &tokenizer).unwrap();
    let after = rss_anon_kib();

    let report = t.written.unwrap();
    assert!(
        report.pieces >= (corpus_bytes / (256 << 10)) as u64,
        "{report:?}"
    );
    assert!(report.largest_piece <= 256 << 10, "{report:?}");
    let want = expected("tokenizer.json");
    assert_eq!(report.documents, (copies * want.documents.len()) as u64);
    // Every copy's ids, end-of-text between them: the cuts changed nothing.
    let tokens = t.stream.tokens();
    let per_copy = want.ids.len() + 1;
    assert_eq!(tokens.len(), copies * per_copy - 1);
    for (i, copy) in tokens.chunks(per_copy).enumerate() {
        assert_eq!(&copy[..want.ids.len()], want.ids, "copy {i}");
        if copy.len() > want.ids.len() {
            assert_eq!(copy[want.ids.len()], 255, "after copy {i}");
        }
    }
    drop(tokens);
    // Measured: 3.7 MiB more in 256 KiB pieces, 5.9 MiB in 4 MiB pieces, 22 MiB read in one
    // piece (the text and all its ids at once), which this bound catches.
    if let (Some(before), Some(after)) = (before, after) {
        let grown = after.saturating_sub(before);
        assert!(
            grown < 12 << 10,
            "anonymous memory grew by {grown} KiB tokenizing {corpus_bytes} bytes"
        );
    }
}
