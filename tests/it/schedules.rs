//! Compiled schedules as snapshots, and `protrain dump` at the compiler's stages.
//!
//! The snapshots are the canonical text of the tiny test models' schedules (f32, batch 2,
//! seq 16) without the search report (`PrintOptions::WITHOUT_REPORT`), under fixed policies,
//! compiled through the facade (`PolicyChoice::Fixed`). Review a change with
//! `cargo insta review`, or accept it with
//! `INSTA_UPDATE=always cargo test --test it -- schedules::`.

use crate::cli_support;
use crate::common::{pinned_host as host, rtx3090};
use cli_support::{path, protrain};

use protrain::ir::{BlockKind, DType, HardwareProfile, Policy, PrintOptions, Schedule};
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
use std::process::Output;

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const GIB: u64 = 1 << 30;

/// The policies snapshotted, as `--policy` takes them (the tiny models have 2 layers).
const POLICIES: [(&str, &str); 3] = [
    // Every chunk persistent, every block kept (no keys: the defaults).
    ("resident", ""),
    // ZeRO-3 offload: every chunk streamed through 2 buffers, every block recomputed.
    ("offload", "n_persist=0,n_buffer=2,n_checkpoint=2"),
    // One chunk kept on the device, the rest streamed; block 0 swapped, block 1 recomputed.
    ("mixed", "n_persist=1,n_buffer=2,n_swap=1,n_checkpoint=1"),
];

fn options(hardware: HardwareProfile, policy: &str) -> CompileOptions {
    CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype: DType::F32,
        hardware,
        device_budget: None,
        policy: PolicyChoice::parse(policy).expect("the test policies parse"),
        optimizer: OptimizerConfig::default(),
        fuse: true,
        forward_only: false,
        micro_batches: 1,
        topology: protrain::compiler::comm::Topology::SINGLE,
    }
}

/// Compiles a model through the facade under a fixed policy.
fn compile(model: &str, hardware: HardwareProfile, policy: &str) -> Schedule {
    let config = protrain::models::load(model).expect("the test models load");
    let options = options(hardware, policy);
    assert!(matches!(options.policy, PolicyChoice::Fixed(_)));
    protrain::compile(&config, &options)
        .expect("the test policies compile")
        .schedule
        .into_inner()
}

