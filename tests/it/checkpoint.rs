//! Checkpoints as a user meets them: a killed run resumes bit-identically; a checkpoint of
//! another run is refused; a half-written checkpoint is ignored.

use crate::cli_support;
use cli_support::{files, killed_after, losses, path, protrain, stderr, stdout};

use std::path::Path;
use std::process::Output;

/// The training run of these tests: 40 steps of gpt2-tiny, large enough that a step takes a
/// little while, so the kill lands inside one.
const RUN: [&str; 8] = [
    "train",
    "gpt2-tiny",
    "--steps",
    "40",
    "--batch",
    "8",
    "--seq",
    "128",
];

#[test]
fn a_run_killed_mid_step_resumes_bit_identically() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let mut args = RUN.to_vec();
    args.extend([
        "--log-json",
        "--save-every",
        "5",
        "--checkpoint-dir",
        path(&ckpt),
    ]);
    args.extend(["--keep-checkpoints", "0"]);
    let seen = killed_after(&args, 12);
    assert_eq!(
        seen.last().map(|s| s.0),
        Some(12),
        "the run printed 12 steps"
    );
    let saved = files(&ckpt);
    assert!(
        saved.contains(&"step-00000010.safetensors".to_string()),
        "a checkpoint at step 10: {saved:?}"
    );

    // Resume under another policy: a checkpoint holds values, not offsets.
    let mut resume = RUN.to_vec();
    resume.extend(["--log-json", "--resume", path(&ckpt)]);
    resume.extend(["--policy", "n_persist=0,n_checkpoint=2"]);
    let resumed = losses(&protrain(&resume));
    let mut straight = RUN.to_vec();
    straight.push("--log-json");
    let straight = losses(&protrain(&straight));
    assert_eq!(straight.len(), 40);
    // The run may have saved step 15 before the kill arrived; it resumes from its latest.
    let from = resumed.first().expect("the resumed run trained").0;
    assert!(from == 11 || from == 16, "resumed at step {from}");
    assert_eq!(resumed.last().map(|s| s.0), Some(40));
    assert_eq!(
        resumed,
        straight[from as usize - 1..],
        "the resumed losses are the uninterrupted run's, bit for bit"
    );
    // And the killed run's own steps agree with the uninterrupted one's.
    assert_eq!(seen, straight[..12]);
}

#[test]
fn a_checkpoint_of_another_run_is_refused_naming_what_differs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("llama");
    let out = protrain(&[
        "train",
        "llama-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let before = files(&ckpt);
    assert_eq!(
        before,
        ["step-00000001.safetensors", "step-00000002.safetensors"]
    );
    let cases: [(&str, Vec<&str>, &[&str]); 4] = [
        (
            "another model",
            vec!["gpt2-tiny", "--batch", "2", "--seq", "16"],
            &[
                "model: the checkpoint is of llama-tiny, this run trains gpt2-tiny",
                "missing: `transformer.wte.weight`",
            ],
        ),
        (
            "another batch shape",
            vec!["llama-tiny", "--batch", "4", "--seq", "16"],
            &["batch x seq: the checkpoint is 2 x 16, this run is 4 x 16"],
        ),
        (
            "another learning rate",
            vec!["llama-tiny", "--batch", "2", "--seq", "16", "--lr", "0.01"],
            &[
                "optimizer: the checkpoint has lr=0.003",
                "this run has lr=0.01",
            ],
        ),
        (
            "another element type",
            vec![
                "llama-tiny",
                "--batch",
                "2",
                "--seq",
                "16",
                "--dtype",
                "bf16",
            ],
            &["--dtype: the checkpoint has f32, this run has bf16"],
        ),
    ];
    for (what, run, needles) in cases {
        let mut args = vec!["train"];
        args.extend(run);
        args.extend(["--steps", "4", "--log-json", "--resume", path(&ckpt)]);
        args.extend(["--save-every", "1"]);
        let out = protrain(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(err.starts_with("error: checkpoint "), "{what}: {err}");
        assert!(
            err.contains("was written by another training run"),
            "{what}: {err}"
        );
        assert!(
            err.contains("resume it with the model, batch, seq and optimizer"),
            "{what}: {err}"
        );
        for needle in needles {
            assert!(err.contains(needle), "{what}: no `{needle}` in {err}");
        }
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert!(out.stdout.is_empty(), "{what}: trained anyway");
        assert_eq!(files(&ckpt), before, "{what}: the checkpoints were touched");
    }
}

/// `--resume DIR` alone trains in the element type of the checkpointed run, not in the
/// backend's default (f32 on the host, bf16 on the CUDA backend): a bf16 run resumed on the
/// host gives the uninterrupted run's losses bit for bit, where an f32 resume of its f32
/// master weights would give others.
#[test]
fn a_run_resumed_alone_trains_in_its_checkpoints_element_type() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--dtype",
        "bf16",
        "--steps",
        "4",
        "--log-json",
    ];
    let mut saving = run.to_vec();
    saving.extend(["--save-every", "2", "--checkpoint-dir", path(&ckpt)]);
    let straight = losses(&protrain(&saving));
    assert_eq!(straight.len(), 4);
    std::fs::remove_file(ckpt.join("step-00000004.safetensors")).expect("remove step 4");
    let out = protrain(&["train", "gpt2-tiny", "--log-json", "--resume", path(&ckpt)]);
    assert_eq!(
        losses(&out),
        straight[2..],
        "the resumed steps are the uninterrupted bf16 run's: {}",
        stderr(&out)
    );
}

