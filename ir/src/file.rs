//! The schedule file (`.ptsched`): the one module that encodes and decodes schedules.

use crate::error::{IrError, Result};
use crate::schedule::{Schedule, FORMAT_VERSION};
use crate::verify_schedule::{verify_schedule, ScheduleError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};
use std::collections::HashMap;
use std::fs;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The first eight bytes of every schedule file.
pub const MAGIC: &[u8; 8] = b"PTSCHED\0";

/// The file extension of schedules, without the dot.
pub const EXTENSION: &str = "ptsched";

/// Bytes before the payload: magic, format version, payload length.
const HEADER_BYTES: u64 = 8 + 4 + 8;

/// Bytes after the payload: its CRC-32.
const CHECKSUM_BYTES: u64 = 4;

/// Nesting the payload may have; schedules nest about ten deep.
const MAX_DEPTH: u32 = 128;

/// Why bytes are not a schedule this build can read; each says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum FileProblem {
    /// The magic is wrong.
    #[error("not a protrain schedule (.ptsched); compile one with `protrain compile`")]
    NotASchedule,
    /// A later format.
    #[error(
        "written by a newer protrain (format {found}, this build reads {supported}); upgrade \
         protrain"
    )]
    NewerVersion {
        /// The file's format version.
        found: u32,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// An earlier format.
    #[error(
        "written by an older protrain (format {found}, this build reads {supported}); compile \
         it again with `protrain compile`"
    )]
    OlderVersion {
        /// The file's format version.
        found: u32,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// Fewer bytes than the header needs or announces.
    #[error(
        "truncated: {have} bytes, but {part} needs {need}; the file was cut short: copy it \
         again or compile it again with `protrain compile`"
    )]
    Truncated {
        /// Bytes present.
        have: u64,
        /// Bytes needed.
        need: u64,
        /// What needs them.
        part: &'static str,
    },
    /// More bytes than the header announces.
    #[error(
        "{extra} unexpected bytes after the checksum; the file holds more than one schedule: \
         compile it again with `protrain compile`"
    )]
    TrailingBytes {
        /// Bytes past the checksum.
        extra: u64,
    },
    /// The payload's checksum does not match.
    #[error(
        "corrupted: the payload's CRC-32 is {actual:#010x} but the file says {stored:#010x}; \
         copy it again or compile it again with `protrain compile`"
    )]
    Corrupted {
        /// The checksum in the file.
        stored: u32,
        /// The checksum of the payload.
        actual: u32,
    },
    /// The payload is intact but is not a schedule of this format.
    #[error(
        "the payload does not decode as a format {FORMAT_VERSION} schedule ({why}); compile it \
         again with `protrain compile`"
    )]
    Payload {
        /// What the decoder says.
        why: String,
    },
    /// The schedule decodes but the verifier rejects it.
    #[error("{0}; compile it again with `protrain compile`")]
    Invalid(ScheduleError),
}

/// One node of the payload's tree, in pre-order: a sequence or map node is followed by its
/// elements (a map's as key, value, key, value..).
///
/// Bincode is not self-describing, and the IR tags several enums internally
/// (`#[serde(tag = "kind")]`), which serde reads back only from self-describing data. So the
/// payload carries the schedule's serde data model as this tree, which bincode encodes
/// compactly, with every string once in a table.
#[derive(Debug, Serialize, Deserialize)]
enum Node {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(u32),
    Seq(u32),
    Map(u32),
}

/// The payload: a string table and the tree that indexes it.
#[derive(Debug, Serialize, Deserialize)]
struct Payload<'a> {
    #[serde(borrow)]
    strings: Vec<&'a str>,
    nodes: Vec<Node>,
}

