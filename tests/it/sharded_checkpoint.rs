//! Sharded checkpoints as a user meets them: 4 ranks write a shard each and a manifest; the
//! checkpoint resumes on 4, 2 and 1 rank(s), and a 1-rank checkpoint on 4; a damaged or
//! missing shard, a damaged manifest and a save killed before its manifest fall back to the
//! checkpoint before; `--save` of sharded ranks is the single rank's file, byte for byte.
//!
//! Every run is gpt2-tiny in bf16 on the host backend under a policy that offloads every
//! chunk, which 4 ranks of 1 micro-batch each shard (the plan line says so); the global batch
//! is 4 micro-batches of 2 x 16 tokens, taken as 4 ranks x 1, 2 ranks x 2 or 1 rank x 4.

use crate::cli_support;
use cli_support::{files, killed_after, losses, path, protrain, stderr};

use std::path::Path;
use std::process::Output;

/// The arguments of a run of `steps` steps taking the global batch as `ranks` (`--gpus N`
/// and `--grad-accum K`, N x K = 4), then `extra`.
fn args<'a>(steps: &'a str, ranks: &'a [&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "gpt2-tiny",
        "--dtype",
        "bf16",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        steps,
        "--json",
        "--policy",
        "n_persist=0 n_buffer=1",
    ];
    args.extend_from_slice(ranks);
    args.extend_from_slice(extra);
    args
}

const FOUR: &[&str] = &["--gpus", "4"];
const TWO: &[&str] = &["--gpus", "2", "--grad-accum", "2"];
const ONE: &[&str] = &["--grad-accum", "4"];

/// Runs `args` and returns its losses.
fn run(args: &[&str]) -> Vec<(u64, String)> {
    losses(&protrain(args))
}

/// The 4-rank run of 4 steps, uninterrupted.
fn uninterrupted() -> Vec<(u64, String)> {
    let whole = run(&args("4", FOUR, &[]));
    assert_eq!(whole.len(), 4);
    whole
}

/// Writes the checkpoints of steps 1 and 2 of 4 sharded ranks to `ckpt` (all kept) and
/// checks the run's losses against `whole`'s.
fn checkpoint_four_ranks(ckpt: &Path, whole: &[(u64, String)]) {
    let out = protrain(&args(
        "2",
        FOUR,
        &[
            "--checkpoint-dir",
            path(ckpt),
            "--save-every",
            "1",
            "--keep-checkpoints",
            "0",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("offloaded chunks sharded"),
        "{}",
        stderr(&out)
    );
    assert_eq!(losses(&out), whole[..2]);
}

/// The run resumed from a copy of `ckpt` (a resumed run goes on saving into the directory it
/// resumes, so each resumes the checkpoints as they were written).
fn resume(ckpt: &Path, ranks: &[&str]) -> Output {
    resume_with(ckpt, "4", ranks)
}

/// [`resume`] to `steps` steps with the flags `extra`.
fn resume_with(ckpt: &Path, steps: &str, extra: &[&str]) -> Output {
    let copy = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(ckpt).expect("the checkpoint directory") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).expect("copy");
    }
    let mut flags = extra.to_vec();
    flags.extend(["--resume", path(copy.path())]);
    protrain(&args(steps, &[], &flags))
}