#[test]
fn a_half_written_checkpoint_is_ignored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let short = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
    ];
    let mut args = short.to_vec();
    args.extend([
        "--steps",
        "10",
        "--save-every",
        "5",
        "--checkpoint-dir",
        path(&ckpt),
    ]);
    losses(&protrain(&args));
    // What a save killed before its rename leaves: the start of a checkpoint, as `.tmp`.
    let whole = std::fs::read(ckpt.join("step-00000010.safetensors")).expect("step 10 saved");
    std::fs::write(
        ckpt.join("step-00000015.safetensors.tmp"),
        &whole[..whole.len() / 2],
    )
    .expect("write the leftover");

    let mut resume = short.to_vec();
    resume.extend(["--steps", "13", "--resume", path(&ckpt)]);
    let out = protrain(&resume);
    assert!(
        stderr(&out).contains("step-00000010.safetensors (step 10)"),
        "{}",
        stderr(&out)
    );
    let resumed = losses(&out);
    let mut straight = short.to_vec();
    straight.extend(["--steps", "13"]);
    let straight = losses(&protrain(&straight));
    assert_eq!(resumed, straight[10..]);
}

/// Every step's `(step, loss, lr)` of a successful `--log-json` run, as printed.
fn losses_and_rates(out: &Output) -> Vec<(u64, String, String)> {
    assert!(out.status.success(), "{}", stderr(out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object a line");
            (
                v["step"].as_u64().expect("step"),
                v["loss"].to_string(),
                v["lr"].to_string(),
            )
        })
        .collect()
}

/// Rewrites the safetensors metadata value of `key` in `file` to `value`, leaving the rest
/// (the checksums included) as written: what damage to the metadata looks like.
fn rewrite_metadata(file: &Path, key: &str, value: &str) {
    let bytes = std::fs::read(file).expect("read the checkpoint");
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Value =
        serde_json::from_slice(&bytes[8..8 + len]).expect("a JSON header");
    assert!(header["__metadata__"][key].is_string(), "{key} is recorded");
    header["__metadata__"][key] = value.into();
    let mut text = header.to_string().into_bytes();
    // The data must still start 8-byte aligned.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + len..]);
    std::fs::write(file, out).expect("write the checkpoint");
}

