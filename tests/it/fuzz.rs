//! Mutation fuzzing of every reader of user files: the model config parser, the schedule
//! reader (its bytes, and its counts set to what a damaged file could say), the hardware
//! profile reader, the tokenizer reader, the safetensors and `.npy` readers, and the
//! checkpoint loader. Each property takes a
//! valid file, damages it (bit flips, overwritten bytes, cuts, insertions, repeated pieces)
//! and asks only that reading it returns, `Ok` or an error: no panic, no hang, no allocation
//! sized by a number in the file.
//!
//! `cargo test` runs a few cases per reader from a fixed seed, so failures reproduce.
//! `scripts/fuzz.sh` runs a longer campaign: `PROTRAIN_FUZZ_CASES` sets the cases per reader
//! and `PROTRAIN_FUZZ_SEED` the seed; each property prints `fuzz NAME: N cases in S s`.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use protrain::runtime::checkpoint::{self, Checkpoint, Progress};
use protrain::runtime::data::{Batcher, TokenStream};
use protrain::runtime::weights::{save_safetensors, StorageDtype, WeightFile};
use protrain::runtime::{Executor, HostBackend};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

/// One damage done to a file's bytes.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flip bit `bit` of the byte at (index mod length).
    Flip(usize, u8),
    /// Overwrite the byte at (index mod length).
    Set(usize, u8),
    /// Cut the file at (index mod (length + 1)).
    Truncate(usize),
    /// Insert bytes at (index mod (length + 1)).
    Insert(usize, Vec<u8>),
    /// Copy `len` bytes from one place over another (lengths and offsets that look valid).
    Splice(usize, usize, usize),
    /// Write a little-endian number at (index mod length): huge counts and sizes.
    Number(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(a, b, n)| Mutation::Splice(a, b, n)),
        2 => (
            any::<usize>(),
            prop_oneof![Just(u64::MAX), Just(u64::from(u32::MAX)), Just(1u64 << 40), any::<u64>()]
        )
            .prop_map(|(i, v)| Mutation::Number(i, v)),
    ]
}

