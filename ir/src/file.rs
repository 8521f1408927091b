//! The schedule file (`.ptsched`): the one module that encodes and decodes schedules.

use crate::error::{IrError, Result};
use crate::output::write_atomic;
use crate::schedule::{Schedule, FORMAT_VERSION};
use crate::verify_schedule::{verify, ScheduleError, VerifiedSchedule};
use bincode::error::DecodeError;
use std::fs;
use std::path::Path;

/// The first eight bytes of every schedule file.
pub const MAGIC: &[u8; 8] = b"PTSCHED\0";

/// The file extension of schedules, without the dot.
pub const EXTENSION: &str = "ptsched";

/// Bytes before the payload: magic, format version, payload length.
const HEADER_BYTES: u64 = 8 + 4 + 8;

/// Bytes after the payload: its CRC-32.
const CHECKSUM_BYTES: u64 = 4;

/// The largest schedule file read. A schedule of LLaMA 2 70B is a few MiB; this refuses a
/// device, a sparse file or the wrong file given by mistake before it is read whole.
pub const MAX_SCHEDULE_BYTES: u64 = 1 << 30;

/// The most streams a schedule may have: the compiler makes one per kind of work (compute,
/// two copy directions, CPU Adam, collectives, disk, casts). The verifier keeps a clock of
/// every stream for every stream, so this bounds what it allocates from the count.
pub const MAX_STREAMS: usize = 64;

/// The most ranks (GPUs x nodes) a schedule may run on: each rank is a thread or a process
/// of the run, so a count past any real cluster is damage, not a plan.
pub const MAX_RANKS: u64 = 1 << 16;

/// The most micro-batches a step may take (`--grad-accum`): a step reads that many batches,
/// so a damaged count would size the step's token buffer.
pub const MAX_MICRO_BATCHES: u64 = 1 << 20;

/// Reads the whole file `path` of at most `limit` bytes, for a command's input of the kind
/// `what` names ("a schedule written by `protrain compile`"). Refuses, before opening it,
/// anything but a regular file (opening a FIFO blocks until something writes to it; a device
/// such as `/dev/zero` never ends) and a file over `limit`; reads at most `limit` bytes even
/// when the file grows meanwhile. The error names the file and says what to give instead.
pub fn read_input(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let refuse = |problem: String| IrError::InputFile {
        path: path.display().to_string(),
        problem,
    };
    let io = |source: std::io::Error| IrError::Io {
        path: path.display().to_string(),
        source,
    };
    let meta = fs::metadata(path).map_err(io)?;
    if meta.is_dir() {
        return Err(refuse(format!("is a directory; give {what}")));
    }
    if !meta.is_file() {
        return Err(refuse(format!(
            "is not a regular file (a device, FIFO or socket); give {what}"
        )));
    }
    let too_big = |bytes: u64| {
        refuse(format!(
            "is {bytes} bytes, more than the {} a file of this kind may hold; give {what}",
            crate::format_bytes(limit)
        ))
    };
    if meta.len() > limit {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

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
    /// A count in the payload is more than the schedule can hold or describe.
    #[error(
        "{what} is {found}, but {why}; the file is damaged: copy it again or compile it again \
         with `protrain compile`"
    )]
    Count {
        /// What is counted.
        what: &'static str,
        /// The count in the file.
        found: u64,
        /// The bound it breaks.
        why: String,
    },
    /// The schedule decodes but the verifier rejects it.
    #[error("{0}; compile it again with `protrain compile`")]
    Invalid(ScheduleError),
}

/// Encodes a schedule as the bytes of a `.ptsched` file.
///
/// Layout, integers little-endian: [`MAGIC`] (8 bytes), the format version ([`FORMAT_VERSION`],
/// `u32`), the payload's length (`u64`), the payload, and the payload's CRC-32 (`u32`). The
/// payload is the schedule in bincode 2 (standard configuration) through serde. All bincode
/// use is in this module, so the codec can be swapped.
pub fn encode(schedule: &Schedule) -> Vec<u8> {
    let body = bincode::serde::encode_to_vec(schedule, bincode::config::standard())
        .expect("bincode encodes every schedule");
    let mut out = Vec::with_capacity(body.len() + (HEADER_BYTES + CHECKSUM_BYTES) as usize);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out
}

/// Decodes a `.ptsched` file's bytes and checks the schedule with [`verify`]; its error is
/// returned as [`IrError::Schedule`].
pub fn decode(bytes: &[u8]) -> Result<VerifiedSchedule> {
    Ok(verify(decode_unverified(bytes)?)?)
}

/// Decodes a `.ptsched` file's bytes without verifying the schedule (for tests, and for tools
/// that print a broken schedule to see what is wrong with it).
pub fn decode_unverified(bytes: &[u8]) -> Result<Schedule> {
    parse(bytes).map_err(|problem| IrError::ScheduleFile {
        origin: "schedule data".into(),
        problem,
    })
}