#[test]
fn resume_alone_continues_a_scheduled_run_and_refuses_contradicting_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "8",
        "--lr",
        "0.01",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--grad-clip",
        "1.0",
        "--seed",
        "3",
        "--log-json",
    ];
    let straight = losses_and_rates(&protrain(&run));
    assert_eq!(straight.len(), 8);
    assert_eq!(straight[0].2, "0.0", "a warmup's first step has rate 0");
    assert_eq!(straight[2].2, "0.01", "the warmup ends at --lr");
    let mut saving = run.to_vec();
    saving.extend(["--checkpoint-dir", path(&ckpt), "--save-every", "3"]);
    saving.extend(["--keep-checkpoints", "0"]);
    assert_eq!(losses_and_rates(&protrain(&saving)), straight);
    assert_eq!(
        files(&ckpt),
        [
            "step-00000003.safetensors",
            "step-00000006.safetensors",
            "step-00000008.safetensors"
        ]
    );
    // As if the run had been killed after step 6, with the checkpoint of step 6 damaged in
    // its metadata only (a data position no tensor checksum covers).
    std::fs::remove_file(ckpt.join("step-00000008.safetensors")).expect("remove step 8");
    rewrite_metadata(&ckpt.join("step-00000006.safetensors"), "data_step", "7");

    // `--resume DIR` alone: model aside, every setting comes from the checkpoint; the
    // policy may differ.
    let resume = [
        "train",
        "gpt2-tiny",
        "--resume",
        path(&ckpt),
        "--log-json",
        "--policy",
        "n_persist=0,n_buffer=2,n_checkpoint=2",
    ];
    let out = protrain(&resume);
    let err = stderr(&out);
    assert!(
        err.contains("skipping") && err.contains("its metadata has checksum"),
        "{err}"
    );
    assert!(err.contains("step-00000003.safetensors (step 3)"), "{err}");
    assert_eq!(
        losses_and_rates(&out),
        straight[3..],
        "the resumed steps, their losses and rates are the uninterrupted run's"
    );

    let contrary: [(&[&str], &str); 4] = [
        (
            &["--warmup-steps", "3"],
            "--warmup-steps: the checkpoint has 2, this run has 3",
        ),
        (
            &["--lr-schedule", "linear"],
            "--lr-schedule: the checkpoint has cosine, this run has linear",
        ),
        (
            &["--seed", "4"],
            "--seed: the checkpoint has 3, this run has 4",
        ),
        (
            &["--grad-clip", "0.5"],
            "optimizer: the checkpoint has grad_clip=1, this run has grad_clip=0.5",
        ),
    ];
    let before = files(&ckpt);
    for (flags, needle) in contrary {
        let mut args = resume.to_vec();
        args.extend(flags);
        let out = protrain(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.starts_with("error: checkpoint "), "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: no `{needle}` in {err}");
        assert!(
            err.contains("drop the ones that differ"),
            "{flags:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "{flags:?}: trained anyway");
    }
    assert_eq!(
        files(&ckpt),
        before,
        "a refused resume touches no checkpoint"
    );
}

/// The disk tier under `kill -9`: a run whose every chunk's optimizer state lives
/// on disk (the tight policy, 5.5 MiB of host memory) is killed mid-run, wherever its disk
/// stream is (reading or writing a chunk's state back), and resumed from its latest
/// checkpoint into a new file: its losses are the uninterrupted run's, bit for bit, and that
/// of a run with everything in memory. The killed run's file stays behind (no destructor
/// runs); the resumed run makes and removes its own.
#[test]
fn a_disk_tier_run_killed_mid_write_resumes_bit_identically() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (ckpt, disk) = (dir.path().join("ckpt"), dir.path().join("disk"));
    std::fs::create_dir(&disk).expect("disk dir");
    let mut run = RUN.to_vec();
    run.extend([
        "--policy",
        "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1",
        "--host-memory",
        "5632KiB",
        "--disk-memory",
        "64MiB",
        "--disk-dir",
        path(&disk),
        "--log-json",
    ]);
    let mut args = run.clone();
    args.extend(["--save-every", "5", "--checkpoint-dir", path(&ckpt)]);
    args.extend(["--keep-checkpoints", "0"]);
    let seen = killed_after(&args, 12);
    assert_eq!(files(&disk).len(), 1, "the killed run's state file stays");
    let left = files(&disk);
    let mut resume = run.clone();
    resume.extend(["--resume", path(&ckpt)]);
    let out = protrain(&resume);
    let resumed = losses(&out);
    assert_eq!(
        files(&disk),
        Vec::<String>::new(),
        "the resumed run removed the killed run's file, and its own"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("removed 1 state file(s) that killed runs left")
            && stderr.contains(&left[0]),
        "the removal is reported: {stderr}"
    );
    let mut straight = RUN.to_vec();
    straight.push("--log-json");
    let straight = losses(&protrain(&straight));
    let from = resumed.first().expect("the resumed run trained").0;
    assert!(from == 11 || from == 16, "resumed at step {from}");
    assert_eq!(
        resumed,
        straight[from as usize - 1..],
        "the resumed disk run's losses are the uninterrupted in-memory run's, bit for bit"
    );
    assert_eq!(seen, straight[..12]);
}