/// The header: the comment lines before the chunk table.
fn header(text: &str) -> String {
    text.lines()
        .take_while(|l| l.starts_with(';'))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Everything after the header.
fn body(text: &str) -> &str {
    &text[header(text).len()..]
}

/// Snapshots a model's schedule under every policy on the pinned host profile, and checks
/// that on an RTX 3090 the same policies give the same schedule with other predictions (whose
/// headers are snapshotted together).
fn check_model(model: &str) {
    let mut rtx_headers = String::new();
    for (name, policy) in POLICIES {
        let on_host = compile(model, host(), policy).to_text_with(PrintOptions::WITHOUT_REPORT);
        insta::assert_snapshot!(format!("{}_{name}_host", model.replace('-', "_")), on_host);
        let on_rtx = compile(model, rtx3090(), policy).to_text_with(PrintOptions::WITHOUT_REPORT);
        assert_eq!(
            body(&on_host),
            body(&on_rtx),
            "{model} under {name}: a fixed policy's schedule does not depend on the hardware"
        );
        assert_ne!(header(&on_host), header(&on_rtx));
        rtx_headers.push_str(&format!("{name}:\n{}\n", header(&on_rtx)));
    }
    insta::assert_snapshot!(
        format!("{}_rtx3090_headers", model.replace('-', "_")),
        rtx_headers
    );
}

/// A chunk-major schedule's header (policy `order=chunk-major`, the line that says the
/// micro-batches run through each layer in one program).
#[test]
fn gpt2_tiny_chunk_major_header() {
    let config = protrain::models::load("gpt2-tiny").expect("the test models load");
    let options = CompileOptions {
        micro_batches: 2,
        ..options(
            host(),
            "n_persist=0 n_buffer=2 n_checkpoint=1 order=chunk-major",
        )
    };
    let schedule = protrain::compile(&config, &options)
        .expect("the policy compiles")
        .schedule;
    assert!(schedule.is_chunk_major());
    let text = schedule.to_text_with(PrintOptions::WITHOUT_REPORT);
    insta::assert_snapshot!("gpt2_tiny_chunk_major_header", header(&text));
}

#[test]
fn gpt2_tiny_schedules() {
    check_model("gpt2-tiny");
}

#[test]
fn llama_tiny_schedules() {
    check_model("llama-tiny");
}

#[test]
fn facade_fixed_policy_compiles_the_policy_the_pipeline_compiles() {
    let config = protrain::models::load("llama-tiny").expect("loads");
    let forward = protrain::forward_graph(&config, BATCH, SEQ).expect("builds");
    let cost = protrain::compiler::cost::cost_model(&rtx3090());
    let (forward, _) = protrain::compiler::pipeline::fused(
        &forward,
        cost.as_ref(),
        &protrain::compiler::fuse::FuseLimits::default(),
    )
    .expect("fuses");
    let training = protrain::training_graph(&forward, &OptimizerConfig::default()).expect("ok");
    let chunks = protrain::compiler::pipeline::chunked(&training);
    let layers = training
        .blocks()
        .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
        .count();
    let expected = Policy::protrain(1, 2, 1, 1, layers);
    let header = protrain::compiler::emit::HeaderInputs {
        model: config.name.clone(),
        hardware: rtx3090().summary(),
        device_budget_bytes: rtx3090().usable_device_bytes(),
        host_budget_bytes: rtx3090().host_memory_bytes,
        report: format!("policy given: {expected}"),
        flash_attention: true,
    };
    let direct =
        protrain::compiler::pipeline::compile_policy(&training, &chunks, &expected, header)
            .expect("compiles");
    let via_facade = compile("llama-tiny", rtx3090(), POLICIES[2].1);
    assert_eq!(via_facade.header.policy, expected);
    assert_eq!(body(&via_facade.to_text()), body(&direct.to_text()));
}

// --- `protrain dump` -------------------------------------------------------------------------

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "protrain failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

/// Runs a command that must fail: exit status 2, one `error:` line, no panic. Returns stderr.
fn check_error(args: &[&str]) -> String {
    let out = protrain(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(2),
        "`protrain {}`: {err}",
        args.join(" ")
    );
    assert!(
        err.starts_with("error: ") && !err.contains("panicked"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "an error prints nothing on stdout");
    err
}

/// `protrain dump` of a tiny model compiled for an RTX 3090 (a preset that does not depend on
/// the machine) under the mixed policy.
fn dump_stage(model: &str, stage: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "dump",
        model,
        "--stage",
        stage,
        "--batch",
        "2",
        "--seq",
        "16",
        "--hardware",
        "rtx3090",
        "--dtype",
        "f32",
        "--policy",
        POLICIES[2].1,
    ];
    args.extend_from_slice(extra);
    stdout(&protrain(&args))
}

#[test]
fn dump_fused_prints_the_fused_forward_graph_and_reports_on_stderr() {
    let out = protrain(&[
        "dump",
        "llama-tiny",
        "--stage",
        "fused",
        "--batch",
        "2",
        "--seq",
        "16",
    ]);
    insta::assert_snapshot!("dump_llama_tiny_fused", stdout(&out));
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        report.starts_with("fusion: 34 -> 22 forward ops"),
        "{report}"
    );
    for rule in ["group", "residual", "swiglu"] {
        assert!(report.contains(&format!("  {rule} ")), "{report}");
    }
    // Autodiff starts from the fused graph unless told not to.
    let fused = dump_stage("llama-tiny", "autodiff", &[]);
    let unfused = dump_stage("llama-tiny", "autodiff", &["--no-fuse"]);
    assert!(fused.contains("fused_linear_backward[count=3]"));
    assert!(!unfused.contains("fused_linear"));
    let json: serde_json::Value =
        serde_json::from_str(&dump_stage("llama-tiny", "fused", &["--format", "json"]))
            .expect("json");
    assert!(json["graph"].is_object());
    assert_eq!(json["fusion"]["stop_reason"], "saturated");
    let refused = check_error(&["dump", "llama-tiny", "--stage", "fused", "--no-fuse"]);
    assert!(refused.contains("drop --no-fuse"), "{refused}");
}

