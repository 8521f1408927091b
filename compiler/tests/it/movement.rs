//! Movement in the placed graph: placement inserts a movement op for every copy its policy
//! implies; the dump shows each in program order (snapshots per tiny model under a resident,
//! a streaming and a swapping policy); translation validation proves the placed graph computes
//! what the training graph computes, and a miswired copy (the wrong parameter of a gather, a
//! reload of another activation, a gather of the wrong chunk, a slot holding two chunks, a read
//! after a release) is refused.

use protrain_compiler::pipeline::{chunked, training_graph};
use protrain_compiler::place::{place, Placed};
use protrain_compiler::validate::{check_gathers, validate};
use protrain_compiler::OptimizerConfig;
use protrain_ir::verify::verify_graph;
use protrain_ir::{ChunkTable, Graph, Movement, OpId, OpKind, Policy, Role, ValueId};
use std::collections::HashMap;

/// The three policies, for a model with `chunks` chunks and 2 layers.
fn policies(chunks: u32) -> [(&'static str, Policy); 3] {
    [
        // Every chunk on the device, every block kept: no movement at all.
        ("resident", Policy::resident(chunks, 2)),
        // ZeRO-3 offload: every chunk streamed through 2 slots, blocks recomputed.
        ("streaming", Policy::protrain(0, 2, 0, 2, 2)),
        // One chunk kept, the rest streamed; block 0 swapped, block 1 recomputed; clipping
        // sends the coefficient to the host optimizer.
        ("swapping", Policy::protrain(1, 2, 1, 1, 2)),
    ]
}

fn training(model: &str, clip: Option<f64>) -> (Graph, ChunkTable) {
    let config = protrain_models::load(model).expect("preset");
    let options = protrain_models::BuildOptions::new(2, 16);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    let optimizer = OptimizerConfig {
        grad_clip: clip,
        ..Default::default()
    };
    let training = training_graph(&forward, &optimizer).expect("autodiff");
    let chunks = chunked(&training);
    (training, chunks)
}

fn clip_for(name: &str) -> Option<f64> {
    (name == "swapping").then_some(1.0)
}

fn count(graph: &Graph, mnemonic: &str) -> usize {
    graph
        .ops()
        .filter(|(_, op)| op.kind.mnemonic() == mnemonic)
        .count()
}

#[test]
fn placed_graphs_show_every_movement_in_program_order() {
    for model in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
        for (name, policy) in policies(training(model, None).1.len() as u32) {
            let (training, chunks) = training(model, clip_for(name));
            let placed = place(&training, &chunks, &policy).expect("places");
            verify_graph(&placed.graph).expect("a valid placed graph");
            let g = &placed.graph;
            match name {
                "resident" => assert!(g.ops().all(|(_, op)| !op.kind.is_movement())),
                _ => {
                    assert!(count(g, "gather") > 0, "{model} {name}");
                    assert_eq!(count(g, "gather"), count(g, "prefetch"), "{model} {name}");
                    assert_eq!(count(g, "gather"), count(g, "release"), "{model} {name}");
                    assert!(count(g, "offload_grads") > 0, "{model} {name}");
                }
            }
            let swaps = name == "swapping";
            assert_eq!(count(g, "offload") > 0, swaps, "{model} {name}");
            assert_eq!(count(g, "reload"), count(g, "offload"), "{model} {name}");
            assert_eq!(count(g, "to_host") > 0, swaps, "{model} {name}");
            insta::assert_snapshot!(format!("{model}_{name}"), g.to_text());
        }
    }
}

#[test]
fn placement_is_validated_under_every_policy() {
    for model in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
        for (name, policy) in policies(training(model, None).1.len() as u32) {
            let (training, chunks) = training(model, clip_for(name));
            let placed = place(&training, &chunks, &policy).expect("places");
            let v = validate(&training, &placed.graph);
            assert!(v.holds(), "{model} {name}: {:?}", v.differing);
            assert!(
                v.compared > 1,
                "{model} {name}: the loss and gradients are compared"
            );
            assert!(check_gathers(&placed.graph, &chunks).is_empty());
        }
    }
}