/// The disk tier at its most under `kill -9`: a run whose every model state lives on disk
/// (optimizer state, parameters and gradients of every chunk: 1 MiB of host memory at batch
/// 2 x 16) is killed mid-run and resumed from its latest checkpoint into a new file: its
/// losses are those of the same run with everything in host memory, bit for bit.
#[test]
fn a_run_with_every_state_on_disk_killed_resumes_bit_identically() {
    let base = [
        "train",
        "gpt2-tiny",
        "--steps",
        "30",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "1",
        "--policy",
        "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1",
        "--log-json",
    ];
    killed_on_disk_resumes_as_in_memory(
        &base,
        "1MiB",
        "the optimizer state of 4 of 4 chunks and the parameters and gradients of 4",
        |_| {},
    );
}

/// FNV-1a (64-bit) of `bytes`: the tensor and metadata checksum of checkpoint layout 3.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Rewrites the layout-4 checkpoint `file` as checkpoint layout 3 writes it: every tensor's
/// checksum FNV-1a (64-bit, 16 hex digits) under `fnv1a64.NAME` instead of CRC-32 under
/// `crc32.NAME`, the layout number 3, and the metadata's checksum computed anew over it all
/// (FNV-1a of every other key and value in key order, each as its u64 length and bytes).
fn rewrite_as_layout_3(file: &Path) {
    let bytes = std::fs::read(file).expect("read the checkpoint");
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let data = &bytes[8 + len..];
    let mut header: serde_json::Value =
        serde_json::from_slice(&bytes[8..8 + len]).expect("a JSON header");
    let mut meta: std::collections::BTreeMap<String, String> =
        serde_json::from_value(header["__metadata__"].take()).expect("string metadata");
    assert_eq!(meta["protrain.checkpoint"], "4", "written in layout 4");
    let names: Vec<String> = meta
        .keys()
        .filter_map(|k| k.strip_prefix("crc32."))
        .map(str::to_string)
        .collect();
    assert!(!names.is_empty(), "layout 4 checks its tensors with CRC-32");
    for name in names {
        meta.remove(&format!("crc32.{name}"));
        let offsets = &header[&name]["data_offsets"];
        let (start, end) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
        let sum = fnv1a64(&data[start as usize..end as usize]);
        meta.insert(format!("fnv1a64.{name}"), format!("{sum:016x}"));
    }
    meta.insert("protrain.checkpoint".into(), "3".into());
    meta.remove("metadata_checksum");
    let mut summed = Vec::new();
    for (key, value) in &meta {
        for text in [key, value] {
            summed.extend((text.len() as u64).to_le_bytes());
            summed.extend(text.as_bytes());
        }
    }
    meta.insert(
        "metadata_checksum".into(),
        format!("{:016x}", fnv1a64(&summed)),
    );
    header["__metadata__"] = serde_json::to_value(meta).expect("metadata as JSON");
    let mut text = header.to_string().into_bytes();
    // The data must still start 8-byte aligned.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    std::fs::write(file, out).expect("write the checkpoint");
}

