//! The command line as a user runs it: output, exit status, and every error's text.

use crate::cli_support;
use cli_support::protrain;

use std::path::{Path, PathBuf};
use std::process::Output;

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).expect("utf-8 stderr")
}

fn shared_config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/tests/real-configs")
        .join(name)
}

/// Runs a command that must fail: exit status 2, one `error:` line, no panic. Returns stderr.
fn check_error(args: &[&str]) -> String {
    let out = protrain(args);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "`protrain {}` should exit 2; stderr: {err}",
        args.join(" ")
    );
    assert!(
        !err.contains("panicked"),
        "`protrain {}` panicked: {err}",
        args.join(" ")
    );
    assert!(
        err.starts_with("error: "),
        "`protrain {}` printed: {err}",
        args.join(" ")
    );
    assert!(stdout(&out).is_empty(), "an error prints nothing on stdout");
    err
}

/// A config file in a temporary directory.
fn temp_config(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, text).expect("write config");
    (dir, path.to_str().expect("utf-8").to_string())
}

#[test]
fn models_lists_every_preset_with_its_parameter_count() {
    let out = protrain(&["models"]);
    assert!(out.status.success());
    insta::assert_snapshot!(stdout(&out));
}

#[test]
fn info_reports_the_exact_parameter_count_of_llama_2_70b() {
    let out = protrain(&["info", "llama-2-70b", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info --json is JSON");
    assert_eq!(v["parameters"], 68976648192u64);
    assert_eq!(v["layers"], 80);
    assert_eq!(v["hidden"], 8192);
    assert_eq!(v["heads"], 64);
    assert_eq!(v["kv_heads"], 8);
    assert_eq!(v["vocab"], 32000);
}

#[test]
fn info_counts_every_shared_config_exactly() {
    for (file, count) in [
        ("gpt2.json", 124439808u64),
        ("gpt2-medium.json", 354823168),
        ("gpt2-large.json", 774030080),
        ("gpt2-xl.json", 1557611200),
        ("llama-2-7b.json", 6738415616),
        ("mistral-7b.json", 7241732096),
        ("opt-1.3b.json", 1315758080),
        ("qwen2.5-0.5b.json", 494032768),
        ("qwen2.5-7b.json", 7615616512),
        ("qwen3-0.6b.json", 596049920),
        ("qwen3-8b.json", 8190735360),
        ("olmo-2-1b.json", 1484916736),
    ] {
        let path = shared_config(file);
        let out = protrain(&["info", path.to_str().expect("utf-8"), "--json"]);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["parameters"], count, "{file}");
    }
}

#[test]
fn info_prints_a_readable_table() {
    let out = protrain(&["info", "llama-2-7b"]);
    assert!(out.status.success());
    insta::assert_snapshot!(stdout(&out));
}

#[test]
fn info_shows_what_makes_each_family_what_it_is() {
    // Configs that differ in biases, norms, q/k norms, tying or windows read differently.
    let (_dir, qwen_window) = temp_config(
        r#"{"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "use_sliding_window": true,
            "sliding_window": 64, "max_window_layers": 1}"#,
    );
    let mut text = String::new();
    for file in [
        "llama-2-7b.json",
        "qwen2.5-0.5b.json",
        "qwen2.5-7b.json",
        "qwen3-8b.json",
        "olmo-2-1b.json",
        "mistral-7b.json",
    ] {
        let out = protrain(&["info", shared_config(file).to_str().expect("utf-8")]);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        text.push_str(&format!("{file}:\n"));
        for line in stdout(&out)
            .lines()
            .skip(8)
            .take_while(|l| !l.contains("model states"))
        {
            text.push_str(&format!("{line}\n"));
        }
    }
    let out = protrain(&["info", &qwen_window]);
    assert!(out.status.success(), "{}", stderr(&out));
    text.push_str("qwen2 with a window above layer 0:\n");
    for line in stdout(&out)
        .lines()
        .skip(8)
        .take_while(|l| !l.contains("model states"))
    {
        text.push_str(&format!("{line}\n"));
    }
    insta::assert_snapshot!(text);
}