#[test]
fn dump_chunked_prints_the_training_graph_then_the_chunk_table() {
    let text = dump_stage("gpt2-tiny", "chunked", &[]);
    let autodiff = dump_stage("gpt2-tiny", "autodiff", &[]);
    let table = text
        .strip_prefix(autodiff.as_str())
        .expect("the training graph comes first");
    insta::assert_snapshot!("dump_gpt2_tiny_chunked_table", table);
    let json: serde_json::Value =
        serde_json::from_str(&dump_stage("gpt2-tiny", "chunked", &["--format", "json"]))
            .expect("json");
    assert!(json["graph"].is_object() && json["chunks"]["trials"].is_array());
}

#[test]
fn dump_placed_lists_the_policy_and_the_swapped_activations() {
    let text = dump_stage("gpt2-tiny", "placed", &[]);
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("; policy: n_persist=1 n_buffer=2 prefetch=1 blocks=SC")
    );
    let swapped = lines.next().expect("a second line");
    assert!(swapped.starts_with("; swapped activations: "), "{swapped}");
    assert_ne!(
        swapped, "; swapped activations: 0, 0 B",
        "block 0 is swapped"
    );
    // Every activation listed belongs to the swapped block 0; the placed graph offloads and
    // reloads it with movement ops, and the schedule has a copy for each.
    let planned = dump_stage("gpt2-tiny", "planned", &[]);
    let listed: Vec<&str> = text
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with(";   "))
        .collect();
    for line in &listed {
        let name = line[4..].split(' ').next().expect("a value name");
        assert!(line.contains("(h.0."), "{line}");
        let offload = format!(" = offload_start ({name})");
        assert!(text.contains(&offload), "{name} is offloaded");
        let host = text
            .lines()
            .find_map(|l| {
                let (out, rest) = l.trim().split_once(" = offload (")?;
                let start = text.lines().find(|s| s.contains(&offload))?;
                let started = start.trim().split(' ').next()?;
                rest.starts_with(&format!("{started})"))
                    .then(|| out.to_string())
            })
            .expect("the offload completes");
        assert!(
            text.contains(&format!(" = reload_start ({host})")),
            "{name} is reloaded"
        );
    }
    assert_eq!(planned.matches("copy offload ").count(), listed.len());
    assert_eq!(planned.matches("copy reload ").count(), listed.len());
    let movement = text
        .lines()
        .find(|l| l.starts_with("; movement: "))
        .expect("a movement line");
    for kind in ["gather", "offload_grads", "offload", "reload"] {
        assert!(
            movement.contains(&format!(" {kind} (")),
            "{kind} in {movement}"
        );
    }
    assert!(movement.contains(" release,"), "{movement}");
    let resident = stdout(&protrain(&[
        "dump",
        "gpt2-tiny",
        "--stage",
        "placed",
        "--batch",
        "2",
        "--seq",
        "16",
        "--policy",
        "",
    ]));
    assert!(
        resident.contains("; swapped activations: 0, 0 B\n"),
        "{resident}"
    );
    let dot = dump_stage("gpt2-tiny", "placed", &["--format", "dot"]);
    assert!(dot.starts_with("digraph"), "{dot}");
    let json: serde_json::Value =
        serde_json::from_str(&dump_stage("gpt2-tiny", "placed", &["--format", "json"]))
            .expect("json");
    assert_eq!(json["policy"]["n_persist"], 1);
    assert!(!json["swapped"].as_array().expect("a list").is_empty());
    let kinds: Vec<&str> = json["movement"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|m| m["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"gather") && kinds.contains(&"reload"),
        "{kinds:?}"
    );
}