/// A checkpoint of layout 3 (tensors checked with FNV-1a) still resumes bit-identically, and
/// its tensor checksums are still checked: one flipped bit of its data is refused as damage.
#[test]
fn a_layout_3_checkpoint_resumes_and_its_fnv_checksums_are_checked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "6",
        "--log-json",
    ];
    let straight = losses(&protrain(&run));
    let mut saving = run.to_vec();
    saving.extend(["--checkpoint-dir", path(&ckpt), "--save-every", "3"]);
    saving.extend(["--keep-checkpoints", "0"]);
    assert_eq!(losses(&protrain(&saving)), straight);
    std::fs::remove_file(ckpt.join("step-00000006.safetensors")).expect("remove step 6");
    let step3 = ckpt.join("step-00000003.safetensors");
    rewrite_as_layout_3(&step3);

    let resume = ["train", "gpt2-tiny", "--resume", path(&ckpt), "--log-json"];
    assert_eq!(
        losses(&protrain(&resume)),
        straight[3..],
        "the layout-3 checkpoint resumes bit for bit"
    );

    // The resumed run saved step 6 as the original did; step 3 is to be the latest again.
    std::fs::remove_file(ckpt.join("step-00000006.safetensors")).expect("remove step 6");
    // One flipped bit in the last byte of the data (a tensor's, not the header's).
    let mut bytes = std::fs::read(&step3).expect("read");
    *bytes.last_mut().expect("data") ^= 1;
    std::fs::write(&step3, bytes).expect("write");
    let out = protrain(&resume);
    let err = stderr(&out);
    assert!(
        err.contains("step-00000003.safetensors") && err.contains("checksum"),
        "the damaged tensor is caught: {err}"
    );
    assert!(out.stdout.is_empty(), "trained from a damaged checkpoint");
}

/// Chunk-major accumulation from the command line: `train --grad-accum 2` under a policy
/// that forces `order=chunk-major` (streamed chunks, a checkpointed layer) prints the
/// sequential run's losses bit for bit; and a sequential run's checkpoint resumes in the
/// chunk-major order as if never interrupted (a checkpoint holds values, and neither order
/// keeps anything across steps but the weights and the optimizer state).
#[test]
fn chunk_major_training_prints_the_sequential_losses_and_resumes_across_orders() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let sequential = "n_persist=0,n_buffer=2,n_checkpoint=1";
    let chunk_major = "n_persist=0,n_buffer=2,n_checkpoint=1,order=chunk-major";
    let run = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "2",
        "--steps",
        "4",
        "--log-json",
    ];
    let mut saving = run.to_vec();
    saving.extend(["--policy", sequential]);
    saving.extend(["--save-every", "2", "--checkpoint-dir", path(&ckpt)]);
    let straight = losses(&protrain(&saving));
    assert_eq!(straight.len(), 4);
    let mut interleaved = run.to_vec();
    interleaved.extend(["--policy", chunk_major]);
    let out = protrain(&interleaved);
    assert!(
        stdout(&out).contains("x 2 micro-batches (chunk-major)")
            || stderr(&out).contains("x 2 micro-batches (chunk-major)"),
        "the run says its order: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert_eq!(
        losses(&out),
        straight,
        "chunk-major losses are the sequential run's: {}",
        stderr(&out)
    );
    std::fs::remove_file(ckpt.join("step-00000004.safetensors")).expect("remove step 4");
    let mut resume = run.to_vec();
    resume.extend(["--policy", chunk_major, "--resume", path(&ckpt)]);
    let out = protrain(&resume);
    assert_eq!(
        losses(&out),
        straight[2..],
        "the chunk-major resume continues the sequential run: {}",
        stderr(&out)
    );
}