/// 4 sharded ranks write one shard file each and a manifest naming them, each shard a
/// quarter of the state (no rank gathers the others'); the checkpoint resumes on 4 ranks, on
/// 2 ranks of 2 micro-batches and on 1 rank of 4 micro-batches, bit for bit.
///
/// Mutation that fails it: `Executor::load_held` reading `0..hi - lo` instead of `lo..hi`
/// (every rank but 0 reads rank 0's elements: the 4-rank resume's losses differ).
#[test]
fn four_ranks_write_a_shard_each_and_resume_on_four_two_and_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let whole = uninterrupted();
    checkpoint_four_ranks(&ckpt, &whole);
    let names = files(&ckpt);
    for step in ["00000001", "00000002"] {
        assert!(
            names.contains(&format!("step-{step}.manifest.json")),
            "{names:?}"
        );
        for rank in 0..4 {
            let shard = format!("step-{step}.rank-{rank}-of-4.safetensors");
            assert!(names.contains(&shard), "{shard} in {names:?}");
        }
    }
    assert_eq!(names.len(), 10, "nothing else is written: {names:?}");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(ckpt.join("step-00000002.manifest.json")).expect("the manifest"),
    )
    .expect("the manifest is JSON");
    assert_eq!(manifest["metadata"]["ranks"], "4");
    assert_eq!(manifest["metadata"]["step"], "2");
    let shards = manifest["shards"].as_array().expect("shards");
    assert_eq!(shards.len(), 4);
    // The whole state of a 1-rank checkpoint, against each shard: a quarter, give or take
    // the replicated tensors rank 0 writes once and the headers.
    let single = dir.path().join("single");
    let out = protrain(&args(
        "1",
        ONE,
        &["--checkpoint-dir", path(&single), "--save-every", "1"],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let whole_bytes = std::fs::metadata(single.join("step-00000001.safetensors"))
        .expect("the 1-rank checkpoint")
        .len();
    for (rank, shard) in shards.iter().enumerate() {
        let file = shard["file"].as_str().expect("a file name");
        assert_eq!(file, format!("step-00000002.rank-{rank}-of-4.safetensors"));
        let bytes = std::fs::metadata(ckpt.join(file)).expect("the shard").len();
        assert_eq!(shard["bytes"], bytes, "{file}");
        assert!(
            bytes * 3 < whole_bytes,
            "{file} holds {bytes} bytes of a {whole_bytes}-byte state: more than its share"
        );
    }

    let out = resume(&ckpt, FOUR);
    assert!(
        stderr(&out).contains("resuming from")
            && stderr(&out).contains("step-00000002.manifest.json"),
        "{}",
        stderr(&out)
    );
    assert_eq!(losses(&out), whole[2..], "4 ranks");
    let out = resume(&ckpt, ONE);
    assert!(
        stderr(&out)
            .contains("re-sharding: the checkpoint holds the state of 4 rank(s), this run has 1"),
        "{}",
        stderr(&out)
    );
    assert_eq!(losses(&out), whole[2..], "1 rank of 4 micro-batches");
    // 2 ranks of 2 micro-batches sum each micro-batch's gradients over the ranks into the
    // accumulators in one rank's order: bit for bit too.
    assert_eq!(
        losses(&resume(&ckpt, TWO)),
        whole[2..],
        "2 ranks of 2 micro-batches"
    );
}

/// A 1-rank run writes the single-file checkpoint it always wrote, and 4 sharded ranks
/// resume it, each reading its part, as the uninterrupted run.
///
/// Mutation that fails it: `Checkpoint::read` of a single file ignoring the range (every
/// rank writes the tensor's first elements: the losses differ).
#[test]
fn a_one_rank_checkpoint_resumes_on_four_sharded_ranks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let whole = uninterrupted();
    let first = run(&args(
        "2",
        ONE,
        &["--checkpoint-dir", path(&ckpt), "--save-every", "2"],
    ));
    assert_eq!(first, whole[..2]);
    assert_eq!(files(&ckpt), ["step-00000002.safetensors"]);
    let out = resume(&ckpt, FOUR);
    assert!(
        stderr(&out)
            .contains("re-sharding: the checkpoint holds the state of 1 rank(s), this run has 4"),
        "{}",
        stderr(&out)
    );
    assert_eq!(losses(&out), whole[2..]);
}

/// Flips one byte of `file`'s data (its last byte: the last block of its last tensor).
fn flip_last_byte(file: &Path) {
    let mut bytes = std::fs::read(file).expect("the file");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x20;
    std::fs::write(file, bytes).expect("write it back");
}

/// What a case does to a copy of the checkpoint directory.
type Damage<'a> = &'a dyn Fn(&Path);

