//! Translation validation of placement: every policy computes the unplaced graph's loss and
//! gradients, and a placement that reads the wrong value is caught.

use protrain_compiler::pipeline::{chunked, training_graph};
use protrain_compiler::place::place;
use protrain_compiler::validate::validate;
use protrain_compiler::OptimizerConfig;
use protrain_ir::{DType, Graph, OpKind, Phase, Policy, Role};

fn training(model: &str, clip: Option<f64>) -> Graph {
    let config = protrain_models::load(model).expect("preset");
    let options = protrain_models::BuildOptions::new(2, 16).with_dtype(DType::F32);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    training_graph(
        &forward,
        &OptimizerConfig {
            grad_clip: clip,
            ..Default::default()
        },
    )
    .expect("autodiff")
}

#[test]
fn every_policy_computes_the_same_loss_and_gradients() {
    for model in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
        let graph = training(model, Some(1.0));
        let chunks = chunked(&graph);
        let n = chunks.len() as u32;
        for policy in [
            Policy::resident(n, 2),
            Policy::protrain(0, 2, 0, 2, 2),
            Policy::protrain(0, 2, 2, 0, 2),
            Policy::protrain(1, 2, 1, 1, 2),
        ] {
            let placed = place(&graph, &chunks, &policy).expect("places");
            let v = validate(&graph, &placed.graph);
            assert!(v.holds(), "{model} {policy}: {:?} differ", v.differing);
            // Loss, clip coefficient, and one gradient per parameter.
            assert_eq!(v.compared, graph.params().len() + 2, "{model}");
        }
    }
}

#[test]
fn recomputation_is_congruent_to_the_forward_pass() {
    let graph = training("llama-tiny", None);
    let chunks = chunked(&graph);
    // Every chunk resident, so nothing moves: the only difference is the recomputation.
    let n = chunks.len() as u32;
    let placed = place(&graph, &chunks, &Policy::protrain(n, 0, 0, 2, 2)).expect("places");
    assert!(placed.graph.ops().all(|(_, op)| !op.kind.is_movement()));
    let clones = placed
        .graph
        .ops()
        .filter(|(_, op)| op.phase == Phase::Recompute)
        .count();
    assert!(clones > 0, "checkpointed blocks are recomputed");
    let v = validate(&graph, &placed.graph);
    assert!(v.holds(), "{:?}", v.differing);
    // Clones merge with their originals: the e-graph holds no more distinct nodes than the two
    // graphs minus everything shared.
    let unshared = validate(&graph, &graph).nodes;
    assert_eq!(
        v.nodes, unshared,
        "every recompute clone is hash-consed into its original"
    );
}

#[test]
fn copies_are_encoded_as_what_they_copy_so_validation_adds_no_node_for_movement() {
    // Every chunk streamed, one layer swapped and one recomputed: gathers, offloads and
    // reloads everywhere. Each copy is its source, so the e-graph holds no node for any
    // copy: about the size of the one of the placed graph without its movement ops (each op
    // reading what its copies copy). The encoding is linear in the graphs, with no union to
    // propagate through the (wide) nodes that read a gathered chunk; a node per copy, merged
    // by a rewrite, would put at least one more node per movement output in the e-graph.
    let graph = training("llama-tiny", Some(1.0));
    let chunks = chunked(&graph);
    let placed = place(&graph, &chunks, &Policy::protrain(0, 2, 1, 1, 2)).expect("places");
    assert!(placed.graph.ops().any(|(_, op)| op.kind.is_movement()));
    let v = validate(&graph, &placed.graph);
    assert!(v.holds(), "{:?}", v.differing);
    let copies: usize = placed
        .graph
        .ops()
        .filter(|(_, op)| op.kind.is_movement())
        .map(|(_, op)| op.outputs.len())
        .sum();
    let without = validate(&graph, &placed.compute).nodes;
    assert!(copies > 8, "{copies} copies");
    assert!(
        v.nodes < without + copies / 4,
        "{} nodes against {without} without movement ops ({copies} copies)",
        v.nodes
    );
}

#[test]
fn a_placement_that_reads_the_wrong_value_is_caught() {
    let graph = training("gpt2-tiny", None);
    // Rebuild the graph with one backward op reading a different (same-typed) activation:
    // the gradients downstream of it must no longer match.
    let mut broken = Graph::new(graph.info.clone());
    for (_, b) in graph.blocks() {
        broken.add_block(b.name.clone(), b.kind);
    }
    let mut map = std::collections::HashMap::new();
    for &v in graph.inputs() {
        map.insert(
            v,
            broken.add_input(graph.value(v).name.clone(), graph.value(v).ty.clone()),
        );
    }
    for (_, p) in graph.params() {
        let ty = &graph.value(p.value).ty;
        let id = broken.add_param(p.name.clone(), ty.shape.clone(), ty.dtype, p.block);
        map.insert(p.value, broken.param(id).value);
    }
    for (id, v) in graph.values() {
        if v.role == Role::OptimizerState && v.producer.is_none() {
            map.insert(id, broken.add_state(v.name.clone(), v.ty.clone()));
        }
    }
    let mut sabotaged = false;
    let mut previous_gelu_input = None;
    for (_, op) in graph.ops() {
        let mut inputs: Vec<_> = op.inputs.iter().map(|v| map[v]).collect();
        if op.kind == OpKind::Gelu {
            previous_gelu_input = Some(inputs[0]);
        }
        if op.kind == OpKind::GeluBackward && !sabotaged {
            // Read the other layer's gelu input, as a slot reused too early would.
            if let Some(other) = previous_gelu_input.filter(|&o| o != inputs[0]) {
                inputs[0] = other;
                sabotaged = true;
            }
        }
        let outs: Vec<(String, Role)> = op
            .outputs
            .iter()
            .map(|&v| (graph.value(v).name.clone(), graph.value(v).role))
            .collect();
        let new = broken
            .add_op_multi(op.kind.clone(), &inputs, &outs, op.block, op.phase)
            .expect("same types");
        for (&o, n) in op.outputs.iter().zip(new) {
            map.insert(o, n);
        }
    }
    for &v in graph.outputs() {
        broken.add_output(map[&v]);
    }
    assert!(sabotaged, "the test found a backward op to break");
    let v = validate(&graph, &broken);
    assert!(!v.holds(), "reading the wrong activation must be caught");
    assert!(
        v.differing.iter().any(|d| d.contains("c_fc.weight")),
        "{:?}",
        v.differing
    );
    assert!(
        !v.differing.contains(&"loss".to_string()),
        "the forward pass is untouched"
    );
}