/// A copy of `graph` with `edit` applied to each op's kind and inputs (in `graph`'s ids)
/// before it is added; outputs keep their names and roles.
fn rebuild(graph: &Graph, mut edit: impl FnMut(OpId, &mut OpKind, &mut Vec<ValueId>)) -> Graph {
    let (mut out, mut map) = graph.skeleton();
    for (id, value) in graph.values() {
        if value.role == Role::OptimizerState && value.producer.is_none() {
            map.insert(id, out.add_state(value.name.clone(), value.ty.clone()));
        }
    }
    for (id, op) in graph.ops() {
        let (mut kind, mut inputs) = (op.kind.clone(), op.inputs.clone());
        edit(id, &mut kind, &mut inputs);
        let inputs: Vec<ValueId> = inputs.iter().map(|v| map[v]).collect();
        let outputs: Vec<(String, Role)> = op
            .outputs
            .iter()
            .map(|&v| (graph.value(v).name.clone(), graph.value(v).role))
            .collect();
        let new = out
            .add_op_multi(kind, &inputs, &outputs, op.block, op.phase)
            .expect("the edit keeps types");
        for (&old, new) in op.outputs.iter().zip(new) {
            map.insert(old, new);
        }
    }
    for &v in graph.outputs() {
        out.add_output(map[&v]);
    }
    out
}

fn swapping(model: &str) -> (Graph, ChunkTable, Placed) {
    let (training, chunks) = training(model, Some(1.0));
    let policy = Policy::protrain(1, 2, 1, 1, 2);
    let placed = place(&training, &chunks, &policy).expect("places");
    (training, chunks, placed)
}

#[test]
fn a_kernel_reading_the_wrong_parameter_of_a_gather_fails_validation() {
    let (training, _, placed) = swapping("gpt2-tiny");
    let g = &placed.graph;
    // Two gathered copies of the same type in one gather: a kernel reading one reads the
    // other instead.
    let (a, b) = g
        .ops()
        .filter(|(_, op)| matches!(op.kind, OpKind::MoveDone(Movement::Gather { .. })))
        .find_map(|(_, op)| {
            op.outputs.iter().enumerate().find_map(|(i, &x)| {
                op.outputs[i + 1..]
                    .iter()
                    .find(|&&y| g.value(y).ty == g.value(x).ty && !g.users(x).is_empty())
                    .map(|&y| (x, y))
            })
        })
        .expect("a gather with two parameters of one type");
    let reader = g.users(a)[0];
    let mutated = rebuild(g, |id, _, inputs| {
        if id == reader {
            for v in inputs.iter_mut().filter(|v| **v == a) {
                *v = b;
            }
        }
    });
    verify_graph(&mutated).expect("still well formed: only the dataflow is wrong");
    let v = validate(&training, &mutated);
    assert!(
        !v.holds(),
        "a kernel reads {} for {}",
        g.value(b).name,
        g.value(a).name
    );
}

#[test]
fn a_reload_of_another_activation_fails_validation() {
    let (training, _, placed) = swapping("llama-tiny");
    let g = &placed.graph;
    let reloads: Vec<(OpId, ValueId)> = g
        .ops()
        .filter(|(_, op)| op.kind == OpKind::MoveStart(Movement::Reload))
        .map(|(id, op)| (id, op.inputs[0]))
        .collect();
    // Two reloads of host copies of the same type: the first reloads the second's copy.
    let (first, other) = reloads
        .iter()
        .find_map(|&(id, x)| {
            reloads
                .iter()
                .find(|&&(other, y)| other != id && g.value(y).ty == g.value(x).ty)
                .map(|&(_, y)| (id, y))
        })
        .expect("two swapped activations of one type");
    let mutated = rebuild(g, |id, _, inputs| {
        if id == first {
            inputs[0] = other;
        }
    });
    let v = validate(&training, &mutated);
    assert!(
        !v.holds(),
        "a reload of another activation passed validation"
    );
}