#[test]
fn dump_planned_of_a_model_is_the_schedule_compile_writes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("llama.ptsched");
    let args = [
        "llama-tiny",
        "--hardware",
        "rtx3090",
        "--batch",
        "2",
        "--seq",
        "16",
        "--policy",
        POLICIES[2].1,
        "--lr",
        "0.01",
    ];
    let mut compile = vec!["compile", "--dtype", "f32", "-o", path(&file)];
    compile.extend_from_slice(&args);
    stdout(&protrain(&compile));
    let written = protrain::ir::file::read(&file).expect("compile writes a valid schedule");
    let mut dump = vec![
        "dump", "--dtype", "f32", "--stage", "planned", "--format", "json",
    ];
    dump.extend_from_slice(&args);
    let dumped: Schedule =
        serde_json::from_str(&stdout(&protrain(&dump))).expect("a schedule in JSON");
    assert_eq!(dumped.to_text(), written.to_text());
    assert!(written.graph.to_text().contains("adamw[lr=0.01,"));
    // `scheduled` prints the full schedule too: the printer writes every instruction with its
    // buffers and offsets.
    let text = dump_stage("llama-tiny", "planned", &[]);
    assert!(text.contains("\nbuffers: ") && text.contains("\nstream0 compute"));
    assert_eq!(
        header(&dump_stage("llama-tiny", "scheduled", &[])),
        header(&text)
    );
}

#[test]
fn dump_reads_a_schedule_file_for_the_stages_it_holds() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("gpt2.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        "rtx3090",
        "--batch",
        "2",
        "--seq",
        "16",
        "--dtype",
        "f32",
        "--policy",
        POLICIES[2].1,
        "-o",
        path(&file),
    ]);
    stdout(&out);
    let schedule = protrain::ir::file::read(&file).expect("compile writes a valid schedule");
    let file = path(&file);
    for stage in ["scheduled", "planned"] {
        let text = stdout(&protrain(&["dump", file, "--stage", stage]));
        assert_eq!(text, schedule.to_text(), "{stage}");
    }
    let json = stdout(&protrain(&[
        "dump", file, "--stage", "planned", "--format", "json",
    ]));
    let read: Schedule = serde_json::from_str(&json).expect("a schedule in JSON");
    assert_eq!(read.to_text(), schedule.to_text());
    let placed = stdout(&protrain(&["dump", file, "--stage", "placed"]));
    assert!(placed.ends_with(&schedule.graph.to_text()));
    assert!(placed.starts_with(&format!("; policy: {}\n", schedule.header.policy)));
    // The same file under another name is still recognised by its magic.
    let renamed = dir.path().join("schedule.bin");
    std::fs::copy(file, &renamed).expect("copy");
    let text = stdout(&protrain(&["dump", path(&renamed), "--stage", "planned"]));
    assert_eq!(text, schedule.to_text());

    let err = check_error(&["dump", file, "--stage", "chunked"]);
    assert!(
        err.contains("placed, scheduled and planned, not chunked"),
        "{err}"
    );
    let err = check_error(&["dump", file, "--stage", "planned", "--format", "dot"]);
    assert!(err.contains("use --format text or json"), "{err}");
}

#[test]
fn qwen_and_olmo_real_configs_compile_for_an_rtx3090() {
    // The policy search on the published configs, as `protrain compile CONFIG --hardware
    // rtx3090` runs it (bf16, batch 1, 512 tokens).
    for file in [
        "qwen2.5-0.5b",
        "qwen2.5-7b",
        "qwen3-0.6b",
        "qwen3-8b",
        "olmo-2-1b",
    ] {
        let spec = format!(
            "{}/models/tests/real-configs/{file}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let config = protrain::models::load(&spec).expect("the real configs load");
        let mut hardware = rtx3090();
        hardware.host_memory_bytes = 256 * GIB;
        let options = CompileOptions {
            batch: 1,
            seq: 512,
            dtype: DType::BF16,
            policy: PolicyChoice::Auto,
            ..options(hardware, "")
        };
        let compiled = protrain::compile(&config, &options)
            .unwrap_or_else(|e| panic!("{file} does not compile for an rtx3090: {e}"));
        let peak = compiled
            .schedule
            .into_inner()
            .header
            .prediction
            .peak_device_bytes;
        assert!(peak <= rtx3090().device_memory_bytes, "{file}: peak {peak}");
    }
}