/// Writes a schedule to `path` atomically ([`write_atomic`]): a reader sees the old file or
/// the new one, never part of one. It does not verify the schedule.
pub fn write(path: impl AsRef<Path>, schedule: &Schedule) -> Result<()> {
    let path = path.as_ref();
    let bytes = encode(schedule);
    write_atomic(path, |w| w.write_all(&bytes)).map_err(|source| IrError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// Reads a `.ptsched` file and verifies the schedule; every error names the file.
pub fn read(path: impl AsRef<Path>) -> Result<VerifiedSchedule> {
    let path = path.as_ref();
    verify(read_unverified(path)?).map_err(|e| IrError::ScheduleFile {
        origin: path.display().to_string(),
        problem: FileProblem::Invalid(e),
    })
}

/// Reads a `.ptsched` file without verifying the schedule.
pub fn read_unverified(path: impl AsRef<Path>) -> Result<Schedule> {
    let path = path.as_ref();
    let what = "a schedule (.ptsched) written by `protrain compile`";
    let bytes = read_input(path, MAX_SCHEDULE_BYTES, what)?;
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
    let (schedule, used) = decode_payload(body).map_err(|e| payload_error(e.to_string()))?;
    if used != body.len() {
        return Err(payload_error(format!(
            "{} bytes left over after the schedule",
            body.len() - used
        )));
    }
    check_counts(&schedule)?;
    Ok(schedule)
}

/// Bounds every count of a decoded schedule that something is allocated from (the verifier's
/// and the runtime's tables) by what the schedule describes, before anything is: vectors in
/// the payload are bounded by its length already (bincode reads each element), but a number
/// such as `events` is not.
fn check_counts(s: &Schedule) -> std::result::Result<(), FileProblem> {
    let count = |what, found: u64, why: String| FileProblem::Count { what, found, why };
    // Each event is recorded by exactly one instruction (the verifier's invariant), so there
    // are no more events than instructions.
    let instrs: u64 = s.streams.iter().map(|st| st.instrs.len() as u64).sum();
    if u64::from(s.events) > instrs {
        return Err(count(
            "the event count",
            s.events.into(),
            format!("each event is recorded by one instruction and there are {instrs}"),
        ));
    }
    if s.streams.len() > MAX_STREAMS {
        return Err(count(
            "the stream count",
            s.streams.len() as u64,
            format!("a schedule has at most {MAX_STREAMS} streams"),
        ));
    }
    for st in &s.streams {
        if let crate::StreamKind::Collective { gpus, nodes } = st.kind {
            let ranks = u64::from(gpus) * u64::from(nodes);
            if ranks > MAX_RANKS {
                return Err(count(
                    "the rank count (GPUs x nodes)",
                    ranks,
                    format!("a schedule runs on at most {MAX_RANKS} ranks"),
                ));
            }
        }
        for i in &st.instrs {
            if let crate::Instr::EndMicroBatch { micro_batches } = *i {
                if u64::from(micro_batches) > MAX_MICRO_BATCHES {
                    return Err(count(
                        "the micro-batch count",
                        micro_batches.into(),
                        format!("a step takes at most {MAX_MICRO_BATCHES} micro-batches"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Decodes a payload under a byte limit that a valid payload never reaches, so that a length
/// in damaged bytes cannot size an allocation: bincode allocates a string's bytes before it
/// reads them, from the length it was handed (a corrupted schedule asked for 7 EiB).
///
/// bincode counts, against the limit, the in-memory size of every number it decodes (at most
/// 16 bytes, a `u128`, for at least one byte of input) and every byte of a string, so a valid
/// payload claims at most 16 bytes per byte. The limit is a type parameter; it is taken from
/// a ladder of powers of 16, so it is at most 256 times the payload, for 8 instantiations of
/// the decoder rather than one per size.
fn decode_payload(body: &[u8]) -> std::result::Result<(Schedule, usize), DecodeError> {
    let claims = (body.len() as u64).saturating_mul(16);
    macro_rules! ladder {
        ($($bits:literal),*) => {
            $(
                if claims <= 1u64 << $bits {
                    let config = bincode::config::standard().with_limit::<{ 1usize << $bits }>();
                    return bincode::serde::decode_from_slice(body, config);
                }
            )*
        };
    }
    ladder!(16, 20, 24, 28, 32, 36, 40, 44);
    Err(DecodeError::LimitExceeded)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload whose header's model name claims 2^62 bytes, framed as a file.
    fn claiming_a_huge_name() -> Vec<u8> {
        // The format version (a varint: one byte), then the name's length: a u64 varint is the
        // marker 253 and eight little-endian bytes; then a few bytes of name.
        let mut body = vec![FORMAT_VERSION as u8, 253];
        body.extend_from_slice(&(1u64 << 62).to_le_bytes());
        body.extend_from_slice(b"gpt2");
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        bytes
    }

    #[test]
    fn a_length_in_the_payload_cannot_size_an_allocation() {
        // Without the limit, bincode allocates the 4 EiB first, and the process aborts.
        let err = decode_unverified(&claiming_a_huge_name()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("does not decode"), "{text}");
        assert!(text.contains("compile it again"), "{text}");
    }

    #[test]
    fn only_a_claim_over_the_limit_is_refused_as_one() {
        let DecodeError::LimitExceeded = decode_payload(&[2, 253, 0, 0, 0, 0, 0, 0, 0, 64])
            .expect_err("a 2^62-byte name is over the limit")
        else {
            panic!("the limit is what stops it");
        };
        // A short payload that is simply cut is an error of its own, not the limit.
        let err = decode_payload(&[2, 4, b'g']).expect_err("cut in the name");
        assert!(!matches!(err, DecodeError::LimitExceeded), "{err}");
    }
}