/// Two sharded ranks (threads) under `kill -9`, every offloaded chunk's optimizer state
/// shards on disk (each rank its own file, named for it): killed mid-run and resumed from
/// the latest checkpoint into new files, the run's losses are those of the same two ranks
/// with everything in host memory, bit for bit. The killed run's two files stay behind (no
/// destructor runs); the resumed run sweeps them and removes its own.
#[test]
fn sharded_ranks_with_their_state_on_disk_killed_resume_bit_identically() {
    sharded_killed_on_disk_resume_as_in_memory(
        |memory| crate::sharded::least_on_disk(memory, 2).0,
        "the optimizer state of 4 of 4 chunks",
    );
}

/// Two sharded ranks (threads) under `kill -9` with a node's host memory so small that each
/// rank's parameter and gradient shards are on its disk file too, beside its optimizer
/// state shards: killed mid-run and resumed from the latest checkpoint into new files, the
/// run's losses are those of the same two ranks in host memory, bit for bit; the killed
/// run's two files stay behind and the resumed run sweeps them.
#[test]
fn sharded_ranks_with_their_parameters_on_disk_killed_resume_bit_identically() {
    sharded_killed_on_disk_resume_as_in_memory(
        |memory| {
            crate::sharded::least_with_storage_on_disk(memory, 2)
                .expect("storage moves")
                .0
        },
        "the optimizer state of 4 of 4 chunks and the parameters and gradients of 4",
    );
}

/// Two sharded ranks of gpt2-tiny (f32, the tight policy) trained with the node's host
/// memory `node_host` gives their in-memory schedule, the disk tier reporting `held`:
/// [`killed_on_disk_resumes_as_in_memory`], with each rank's file left by the killed run.
fn sharded_killed_on_disk_resume_as_in_memory(
    node_host: impl Fn(&protrain::ir::verify_schedule::VerifiedSchedule) -> u64,
    held: &str,
) {
    sharded_accumulating_killed_on_disk_resume_as_in_memory(1, node_host, held);
}

/// [`sharded_killed_on_disk_resume_as_in_memory`] with `micro_batches` micro-batches a step
/// on each rank (`--grad-accum`).
fn sharded_accumulating_killed_on_disk_resume_as_in_memory(
    micro_batches: u64,
    node_host: impl Fn(&protrain::ir::verify_schedule::VerifiedSchedule) -> u64,
    held: &str,
) {
    use crate::sharded::{compile_on, BATCH, SEQ, TIGHT};
    let memory = compile_on(
        "gpt2-tiny",
        TIGHT,
        2,
        micro_batches,
        protrain::ir::DType::F32,
        None,
        protrain::ir::HardwareProfile::host(),
    )
    .expect("compiles");
    let (host, batch, seq, accum) = (
        node_host(&memory).to_string(),
        BATCH.to_string(),
        SEQ.to_string(),
        micro_batches.to_string(),
    );
    let policy = TIGHT.replace(' ', ",");
    let base = [
        "train",
        "gpt2-tiny",
        "--steps",
        "30",
        "--batch",
        &batch,
        "--seq",
        &seq,
        "--grad-accum",
        &accum,
        "--gpus",
        "2",
        "--dtype",
        "f32",
        "--policy",
        &policy,
        "--log-json",
    ];
    killed_on_disk_resumes_as_in_memory(&base, &host, held, |left| {
        assert_eq!(left.len(), 2, "each rank's state file stays: {left:?}");
        for rank in ["-rank0.state", "-rank1.state"] {
            assert!(left.iter().any(|f| f.ends_with(rank)), "{left:?}");
        }
    });
}

/// Two sharded ranks (threads) of two micro-batches a step under `kill -9`, with a node's
/// host memory so small that each rank's parameter shards are on its disk file beside its
/// optimizer state shards (read before every micro-batch's uploads, read and written around
/// the update; the gradient shards are the accumulators and stay): killed mid-run and
/// resumed from the latest checkpoint into new files, the run's losses are those of the
/// same two ranks accumulating in host memory, bit for bit; the killed run's two files stay
/// behind and the resumed run sweeps them.
#[test]
fn accumulating_sharded_ranks_with_their_parameters_on_disk_killed_resume_bit_identically() {
    sharded_accumulating_killed_on_disk_resume_as_in_memory(
        2,
        |memory| {
            crate::sharded::least_with_storage_on_disk(memory, 2)
                .expect("storage moves")
                .0
        },
        "the optimizer state of 4 of 4 chunks and the parameters of 4",
    );
}