#[test]
fn a_gather_of_the_wrong_chunk_is_refused() {
    let (_, chunks, placed) = swapping("gpt2-tiny");
    let g = &placed.graph;
    // Relabel the first gather's chunk (start, done and release alike): the graph stays
    // well formed, but the gather copies parameters that are not the chunk's.
    let (first, other) = g
        .ops()
        .find_map(|(_, op)| match op.kind {
            OpKind::MoveStart(Movement::Gather { chunk, .. }) => Some(chunk),
            _ => None,
        })
        .map(|c| {
            let other = (0..chunks.len() as u32)
                .map(protrain_ir::ChunkId)
                .find(|&o| o != c)
                .expect("two chunks");
            (c, other)
        })
        .expect("a gather");
    let relabel = |c: protrain_ir::ChunkId| if c == first { other } else { c };
    let mut seen = HashMap::new();
    let mutated = rebuild(g, |id, kind, _| match kind {
        OpKind::MoveStart(Movement::Gather { chunk, slot })
        | OpKind::MoveDone(Movement::Gather { chunk, slot })
            if *chunk == first && seen.len() < 2 =>
        {
            seen.insert(id, *slot);
            *chunk = relabel(*chunk);
        }
        OpKind::Release { chunk, .. } if *chunk == first && seen.len() == 2 => {
            seen.insert(id, 0);
            *chunk = relabel(*chunk);
        }
        _ => {}
    });
    assert_eq!(
        seen.len(),
        3,
        "the gather's start, done and release were relabelled"
    );
    verify_graph(&mutated).expect("still well formed");
    let wrong = check_gathers(&mutated, &chunks);
    assert_eq!(wrong.len(), 1, "{wrong:?}");
    assert!(wrong[0].contains(&format!("chunk{}", other.0)), "{wrong:?}");
}

#[test]
fn a_slot_holding_two_chunks_at_once_is_refused() {
    let (_, _, placed) = swapping("gpt2-tiny");
    let g = &placed.graph;
    // Move the second gather (and its release) into the slot the first one still holds.
    let gathers: Vec<(OpId, u32)> = g
        .ops()
        .filter_map(|(id, op)| match op.kind {
            OpKind::MoveStart(Movement::Gather { slot, .. }) => Some((id, slot)),
            _ => None,
        })
        .collect();
    let (held, moved) = (gathers[0].1, gathers[1].1);
    assert_ne!(held, moved, "the first two gathers fill both slots");
    let second_chunk = match g.op(gathers[1].0).kind {
        OpKind::MoveStart(Movement::Gather { chunk, .. }) => chunk,
        _ => unreachable!("a gather"),
    };
    let mut done = 0;
    let mutated = rebuild(g, |_, kind, _| match kind {
        OpKind::MoveStart(Movement::Gather { chunk, slot })
        | OpKind::MoveDone(Movement::Gather { chunk, slot })
            if *chunk == second_chunk && done < 2 =>
        {
            *slot = held;
            done += 1;
        }
        OpKind::Release { chunk, slot } if *chunk == second_chunk && done == 2 => {
            *slot = held;
            done += 1;
        }
        _ => {}
    });
    let err = verify_graph(&mutated)
        .expect_err("two chunks in one slot")
        .to_string();
    assert!(err.contains(&format!("into slot{held}")), "{err}");
    assert!(err.contains("has not released"), "{err}");
}

#[test]
fn a_read_after_a_release_is_refused() {
    let (_, _, placed) = swapping("gpt2-tiny");
    let g = &placed.graph;
    // The first release, moved before the last reader of what it releases: rebuild with the
    // release's inputs read by a later kernel instead, which then reads a released copy.
    let (release, copy) = g
        .ops()
        .find_map(|(id, op)| matches!(op.kind, OpKind::Release { .. }).then(|| (id, op.inputs[0])))
        .expect("a release");
    let ty = g.value(copy).ty.clone();
    let later = g
        .ops()
        .skip(release.index() + 1)
        .find_map(|(id, op)| {
            op.inputs
                .iter()
                .position(|&v| g.value(v).ty == ty && g.value(v).role == Role::Param)
                .map(|i| (id, i))
        })
        .expect("a later kernel reads a parameter of the same type");
    let mutated = rebuild(g, |id, _, inputs| {
        if id == later.0 {
            inputs[later.1] = copy;
        }
    });
    let err = verify_graph(&mutated)
        .expect_err("a read after release")
        .to_string();
    assert!(err.contains("released it from its slot"), "{err}");
}

#[test]
fn the_stream_pass_asks_the_graph_not_the_policy() {
    // Every movement decision is in the placed graph: the stream pass never reads the policy.
    let source = include_str!("../../src/streams.rs");
    for asks in [".policy", "n_persist", "n_buffer", "BlockMode", "Policy"] {
        assert!(!source.contains(asks), "streams.rs reads `{asks}`");
    }
}