/// A checkpoint whose newest shard, manifest or save is damaged resumes from the one before,
/// on every rank alike, with a warning naming what was wrong: a flipped byte in one shard's
/// data (found only by the rank whose part it is, by its block checksum), a manifest naming
/// a shard that is gone, a flipped byte in the manifest, and a save killed after the shards
/// but before the manifest (no manifest: the shards alone do not count).
///
/// Mutations that fail it: `Shards::read` skipping the block checksum (the flipped byte is
/// read: no warning is given); `Checkpoint::restore` not telling the other ranks (rank 3
/// fails alone: the run fails instead of falling back).
#[test]
fn damaged_or_missing_shards_fall_back_to_the_checkpoint_before() {
    let whole = uninterrupted();
    let template = tempfile::tempdir().expect("temp dir");
    let written = template.path().join("ckpt");
    checkpoint_four_ranks(&written, &whole);
    let cases: [(&str, Damage, &str); 4] = [
        (
            "a flipped byte in rank 3's shard",
            &|d| flip_last_byte(&d.join("step-00000002.rank-3-of-4.safetensors")),
            "step-00000002.rank-3-of-4.safetensors is damaged: block",
        ),
        (
            "a missing shard",
            &|d| {
                std::fs::remove_file(d.join("step-00000002.rank-1-of-4.safetensors"))
                    .expect("remove it")
            },
            "step-00000002.rank-1-of-4.safetensors is missing",
        ),
        (
            "a flipped byte in the manifest",
            &|d| {
                let file = d.join("step-00000002.manifest.json");
                let text = std::fs::read_to_string(&file).expect("the manifest");
                let text = text.replacen("\"bytes\": ", "\"bytes\": 1", 1);
                std::fs::write(&file, text).expect("write it back")
            },
            "step-00000002.manifest.json is damaged: the manifest has checksum",
        ),
        (
            "a save killed before its manifest",
            &|d| std::fs::remove_file(d.join("step-00000002.manifest.json")).expect("remove it"),
            "",
        ),
    ];
    for (what, damage, warning) in cases {
        let dir = tempfile::tempdir().expect("temp dir");
        let ckpt = dir.path().join("ckpt");
        std::fs::create_dir(&ckpt).expect("a directory");
        for name in files(&written) {
            std::fs::copy(written.join(&name), ckpt.join(&name)).expect("copy");
        }
        damage(&ckpt);
        for ranks in [FOUR, ONE] {
            let out = resume(&ckpt, ranks);
            let err = stderr(&out);
            assert!(out.status.success(), "{what}, {ranks:?}: {err}");
            assert!(
                err.contains(warning),
                "{what}, {ranks:?}: no `{warning}` in {err}"
            );
            if !warning.is_empty() {
                assert!(
                    err.contains("trying the checkpoint before it"),
                    "{what}: {err}"
                );
            }
            assert!(
                err.contains("step-00000001.manifest.json (step 1)"),
                "{what}, {ranks:?}: {err}"
            );
            assert_eq!(losses(&out), whole[1..], "{what}, {ranks:?}");
        }
    }
}

/// A 4-rank run killed with SIGKILL while it checkpoints every step leaves checkpoints that
/// resume as if uninterrupted: whatever a shard or manifest write was doing, the newest
/// complete manifest and its shards are intact (each written atomically, the manifest last).
///
/// Mutation that fails it: `Executor::load_held` reading `0..hi - lo` (the resumed losses
/// differ). Where the kill lands is not controlled (a step's line is printed after its
/// checkpoint, and the ranks fsync five files a step, so it mostly lands in a save).
#[test]
fn a_sharded_run_killed_while_saving_resumes_as_if_uninterrupted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    fn long<'a>(steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec![
            "train",
            "gpt2-tiny",
            "--dtype",
            "bf16",
            "--batch",
            "4",
            "--seq",
            "64",
            "--steps",
            steps,
            "--json",
            "--policy",
            "n_persist=0 n_buffer=1",
            "--gpus",
            "4",
        ];
        a.extend_from_slice(extra);
        a
    }
    let whole = run(&long("12", &[]));
    let mut killed = long(
        "12",
        &[
            "--save-every",
            "1",
            "--keep-checkpoints",
            "0",
            "--checkpoint-dir",
        ],
    );
    killed.push(path(&ckpt));
    // A step's line is printed after its checkpoint: the kill lands in step 6's work or
    // its save.
    let seen = killed_after(&killed, 5);
    assert_eq!(seen, whole[..5]);
    let out = protrain(&long("12", &["--resume", path(&ckpt)]));
    let err = stderr(&out);
    assert!(!err.contains("warning"), "{err}");
    let resumed = losses(&out);
    let from = resumed.first().expect("the resumed run trained").0;
    // The run may have taken (and saved) more steps before the kill arrived.
    assert!(from >= 6, "resumed at step {from}");
    assert_eq!(resumed, whole[from as usize - 1..]);
}

/// `--save` of 4 sharded ranks writes the file one rank of 4 micro-batches writes, byte for
/// byte, streamed one parameter at a time (the workers join each gather).
///
/// Mutation that fails it: the workers reading the parameters in parameter order instead of
/// the file's (`save_order`): their gathers pair with rank 0's for other tensors, and the
/// run fails.
#[test]
fn save_of_sharded_ranks_is_the_single_ranks_file_byte_for_byte() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (four, one) = (
        dir.path().join("4.safetensors"),
        dir.path().join("1.safetensors"),
    );
    let a = run(&args("2", FOUR, &["--save", path(&four)]));
    let b = run(&args("2", ONE, &["--save", path(&one)]));
    assert_eq!(a, b);
    assert_eq!(
        std::fs::read(&four).expect("saved"),
        std::fs::read(&one).expect("saved"),
        "4 sharded ranks' file against 1 rank's"
    );
}