#[test]
fn dump_accepts_a_directory_holding_a_config() {
    let dir = shared_config("");
    let (tmp, _) =
        temp_config(&std::fs::read_to_string(dir.join("gpt2.json")).expect("shared config"));
    let out = protrain(&["dump", tmp.path().to_str().expect("utf-8"), "--seq", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("@transformer.h.11.mlp.c_proj.weight"));
}

#[test]
fn dump_dot_parses_as_graphviz_with_every_op_and_edge() {
    use graphviz_rust::dot_structures::{Graph as Dot, Stmt};
    // The forward graph as JSON says how many ops and data edges the DOT must hold.
    let json = protrain(&["dump", "gpt2-tiny", "--format", "json", "--seq", "8"]);
    assert!(json.status.success(), "{}", stderr(&json));
    let graph = protrain::ir::Graph::from_json(&stdout(&json)).expect("the dump reads back");
    let out = protrain(&["dump", "gpt2-tiny", "--format", "dot", "--seq", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Parsed by a DOT grammar (graphviz-rust's, a pest parser of the language Graphviz reads),
    // so no `dot` binary is needed.
    let parsed = graphviz_rust::parse(&stdout(&out)).expect("the DOT output parses");
    let Dot::DiGraph { stmts, .. } = parsed else {
        panic!("the DOT output is not a digraph");
    };
    let nodes = stmts.iter().filter(|s| matches!(s, Stmt::Node(_))).count();
    let edges = stmts.iter().filter(|s| matches!(s, Stmt::Edge(_))).count();
    assert_eq!(nodes, graph.op_count(), "one node per op");
    assert_eq!(
        edges,
        graph.dataflow().edge_count(),
        "one edge per value an op reads"
    );
    assert!(stdout(&out).contains("attention"), "the ops are labelled");
}

#[test]
fn dump_json_reads_back_and_writes_to_a_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("llama.json");
    let out = protrain(&[
        "dump",
        "llama-tiny",
        "--format",
        "json",
        "--batch",
        "2",
        "--seq",
        "16",
        "-o",
        path.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let graph = protrain::Graph::from_json(&std::fs::read_to_string(&path).expect("written"))
        .expect("valid graph");
    assert_eq!(graph.info.batch, 2);
    let text = protrain(&["dump", "llama-tiny", "--batch", "2", "--seq", "16"]);
    assert_eq!(graph.to_text(), stdout(&text));
}

#[test]
fn dump_autodiff_prints_backward_and_optimizer() {
    let out = protrain(&["dump", "mistral-tiny", "--stage", "autodiff", "--seq", "16"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for needle in [
        "backward layer 1",
        "attention_backward",
        "rms_norm_backward",
        "adamw",
        "optimizer",
    ] {
        assert!(text.contains(needle), "autodiff dump lacks {needle}");
    }
}

#[test]
fn every_error_names_the_problem_and_the_way_out() {
    let missing_field = temp_config(r#"{"model_type": "llama", "hidden_size": 64}"#);
    let invalid_json = temp_config("{\"model_type\": \"gpt2\",\n  \"n_embd\": 64,,\n}");
    let unknown_type = temp_config(r#"{"model_type": "bert", "hidden_size": 64}"#);
    let heads = temp_config(
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 100, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 3}"#,
    );
    let kv_heads = temp_config(
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3}"#,
    );
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("unknown preset", vec!["info", "lama-2-7b"]),
        ("file missing", vec!["info", "/nonexistent/config.json"]),
        ("missing field", vec!["info", &missing_field.1]),
        ("invalid json", vec!["info", &invalid_json.1]),
        ("unknown model_type", vec!["info", &unknown_type.1]),
        ("hidden not divisible by heads", vec!["info", &heads.1]),
        ("heads not divisible by kv heads", vec!["info", &kv_heads.1]),
        (
            "sequence too long",
            vec!["dump", "gpt2-tiny", "--seq", "4096"],
        ),
        ("empty batch", vec!["dump", "gpt2-tiny", "--batch", "0"]),
        (
            "missing data file",
            vec!["train", "gpt2-tiny", "--data", "/nonexistent/tokens.npy"],
        ),
        ("bad learning rate", vec!["train", "gpt2-tiny", "--lr=-1"]),
        ("bad beta", vec!["train", "gpt2-tiny", "--beta2", "1.5"]),
    ];
    let mut report = String::new();
    for (what, args) in cases {
        let err = check_error(&args);
        // Temporary paths differ run to run.
        let err = err
            .replace(&missing_field.1, "<dir>/config.json")
            .replace(&invalid_json.1, "<dir>/config.json")
            .replace(&unknown_type.1, "<dir>/config.json")
            .replace(&heads.1, "<dir>/config.json")
            .replace(&kv_heads.1, "<dir>/config.json");
        report.push_str(&format!("{what}:\n  {err}\n"));
    }
    insta::assert_snapshot!(report);
}

#[test]
fn train_on_the_synthetic_corpus_learns() {
    let out = protrain(&["train", "gpt2-tiny", "--steps", "200", "--log-json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let losses: Vec<f64> = stdout(&out)
        .lines()
        .map(|line| {
            let v: serde_json::Value =
                serde_json::from_str(line).expect("one JSON object per line");
            assert!(v["tokens_per_s"].as_f64().expect("tokens_per_s") > 0.0);
            v["loss"].as_f64().expect("loss")
        })
        .collect();
    assert_eq!(losses.len(), 200);
    let first = losses[0];
    let last: f64 = losses[190..].iter().sum::<f64>() / 10.0;
    // Uniform guessing over the 256-token vocabulary is ln 256 = 5.55; the corpus's entropy is
    // under 1 nat per token.
    assert!(first > 5.0, "first loss {first}");
    assert!(
        last < 1.5,
        "the loss should fall from {first} to below 1.5, it ended at {last}"
    );
}

#[test]
fn train_log_json_is_deterministic_and_saves_weights() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("w.safetensors");
    let args = [
        "train",
        "llama-tiny",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
    ];
    let a = protrain(&args);
    let mut with_save = args.to_vec();
    with_save.extend(["--save", save.to_str().expect("utf-8")]);
    let b = protrain(&with_save);
    assert!(a.status.success() && b.status.success(), "{}", stderr(&b));
    let losses = |o: &Output| -> Vec<String> {
        stdout(o)
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].to_string()
            })
            .collect()
    };
    assert_eq!(
        losses(&a),
        losses(&b),
        "the same seed gives the same losses"
    );
    // The saved weights load back as the init of another run.
    let c = protrain(&[
        "train",
        "llama-tiny",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
        "--init",
        save.to_str().expect("utf-8"),
    ]);
    assert!(c.status.success(), "{}", stderr(&c));
    let resumed: f64 =
        serde_json::from_str::<serde_json::Value>(stdout(&c).lines().next().expect("a line"))
            .expect("JSON")["loss"]
            .as_f64()
            .expect("loss");
    let first: f64 = losses(&a)[0].parse().expect("number");
    assert!(
        resumed < first,
        "trained weights ({resumed}) should beat the initial ones ({first})"
    );
}

#[test]
fn train_rejects_weights_of_another_model() {
    let dir = tempfile::tempdir().expect("temp dir");
    let save = dir.path().join("gpt2.safetensors");
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "8",
        "--log-json",
        "--save",
        save.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = check_error(&[
        "train",
        "llama-tiny",
        "--steps",
        "1",
        "--init",
        save.to_str().expect("utf-8"),
    ]);
    assert!(
        err.contains("model.embed_tokens.weight"),
        "the error should name a missing tensor: {err}"
    );
}

/// Every text of an SVG document, in order.
fn svg_texts(doc: &roxmltree::Document<'_>) -> Vec<String> {
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or_default().trim().to_string())
        .collect()
}

#[test]
fn plot_draws_memory_by_kind_with_budget_peak_and_every_planned_buffer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sched = dir.path().join("tiny.ptsched");
    cli_support::compile_gpt2_tiny(&sched, &[]);
    let s = protrain::ir::file::read(&sched).expect("the compiled schedule reads back");
    let planned = s
        .buffers
        .iter()
        .filter(|b| b.space == protrain::ir::Space::Device && b.size > 0)
        .count();
    let budget = protrain::ir::format_bytes(s.header.device_budget_bytes);

    let svg = dir.path().join("memory.svg");
    let out = protrain(&[
        "plot",
        cli_support::path(&sched),
        "-o",
        cli_support::path(&svg),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("wrote "), "{}", stdout(&out));
    let text = std::fs::read_to_string(&svg).expect("the SVG is written");
    let doc = roxmltree::Document::parse(&text).expect("the SVG is well-formed XML");
    assert!(doc.root_element().has_tag_name("svg"));
    let texts = svg_texts(&doc);
    assert!(
        texts
            .iter()
            .any(|t| t.starts_with(&format!("budget {budget}"))),
        "no budget mark in {texts:?}"
    );
    assert!(
        texts
            .iter()
            .any(|t| t.starts_with("peak ") && t.contains(" at ")),
        "no peak mark in {texts:?}"
    );
    for kind in ["persistent chunks", "activations kept", "workspaces"] {
        assert!(texts.iter().any(|t| t == kind), "no {kind} in the legend");
    }
    // The arena's buffers are the rectangles drawn translucent.
    let rects = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect") && n.attribute("opacity") == Some("0.9"))
        .count();
    assert_eq!(rects, planned, "one rectangle per planned device buffer");

    // The same on standard output.
    let out = protrain(&["plot", cli_support::path(&sched), "-o", "-"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("<svg"), "{}", &stdout(&out)[..80]);

    // PNG, by the extension.
    let png = dir.path().join("memory.png");
    let out = protrain(&[
        "plot",
        cli_support::path(&sched),
        "-o",
        cli_support::path(&png),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let decoder = png::Decoder::new(std::fs::File::open(&png).expect("the PNG is written"));
    let reader = decoder.read_info().expect("the PNG decodes");
    assert_eq!((reader.info().width, reader.info().height), (1200, 900));

    // --json says what was drawn.
    let out = protrain(&[
        "plot",
        cli_support::path(&sched),
        "-o",
        cli_support::path(&svg),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");
    assert_eq!(v["buffers"], planned);
    assert_eq!(v["budget_bytes"], s.header.device_budget_bytes);
    assert_eq!(v["arena_bytes"], s.arena_bytes);
    assert!(v["peak_bytes"].as_u64().unwrap() <= s.arena_bytes);

    let err = check_error(&["plot", cli_support::path(&sched), "-o", "memory.jpg"]);
    assert!(err.contains("FILE.svg or FILE.png"), "{err}");
}

#[test]
fn train_with_several_ranks_says_what_each_budget_is_per() {
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "1",
        "--gpus",
        "2",
        "--gpu-memory",
        "4MiB",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The plan goes to standard error, beside the log.
    let text = stderr(&out);
    assert!(text.contains("of 4.0 MiB budget per GPU"), "{text}");
    assert!(
        text.contains(" per rank (1/2 of the node's --host-memory)"),
        "{text}"
    );
}

/// Every family's tiny parity model (tests/fixtures/*) through the binary: `train` gives
/// PyTorch's losses (within 1e-4 relative, the parity tests' bound) with the fixture's
/// optimizer settings, `eval` of the initial weights gives `train`'s first loss to the bit, a
/// run checkpointed after step 2 and resumed gives the uninterrupted run's third loss to the
/// bit, `compile` writes a schedule that `verify` accepts, and `dump` shows the ops and weights
/// that make the family what it is.
#[test]
fn every_family_trains_evaluates_compiles_dumps_and_resumes() {
    let families: [(&str, &[&str]); 8] = [
        ("qwen2", &["self_attn.q_proj.bias", "= swiglu"]),
        (
            "qwen3",
            &["rms_norm[eps=1e-6, head_dim=", "self_attn.k_norm.weight"],
        ),
        (
            "gemma2",
            &["unit_offset=true", "softcap=1]", "= softcap[", "= geglu"],
        ),
        (
            "gemma3",
            &["self_attn.q_norm.weight", "= geglu", "scaling=linear("],
        ),
        ("gemma3_yarn", &["scaling=yarn(", "= geglu"]),
        (
            "phi3",
            &["= partial_rope[", "= packed_swiglu", "qkv_proj.weight"],
        ),
        (
            "olmo2",
            &["self_attn.q_norm.weight", "post_feedforward_layernorm"],
        ),
        ("qwen2_yarn", &["scaling=yarn(", "self_attn.k_proj.bias"]),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    for (family, markers) in families {
        let model = crate::common::fixtures().join(family);
        let expected = crate::common::read_json(&model.join("expected.json"));
        let torch = crate::common::numbers(&expected["losses"]);
        let number = |key: &str| expected[key].as_f64().expect(key).to_string();
        let (lr, beta1, beta2) = (number("lr"), number("beta1"), number("beta2"));
        let (eps, decay) = (number("eps"), number("weight_decay"));
        let clip = expected["grad_clip"].as_f64().map(|c| c.to_string());
        let weights = model.join("model.safetensors");
        let tokens = model.join("tokens.npy");
        let shape = ["--batch", "2", "--seq", "16", "--dtype", "f32"];
        let mut data = vec!["--data", cli_support::path(&tokens)];
        data.extend(shape);
        data.push("--json");
        let mut optimizer = vec![
            "--lr",
            &lr,
            "--beta1",
            &beta1,
            "--beta2",
            &beta2,
            "--eps",
            &eps,
            "--weight-decay",
            &decay,
        ];
        if let Some(clip) = &clip {
            optimizer.extend(["--grad-clip", clip.as_str()]);
        }
        let train = |steps: &str, extra: &[&str]| {
            let mut args = vec!["train", cli_support::path(&model), "--steps", steps];
            args.extend(&data);
            args.extend(&optimizer);
            args.extend(extra);
            let out = protrain(&args);
            assert!(out.status.success(), "{family}: {}", stderr(&out));
            cli_support::losses(&out)
        };
        let init = ["--init", cli_support::path(&weights)];
        let full = train("3", &init);
        assert_eq!(full.len(), 3, "{family}: {full:?}");
        for ((_, got), want) in full.iter().zip(&torch) {
            let got: f64 = got.parse().expect("a loss");
            assert!(
                ((got - want) / want).abs() < 1e-4,
                "{family}: loss {got} against PyTorch's {want}"
            );
        }
        let mut eval = vec![
            "eval",
            cli_support::path(&model),
            "--init",
            cli_support::path(&weights),
        ];
        eval.extend(&data);
        eval.extend(["--batches", "1"]);
        let out = protrain(&eval);
        assert!(out.status.success(), "{family}: {}", stderr(&out));
        let e: serde_json::Value =
            serde_json::from_str(stdout(&out).lines().last().expect("a line")).expect("JSON");
        assert_eq!(
            e["loss"].to_string(),
            full[0].1,
            "{family}: eval against train"
        );

        let ckpt = dir.path().join(format!("{family}-ckpt"));
        let saved = [
            "--init",
            cli_support::path(&weights),
            "--checkpoint-dir",
            cli_support::path(&ckpt),
            "--save-every",
            "2",
        ];
        assert_eq!(
            train("2", &saved),
            full[..2],
            "{family}: the checkpointed run"
        );
        let resumed = train("3", &["--resume", cli_support::path(&ckpt)]);
        assert_eq!(resumed, full[2..], "{family}: the resumed run");

        let schedule = dir.path().join(format!("{family}.ptsched"));
        let mut compile = vec![
            "compile",
            cli_support::path(&model),
            "-o",
            cli_support::path(&schedule),
        ];
        compile.extend(shape);
        let out = protrain(&compile);
        assert!(out.status.success(), "{family}: {}", stderr(&out));
        let out = protrain(&["verify", cli_support::path(&schedule)]);
        assert!(out.status.success(), "{family}: {}", stderr(&out));
        let out = protrain(&[
            "dump",
            cli_support::path(&model),
            "--batch",
            "2",
            "--seq",
            "16",
        ]);
        assert!(out.status.success(), "{family}: {}", stderr(&out));
        let text = stdout(&out);
        for marker in markers {
            assert!(text.contains(marker), "{family}: no `{marker}` in the dump");
        }
    }
}
