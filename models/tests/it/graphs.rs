//! The forward graphs: snapshots of the tiny presets, the JSON round trip, every preset verified.

use protrain_ir::verify::verify_graph;
use protrain_ir::{DType, Graph};
use protrain_models::{build_forward, load, presets, BuildOptions};

/// Builds a preset at `[batch, seq]` in f32 and checks the graph with the IR's verifier.
fn build(name: &str, batch: u64, seq: u64) -> Graph {
    let config = load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let options = BuildOptions::new(batch, seq).with_dtype(DType::F32);
    let graph = build_forward(&config, &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    verify_graph(&graph).unwrap_or_else(|e| panic!("{name}: {e}"));
    graph
}

/// Snapshots the canonical text of a tiny preset at batch 2, sequence 16.
fn check_snapshot(name: &str) {
    let graph = build(name, 2, 16);
    insta::assert_snapshot!(name, graph.to_text());
}

#[test]
fn gpt2_tiny_graph() {
    check_snapshot("gpt2-tiny");
}

#[test]
fn llama_tiny_graph_groups_kv_heads() {
    check_snapshot("llama-tiny");
}

#[test]
fn mistral_tiny_graph_has_a_sliding_window() {
    check_snapshot("mistral-tiny");
}

#[test]
fn opt_tiny_graph() {
    check_snapshot("opt-tiny");
}

#[test]
fn graphs_survive_a_json_round_trip() {
    for preset in presets().iter().filter(|p| p.name.ends_with("-tiny")) {
        let graph = build(preset.name, 2, 16);
        let back =
            Graph::from_json(&graph.to_json()).unwrap_or_else(|e| panic!("{}: {e}", preset.name));
        assert_eq!(back.to_text(), graph.to_text(), "{}", preset.name);
    }
}

#[test]
fn every_preset_builds_at_seq_1024_or_says_why_not() {
    for preset in presets() {
        let config = preset.config().unwrap();
        match config.learned_positions() {
            Some(max) if max < 1024 => {
                // Learned-position models cannot run past their table; the error names both numbers.
                let err = build_forward(&config, &BuildOptions::new(1, 1024))
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("1024") && err.contains(&max.to_string()),
                    "{}: {err}",
                    preset.name
                );
            }
            _ => {
                let graph = build(preset.name, 1, 1024);
                assert_eq!(graph.info.seq, 1024);
                assert_eq!(
                    graph.outputs().len(),
                    1,
                    "{}: the loss is the only output",
                    preset.name
                );
            }
        }
    }
}