/// A sharded checkpoint resumed with another global batch (2 ranks x 1 micro-batch for the
/// checkpoint's 4) is refused before anything runs, naming the way out: the settings are
/// read from the manifest before anything is compiled.
///
/// Mutation that fails it: `peek_latest` reading a manifest as a single file (the run fails
/// with a safetensors error instead).
#[test]
fn a_sharded_checkpoint_with_another_global_batch_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let whole = uninterrupted();
    checkpoint_four_ranks(&ckpt, &whole);
    let out = resume(&ckpt, &["--gpus", "2", "--grad-accum", "1"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: checkpoint "), "{err}");
    assert!(
        err.contains("the checkpoint's steps take 4 micro-batches, this run's 2 ranks x --grad-accum 1 take 2"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

/// 2 ranks of which every one holds the persistent chunk whole (replicated) and a slice of
/// each streamed chunk: rank 0 alone writes the replicated tensors, once, and each rank its
/// slices; the checkpoint resumes on 1 rank of 2 micro-batches as the uninterrupted run.
///
/// Mutation that fails it: the owner rule giving a tensor every rank holds to the highest
/// rank (`t.held[q + 1..]` for `t.held[..q]`): the embedding lands in rank 1's shard.
#[test]
fn replicated_state_is_written_once_by_rank_0() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let two_ranks = |steps: &'static str, ranks: &[&'static str], extra: &[&str]| {
        let mut a: Vec<String> = [
            "train",
            "gpt2-tiny",
            "--dtype",
            "bf16",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            steps,
            "--json",
            "--policy",
            "n_persist=1 n_buffer=1",
        ]
        .iter()
        .chain(ranks)
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        protrain(&a)
    };
    let whole = losses(&two_ranks("4", &["--gpus", "2"], &[]));
    let first = two_ranks(
        "2",
        &["--gpus", "2"],
        &["--checkpoint-dir", path(&ckpt), "--save-every", "2"],
    );
    assert!(
        stderr(&first).contains("1 of 4 chunks persistent"),
        "{}",
        stderr(&first)
    );
    assert_eq!(losses(&first), whole[..2]);
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(ckpt.join("step-00000002.manifest.json")).expect("the manifest"),
    )
    .expect("the manifest is JSON");
    let pieces = |name: &str| {
        let tensors = manifest["tensors"].as_array().expect("tensors");
        let t = tensors
            .iter()
            .find(|t| t["name"] == name)
            .expect("the tensor");
        t["pieces"].clone()
    };
    // In the persistent chunk: whole, in rank 0's shard.
    assert_eq!(
        pieces("transformer.wte.weight"),
        serde_json::json!([{"shard": 0, "start": 0, "len": 16384}])
    );
    // In a streamed chunk, across the ranks' slices.
    let split = pieces("transformer.h.1.attn.c_attn.weight");
    let shards: Vec<u64> = split
        .as_array()
        .expect("pieces")
        .iter()
        .map(|p| p["shard"].as_u64().expect("a shard"))
        .collect();
    assert_eq!(shards, [0, 1]);
    let one = two_ranks("4", &["--grad-accum", "2"], &["--resume", path(&ckpt)]);
    assert_eq!(losses(&one), whole[2..]);
}

/// 4 sharded ranks of 2 micro-batches each (a global batch of 8 micro-batches) write a
/// shard each; the checkpoint resumes on 2 sharded ranks of 4 micro-batches and on 1 rank of
/// 8, bit for bit as the uninterrupted 4 x 2 run.
///
/// Mutation that fails it: the host backend's sharded sum adding the ranks in reverse order
/// (`(0..world).rev()` in `reduce_part_into`): 4 ranks and 2 ranks then add the global
/// micro-batches in different orders, and the resumed losses differ.
#[test]
fn four_ranks_of_two_micro_batches_resume_on_two_of_four_and_one_of_eight() {
    const FOUR_X2: &[&str] = &["--gpus", "4", "--grad-accum", "2"];
    const TWO_X4: &[&str] = &["--gpus", "2", "--grad-accum", "4"];
    const ONE_X8: &[&str] = &["--grad-accum", "8"];
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let whole = run(&args("4", FOUR_X2, &[]));
    assert_eq!(whole.len(), 4);
    let out = protrain(&args(
        "2",
        FOUR_X2,
        &["--checkpoint-dir", path(&ckpt), "--save-every", "2"],
    ));
    assert!(
        stderr(&out).contains("offloaded chunks sharded"),
        "{}",
        stderr(&out)
    );
    assert_eq!(losses(&out), whole[..2]);
    assert!(files(&ckpt).contains(&"step-00000002.rank-3-of-4.safetensors".to_string()));
    for ranks in [TWO_X4, ONE_X8] {
        let out = resume_with(&ckpt, "4", ranks);
        assert_eq!(losses(&out), whole[2..], "resumed as {ranks:?}");
    }
}