/// Encodes a schedule as the bytes of a `.ptsched` file.
///
/// Layout, integers little-endian: [`MAGIC`] (8 bytes), the format version ([`FORMAT_VERSION`],
/// `u32`), the payload's length (`u64`), the payload, and the payload's CRC-32 (`u32`). The
/// payload is bincode 2 (standard configuration) through serde. Floats must be finite (JSON's
/// data model, which the payload tree follows, has no NaN or infinity).
pub fn encode(schedule: &Schedule) -> Vec<u8> {
    let tree = serde_json::to_value(schedule).expect("a schedule always serialises");
    let mut payload = Payload {
        strings: Vec::new(),
        nodes: Vec::new(),
    };
    let mut interned = HashMap::new();
    flatten(&tree, &mut payload, &mut interned);
    let body = bincode::serde::encode_to_vec(&payload, bincode::config::standard())
        .expect("bincode encodes the payload tree");
    let mut out = Vec::with_capacity(body.len() + (HEADER_BYTES + CHECKSUM_BYTES) as usize);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out
}

/// Decodes a `.ptsched` file's bytes and checks the schedule with
/// [`verify_schedule`]; its error is returned as [`IrError::Schedule`].
pub fn decode(bytes: &[u8]) -> Result<Schedule> {
    let schedule = decode_unverified(bytes)?;
    verify_schedule(&schedule)?;
    Ok(schedule)
}

/// Decodes a `.ptsched` file's bytes without verifying the schedule (for tests, and for tools
/// that print a broken schedule to see what is wrong with it).
pub fn decode_unverified(bytes: &[u8]) -> Result<Schedule> {
    parse(bytes).map_err(|problem| IrError::ScheduleFile {
        origin: "schedule data".into(),
        problem,
    })
}

/// Writes a schedule to `path` atomically: to a temporary file in the same directory, synced,
/// then renamed over `path`, so that a reader sees the old file or the new one, never part of
/// one. It does not verify the schedule.
pub fn write(path: impl AsRef<Path>, schedule: &Schedule) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let path = path.as_ref();
    let fail = |source: std::io::Error| IrError::Write {
        path: path.display().to_string(),
        source,
    };
    let name = path.file_name().ok_or_else(|| {
        fail(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the path names no file",
        ))
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let bytes = encode(schedule);
    let attempt = || -> std::io::Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        // Make the rename itself durable; not every platform can open a directory.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    };
    attempt().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        fail(e)
    })
}

/// Reads a `.ptsched` file and verifies the schedule; every error names the file.
pub fn read(path: impl AsRef<Path>) -> Result<Schedule> {
    let path = path.as_ref();
    let schedule = read_unverified(path)?;
    verify_schedule(&schedule).map_err(|e| IrError::ScheduleFile {
        origin: path.display().to_string(),
        problem: FileProblem::Invalid(e),
    })?;
    Ok(schedule)
}

/// Reads a `.ptsched` file without verifying the schedule.
pub fn read_unverified(path: impl AsRef<Path>) -> Result<Schedule> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(|source| IrError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&bytes).map_err(|problem| IrError::ScheduleFile {
        origin: path.display().to_string(),
        problem,
    })
}