/// Runs `base` (a 30-step `train` command that ends in `--log-json`) with `host` of host
/// memory and 64 MiB of disk in a directory of its own, after checking that the schedule it
/// compiles to reports `compiled_says` of its disk tier; kills it after step 12 (checkpoints
/// every 5 steps), hands the files left in the disk directory to `after_kill`, resumes it
/// from its latest checkpoint, and asserts that every disk file is removed and the losses
/// before the kill and after the resume are `base`'s in host memory, bit for bit.
fn killed_on_disk_resumes_as_in_memory(
    base: &[&str],
    host: &str,
    compiled_says: &str,
    after_kill: impl FnOnce(&[String]),
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (ckpt, disk) = (dir.path().join("ckpt"), dir.path().join("disk"));
    std::fs::create_dir(&disk).expect("disk dir");
    let mut run = base.to_vec();
    run.extend([
        "--host-memory",
        host,
        "--disk-memory",
        "64MiB",
        "--disk-dir",
        path(&disk),
    ]);
    let mut compile = vec!["compile"];
    compile.extend(
        run.iter()
            .skip(1)
            .filter(|a| !["--steps", "30", "--log-json", "--disk-dir", path(&disk)].contains(a)),
    );
    let file = dir.path().join("s.ptsched");
    compile.extend(["-o", path(&file)]);
    let compiled = protrain(&compile);
    let text = stdout(&compiled);
    assert!(text.contains(compiled_says), "{text}{}", stderr(&compiled));
    let mut args = run.clone();
    args.extend(["--save-every", "5", "--checkpoint-dir", path(&ckpt)]);
    args.extend(["--keep-checkpoints", "0"]);
    let seen = killed_after(&args, 12);
    after_kill(&files(&disk));
    let mut resume = run.clone();
    resume.extend(["--resume", path(&ckpt)]);
    let resumed = losses(&protrain(&resume));
    assert_eq!(files(&disk), Vec::<String>::new(), "every file removed");
    let straight = losses(&protrain(base));
    let from = resumed.first().expect("the resumed run trained").0;
    assert!(from == 11 || from == 16, "resumed at step {from}");
    assert_eq!(
        resumed,
        straight[from as usize - 1..],
        "the resumed run's losses are the in-memory run's, bit for bit"
    );
    assert_eq!(seen, straight[..12]);
}

/// Carried disk write-backs under `kill -9`: the run of
/// [`a_run_with_every_state_on_disk_killed_resumes_bit_identically`] (every model state on
/// disk) leaves its last write-backs to the next step's start (its schedule carries them),
/// so each checkpoint is written while some are pending: saving writes them back first, and
/// the run killed mid-run and resumed from its latest checkpoint (whose first step has
/// nothing to write back) gives the losses of the run with everything in host memory.
#[test]
fn a_run_with_carried_write_backs_killed_resumes_bit_identically() {
    let base = [
        "train",
        "gpt2-tiny",
        "--steps",
        "30",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "1",
        "--policy",
        "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1",
        "--log-json",
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("s.ptsched");
    let mut compile = vec!["compile"];
    compile.extend(
        base[1..]
            .iter()
            .filter(|a| !["--steps", "30", "--log-json"].contains(a)),
    );
    compile.extend([
        "--host-memory",
        "1MiB",
        "--disk-memory",
        "64MiB",
        "-o",
        path(&file),
    ]);
    protrain(&compile);
    let dump = protrain(&["dump", path(&file), "--stage", "scheduled"]);
    assert!(
        stdout(&dump).contains("carried from the previous step"),
        "the schedule carries write-backs"
    );
    killed_on_disk_resumes_as_in_memory(
        &base,
        "1MiB",
        "the optimizer state of 4 of 4 chunks and the parameters and gradients of 4",
        |_| {},
    );
}