/// `bytes` with `mutations` applied in order.
fn mutate(bytes: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for m in mutations {
        let len = out.len();
        match m {
            Mutation::Flip(i, bit) if len > 0 => out[i % len] ^= 1 << bit,
            Mutation::Set(i, b) if len > 0 => out[i % len] = *b,
            Mutation::Truncate(i) => out.truncate(i % (len + 1)),
            Mutation::Insert(i, b) => {
                let at = i % (len + 1);
                out.splice(at..at, b.iter().copied());
            }
            Mutation::Splice(from, to, n) if len > 0 => {
                let n = (*n).min(len);
                let (from, to) = (from % (len - n + 1), to % (len - n + 1));
                let piece = out[from..from + n].to_vec();
                out[to..to + n].copy_from_slice(&piece);
            }
            Mutation::Number(i, v) if len >= 8 => {
                let at = i % (len - 7);
                out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
    out
}

/// Cases per reader: few in `cargo test`, more in a campaign.
fn cases() -> u32 {
    std::env::var("PROTRAIN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// Runs `property` on `cases()` damaged copies of `seed`, from a fixed seed, and prints the
/// rate for the campaign script.
fn fuzz(name: &str, seed: &[u8], property: impl Fn(&[u8])) {
    let damage = proptest::collection::vec(mutation(), 1..6);
    fuzz_with(name, damage, |mutations| {
        property(&mutate(seed, &mutations))
    });
}

/// Runs `property` on `cases()` values of `strategy`, from a fixed seed (or the campaign's),
/// and prints the rate for the campaign script.
fn fuzz_with<S: Strategy>(name: &str, strategy: S, property: impl Fn(S::Value)) {
    let rng_seed = std::env::var("PROTRAIN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_f00d);
    let config = Config {
        cases: cases(),
        rng_seed: RngSeed::Fixed(rng_seed),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let started = Instant::now();
    let result = runner.run(&strategy, |value| {
        property(value);
        Ok(())
    });
    println!(
        "fuzz {name}: {} cases in {:.3} s",
        cases(),
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("fuzz {name} failed: {e}");
    }
}

/// A compiled f32 gpt2-tiny schedule (batch 1 x seq 8), shared by the properties.
fn schedule() -> &'static protrain::ir::verify_schedule::VerifiedSchedule {
    static SCHEDULE: OnceLock<protrain::ir::verify_schedule::VerifiedSchedule> = OnceLock::new();
    SCHEDULE.get_or_init(|| {
        let config = protrain::models::load("gpt2-tiny").expect("a preset");
        let options = protrain::CompileOptions {
            batch: 1,
            seq: 8,
            dtype: protrain::ir::DType::F32,
            policy: protrain::PolicyChoice::parse("n_persist=0 n_buffer=2").expect("a policy"),
            ..protrain::CompileOptions::for_hardware(
                protrain::ir::HardwareProfile::preset("rtx3090").expect("a preset"),
            )
        };
        protrain::compile(&config, &options)
            .expect("it compiles")
            .schedule
    })
}

#[test]
fn config_parser() {
    let seed = std::fs::read("tests/fixtures/llama/config.json").expect("the fixture");
    fuzz("config", &seed, |bytes| {
        let text = String::from_utf8_lossy(bytes);
        let from = protrain::models::ConfigSource::Text("fuzz".into());
        if let Ok(config) = protrain::models::ModelConfig::from_json(&text, from) {
            let _ = config.info();
        }
    });
}

#[test]
fn schedule_reader() {
    let bytes = protrain::ir::file::encode(schedule());
    // Damage the payload and write a matching CRC, so the decoder itself is exercised; the
    // header (20 bytes) and CRC are damaged as they are in the other half of the cases.
    fuzz("schedule", &bytes, |damaged| {
        let _ = protrain::ir::file::decode(damaged);
        if damaged.len() > 24 {
            let mut fixed = damaged.to_vec();
            let end = fixed.len() - 4;
            let crc = crc32(&fixed[20..end]);
            fixed[end..].copy_from_slice(&crc.to_le_bytes());
            let _ = protrain::ir::file::decode(&fixed);
        }
    });
}

/// CRC-32 (IEEE), as the schedule file uses.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Writes `bytes` to `name` in a fresh directory and calls `read` on it.
fn with_file(name: &str, bytes: &[u8], read: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("written");
    read(&path);
}

#[test]
fn safetensors_reader() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let (a, b) = ([1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [0.5f32; 4]);
    let tensors: [(&str, &[usize], &[f32]); 2] = [("a", &[2, 3], &a), ("b.weight", &[4], &b)];
    save_safetensors(&path, &tensors, StorageDtype::F32, &[("k", "v")]).unwrap();
    let seed = std::fs::read(&path).unwrap();
    fuzz("safetensors", &seed, |bytes| {
        with_file("w.safetensors", bytes, |p| {
            if let Ok(file) = WeightFile::open(p) {
                let names: Vec<String> = file.names().map(String::from).collect();
                for n in names {
                    let _ = file.read_f32_vec(&n);
                }
            }
        })
    });
}

#[test]
fn npy_reader() {
    let mut dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (9,), }".to_string();
    while !(10 + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    let mut seed = b"\x93NUMPY\x01\x00".to_vec();
    seed.extend((dict.len() as u16).to_le_bytes());
    seed.extend(dict.as_bytes());
    for t in [3i32, 1, 4, 1, 5, 9, 2, 6, 5] {
        seed.extend(t.to_le_bytes());
    }
    fuzz("npy", &seed, |bytes| {
        with_file("t.npy", bytes, |p| {
            if let Ok(stream) = TokenStream::open(p) {
                let _ = stream.check_vocab(8);
                if let Ok(batcher) = Batcher::new(stream, 2, 2) {
                    for step in [0, 1, u64::MAX] {
                        let _ = batcher.batch(step);
                    }
                }
            }
        })
    });
}

#[test]
fn checkpoint_loader() {
    let schedule = schedule();
    let dir = tempfile::tempdir().unwrap();
    let mut executor = Executor::<HostBackend>::with_backend(schedule).unwrap();
    executor
        .load_params(&protrain::runtime::params::init_params(&schedule.graph, 1))
        .unwrap();
    let progress = Progress {
        step: 3,
        data_step: 3,
        data_tokens: 100,
        scaler: None,
    };
    let path = checkpoint::save(dir.path(), &executor, &progress).unwrap();
    let seed = std::fs::read(&path).unwrap();
    assert!(Checkpoint::load(&path, schedule).is_ok());
    fuzz("checkpoint", &seed, |bytes| {
        with_file(&checkpoint::file_name(3), bytes, |p| {
            // Damage to the tensors is caught by their checksums, to the step by the file name.
            if let Ok(ckpt) = Checkpoint::load(p, schedule) {
                assert_eq!(ckpt.progress.step, progress.step);
            }
        })
    });
}

/// A count as a damaged file could hold it: anything, small, a power of two, or a type's end.
fn count() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0..4096u64,
        (0..64u32).prop_map(|b| 1u64 << b),
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
    ]
}

/// Sets one count of `s` (chosen by `field`, at `index` where there are several) to `value`.
fn set_count(s: &mut protrain::ir::Schedule, field: u8, index: usize, value: u64) {
    use protrain::ir::{Instr, StreamKind};
    let streams = s.streams.len();
    let buffers = s.buffers.len();
    match field % 10 {
        0 => s.events = value as u32,
        1 => s.arena_bytes = value,
        2 => s.host_bytes = value,
        3 => s.disk_bytes = value,
        4 => {
            s.streams[index % streams].kind = StreamKind::Collective {
                gpus: value as u32,
                nodes: (value >> 32) as u32,
            }
        }
        5 => s.streams[index % streams]
            .instrs
            .push(Instr::EndMicroBatch {
                micro_batches: value as u32,
            }),
        6 => s.buffers[index % buffers].size = value,
        7 => s.buffers[index % buffers].offset = value,
        8 => {
            s.header.batch = value;
            s.header.seq = value >> 32;
        }
        _ => {
            // More streams than any schedule has: the verifier's clocks are streams squared.
            let copy = s.streams[index % streams].clone();
            s.streams
                .extend(std::iter::repeat_n(copy, (value % 512) as usize));
        }
    }
}

#[test]
fn schedule_counts() {
    let base: protrain::ir::Schedule = (**schedule()).clone();
    let changes = proptest::collection::vec((any::<u8>(), any::<usize>(), count()), 1..4);
    fuzz_with("counts", changes, |changes| {
        let mut s = base.clone();
        for (field, index, value) in changes {
            set_count(&mut s, field, index, value);
        }
        // Encoded whole, checksum and all: only the counts are wrong.
        let _ = protrain::ir::file::decode(&protrain::ir::file::encode(&s));
    });
}

#[test]
fn profile_reader() {
    let mut profile = protrain::ir::HardwareProfile::preset("rtx3090").expect("a preset");
    profile.add_measured_ops(&[protrain::ir::MeasuredOp {
        key: "matmul f32[8,64]x[64,64]".into(),
        seconds: 1e-6,
    }]);
    let seed = profile.to_json().expect("it encodes").into_bytes();
    fuzz("profile", &seed, |bytes| {
        with_file("p.json", bytes, |p| {
            if let Ok(profile) = protrain::ir::HardwareProfile::load(p.to_str().unwrap()) {
                let _ = profile.summary();
                let _ = profile.usable_device_bytes();
                let _ = profile.peak(protrain::ir::DType::BF16);
            }
        })
    });
}

#[test]
fn tokenizer_reader() {
    let seed = std::fs::read("runtime/tests/fixtures/text/tokenizer.json").expect("the fixture");
    fuzz("tokenizer", &seed, |bytes| {
        with_file("tokenizer.json", bytes, |p| {
            if let Ok(t) = protrain::runtime::text::TextTokenizer::load(p) {
                let _ = t.check_vocab(256);
            }
        })
    });
}