/// Checks the framing and decodes the payload.
fn parse(bytes: &[u8]) -> std::result::Result<Schedule, FileProblem> {
    let have = bytes.len() as u64;
    let truncated = |need: u64, part: &'static str| FileProblem::Truncated { have, need, part };
    let magic_len = bytes.len().min(MAGIC.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Err(FileProblem::NotASchedule);
    }
    if have < 12 {
        return Err(truncated(HEADER_BYTES, "the header"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version > FORMAT_VERSION {
        return Err(FileProblem::NewerVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version < FORMAT_VERSION {
        return Err(FileProblem::OlderVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if have < HEADER_BYTES {
        return Err(truncated(HEADER_BYTES, "the header"));
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let need = len.saturating_add(HEADER_BYTES + CHECKSUM_BYTES);
    if have < need {
        return Err(truncated(
            need,
            "the payload the header announces, with its checksum,",
        ));
    }
    if have > need {
        return Err(FileProblem::TrailingBytes { extra: have - need });
    }
    // `need == have` fits in usize from here on.
    let body = &bytes[HEADER_BYTES as usize..(HEADER_BYTES + len) as usize];
    let stored = u32::from_le_bytes(
        bytes[(HEADER_BYTES + len) as usize..]
            .try_into()
            .expect("4 bytes"),
    );
    let actual = crc32fast::hash(body);
    if stored != actual {
        return Err(FileProblem::Corrupted { stored, actual });
    }
    let payload_error = |why: String| FileProblem::Payload { why };
    let (payload, used): (Payload<'_>, usize) =
        bincode::serde::borrow_decode_from_slice(body, bincode::config::standard())
            .map_err(|e| payload_error(e.to_string()))?;
    if used != body.len() {
        return Err(payload_error(format!(
            "{} bytes left over after the tree",
            body.len() - used
        )));
    }
    let mut pos = 0;
    let tree = unflatten(&payload, &mut pos, 0).map_err(payload_error)?;
    if pos != payload.nodes.len() {
        return Err(payload_error(format!(
            "{} nodes left over after the tree",
            payload.nodes.len() - pos
        )));
    }
    serde_json::from_value(tree).map_err(|e| payload_error(e.to_string()))
}

/// Appends `value` to the payload in pre-order, interning its strings.
fn flatten<'v>(value: &'v Value, out: &mut Payload<'v>, interned: &mut HashMap<&'v str, u32>) {
    let intern = |s: &'v str, out: &mut Payload<'v>, interned: &mut HashMap<&'v str, u32>| {
        *interned.entry(s).or_insert_with(|| {
            out.strings.push(s);
            (out.strings.len() - 1) as u32
        })
    };
    match value {
        Value::Null => out.nodes.push(Node::Null),
        Value::Bool(b) => out.nodes.push(Node::Bool(*b)),
        Value::Number(n) => out.nodes.push(if let Some(u) = n.as_u64() {
            Node::U64(u)
        } else if let Some(i) = n.as_i64() {
            Node::I64(i)
        } else {
            Node::F64(n.as_f64().unwrap_or(f64::NAN))
        }),
        Value::String(s) => {
            let i = intern(s, out, interned);
            out.nodes.push(Node::Str(i));
        }
        Value::Array(items) => {
            out.nodes.push(Node::Seq(items.len() as u32));
            for item in items {
                flatten(item, out, interned);
            }
        }
        Value::Object(map) => {
            out.nodes.push(Node::Map(map.len() as u32));
            for (k, v) in map {
                let i = intern(k, out, interned);
                out.nodes.push(Node::Str(i));
                flatten(v, out, interned);
            }
        }
    }
}

/// Rebuilds the value whose pre-order starts at `nodes[*pos]`.
fn unflatten(p: &Payload<'_>, pos: &mut usize, depth: u32) -> std::result::Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!("nested deeper than {MAX_DEPTH}"));
    }
    let string = |i: u32| -> std::result::Result<&str, String> {
        p.strings
            .get(i as usize)
            .copied()
            .ok_or_else(|| format!("string {i} of {} does not exist", p.strings.len()))
    };
    let node = p
        .nodes
        .get(*pos)
        .ok_or_else(|| "the tree ends early".to_string())?;
    *pos += 1;
    Ok(match *node {
        Node::Null => Value::Null,
        Node::Bool(b) => Value::Bool(b),
        Node::U64(u) => Value::Number(u.into()),
        Node::I64(i) => Value::Number(i.into()),
        Node::F64(f) => Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| format!("non-finite float {f}"))?,
        Node::Str(i) => Value::String(string(i)?.to_string()),
        Node::Seq(n) => {
            let left = p.nodes.len() - *pos;
            let mut items = Vec::with_capacity((n as usize).min(left));
            for _ in 0..n {
                items.push(unflatten(p, pos, depth + 1)?);
            }
            Value::Array(items)
        }
        Node::Map(n) => {
            let mut map = Map::new();
            for _ in 0..n {
                let key = match p.nodes.get(*pos) {
                    Some(Node::Str(i)) => string(*i)?.to_string(),
                    _ => return Err("a map key is not a string".into()),
                };
                *pos += 1;
                let value = unflatten(p, pos, depth + 1)?;
                map.insert(key, value);
            }
            Value::Object(map)
        }
    })
}
