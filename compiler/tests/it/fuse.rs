//! Fusion on the tiny and real presets: which rewrites apply, the report, the limits, and
//! that fused graphs differentiate and compile under every kind of policy.

mod fuse {
    use protrain_compiler::cost::Roofline;
    use protrain_compiler::emit::HeaderInputs;
    use protrain_compiler::fuse::{validate_fused, FuseLimits, FuseReport};
    use protrain_compiler::pipeline::{chunked, compile_policy, fused, training_graph};
    use protrain_compiler::OptimizerConfig;
    use protrain_ir::verify_schedule::verify_schedule;
    use protrain_ir::{DType, Epilogue, Graph, HardwareProfile, OpKind, Policy, ValueId};
    use std::time::Duration;

    fn forward(model: &str, batch: u64, seq: u64, dtype: DType) -> Graph {
        let config = protrain_models::load(model).expect("preset");
        let options = protrain_models::BuildOptions::new(batch, seq).with_dtype(dtype);
        protrain_models::build_forward(&config, &options).expect("builds")
    }

    fn fuse_on(model: &str, hardware: &str) -> (Graph, Graph, FuseReport) {
        let f = forward(model, 2, 16, DType::F32);
        let cost = Roofline::new(HardwareProfile::preset(hardware).expect("preset"));
        let (g, report) = fused(&f, &cost, &FuseLimits::default()).expect("fuses");
        (f, g, report)
    }

    /// `(count, epilogue)` of every fused op, in graph order.
    fn fused_ops(graph: &Graph) -> Vec<(u64, Epilogue)> {
        graph
            .ops()
            .filter_map(|(_, op)| match op.kind {
                OpKind::FusedLinear {
                    count, epilogue, ..
                } => Some((count, epilogue)),
                _ => None,
            })
            .collect()
    }

    fn layers(model: &str) -> usize {
        protrain_models::load(model).expect("preset").num_layers as usize
    }

    #[test]
    fn llama_fuses_qkv_gate_up_swiglu_and_residuals() {
        for model in ["llama-tiny", "mistral-tiny"] {
            let (f, g, report) = fuse_on(model, "rtx3090");
            let per_layer = [
                (3, Epilogue::None),
                (1, Epilogue::Residual),
                (2, Epilogue::Swiglu),
                (1, Epilogue::Residual),
            ];
            let want: Vec<_> = (0..layers(model)).flat_map(|_| per_layer).collect();
            assert_eq!(fused_ops(&g), want, "{model}");
            // Per layer: 3 + 2 + 2 + 3 ops became 4.
            assert_eq!(
                f.op_count() - g.op_count(),
                6 * layers(model),
                "{model}: {}",
                report.to_text()
            );
            assert_eq!(report.ops_before, f.op_count());
            assert_eq!(report.ops_after, g.op_count());
            assert_eq!(report.fusions.len(), 4 * layers(model));
            assert!(report.seconds_after < report.seconds_before);
            assert_eq!(report.stop_reason, "saturated");
            // The gate/up group alone is found and loses to the swiglu fusion containing it.
            assert!(
                report
                    .rejected
                    .iter()
                    .any(|(why, n)| why.contains("overlaps") && *n == layers(model)),
                "{:?}",
                report.rejected
            );
            let qkv = &report.fusions[0];
            assert_eq!(qkv.rule, "group");
            assert_eq!(
                qkv.outputs,
                ["layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v"]
            );
            assert!(qkv.seconds_after < qkv.seconds_before);
        }
    }

    #[test]
    fn gpt2_fuses_gelu_and_residuals_and_opt_fuses_biased_qkv_and_relu() {
        let (_, g, report) = fuse_on("gpt2-tiny", "a100-80gb");
        let per_layer = [
            (1, Epilogue::Residual),
            (1, Epilogue::Gelu),
            (1, Epilogue::Residual),
        ];
        let want: Vec<_> = (0..layers("gpt2-tiny")).flat_map(|_| per_layer).collect();
        assert_eq!(fused_ops(&g), want, "{}", report.to_text());

        let (_, g, report) = fuse_on("opt-tiny", "h100");
        let per_layer = [
            (3, Epilogue::None),
            (1, Epilogue::Residual),
            (1, Epilogue::Relu),
            (1, Epilogue::Residual),
        ];
        let want: Vec<_> = (0..layers("opt-tiny")).flat_map(|_| per_layer).collect();
        assert_eq!(fused_ops(&g), want, "{}", report.to_text());
        assert!(g.ops().any(|(_, op)| matches!(
            op.kind,
            OpKind::FusedLinear {
                count: 3,
                bias: true,
                ..
            }
        )));
    }

    #[test]
    fn fused_graphs_differentiate_and_compile_under_every_kind_of_policy() {
        for model in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
            let (_, g, _) = fuse_on(model, "rtx3090");
            let optimizer = OptimizerConfig {
                grad_clip: Some(1.0),
                ..Default::default()
            };
            let training = training_graph(&g, &optimizer).expect("autodiff");
            assert!(training
                .ops()
                .any(|(_, op)| matches!(op.kind, OpKind::FusedLinearBackward { .. })));
            let chunks = chunked(&training);
            let n = chunks.len() as u32;
            for policy in [
                Policy::resident(n, 2),
                Policy::protrain(0, 2, 1, 1, 2),
                Policy::protrain(1, 2, 0, 2, 2),
            ] {
                let header = HeaderInputs {
                    model: model.into(),
                    hardware: "test".into(),
                    device_budget_bytes: u64::MAX,
                    host_budget_bytes: u64::MAX,
                    report: String::new(),
                    flash_attention: true,
                };
                let s = compile_policy(&training, &chunks, &policy, header)
                    .unwrap_or_else(|e| panic!("{model} {policy}: {e}"));
                verify_schedule(&s).unwrap_or_else(|e| panic!("{model} {policy}: {e}"));
            }
        }
    }

    #[test]
    fn limits_stop_saturation_and_still_give_a_valid_graph() {
        let f = forward("llama-tiny", 2, 16, DType::F32);
        let cost = Roofline::new(HardwareProfile::preset("rtx3090").expect("preset"));
        // One iteration finds the groups and residuals but not the swiglu over a group.
        let one = FuseLimits {
            iterations: 1,
            ..Default::default()
        };
        let (g, report) = fused(&f, &cost, &one).expect("fuses");
        assert_eq!(report.stop_reason, "iteration limit 1");
        assert!(fused_ops(&g).contains(&(2, Epilogue::None)));
        assert!(!fused_ops(&g).iter().any(|(_, e)| *e == Epilogue::Swiglu));
        let tiny = FuseLimits {
            nodes: 10,
            ..Default::default()
        };
        let (g, report) = fused(&f, &cost, &tiny).expect("fuses");
        assert!(report.stop_reason.starts_with("node limit"), "{report:?}");
        protrain_ir::verify::verify_graph(&g).expect("valid");
        let no_time = FuseLimits {
            time: Duration::ZERO,
            ..Default::default()
        };
        let (_, report) = fused(&f, &cost, &no_time).expect("fuses");
        assert!(report.stop_reason.starts_with("time limit"), "{report:?}");
    }

    #[test]
    fn a_real_model_fuses_within_its_limits_and_the_report_reads() {
        let f = forward("llama-2-7b", 1, 1024, DType::BF16);
        let cost = Roofline::new(HardwareProfile::preset("rtx3090").expect("preset"));
        let (g, report) = fused(&f, &cost, &FuseLimits::default()).expect("fuses");
        assert_eq!(report.stop_reason, "saturated");
        assert_eq!(fused_ops(&g).len(), 4 * 32);
        let text = report.to_text();
        println!("{text}");
        assert!(text.starts_with("fusion: "), "{text}");
        for rule in ["group", "swiglu", "residual"] {
            assert!(text.contains(&format!("  {rule}")), "{text}");
        }
        assert!(report.seconds_after < report.seconds_before, "{text}");
    }

    /// A copy of `graph` with inputs `a` and `b` of the first op `pick` accepts swapped.
    fn with_swapped_inputs(
        graph: &Graph,
        pick: impl Fn(&OpKind) -> bool,
        a: usize,
        b: usize,
    ) -> Graph {
        let (mut out, mut map) = graph.skeleton();
        let mut swapped = false;
        for (_, op) in graph.ops() {
            let mut inputs: Vec<ValueId> = op.inputs.iter().map(|v| map[v]).collect();
            if !swapped && pick(&op.kind) {
                inputs.swap(a, b);
                swapped = true;
            }
            let names: Vec<(String, protrain_ir::Role)> = op
                .outputs
                .iter()
                .map(|&v| (graph.value(v).name.clone(), graph.value(v).role))
                .collect();
            let new = out
                .add_op_multi(op.kind.clone(), &inputs, &names, op.block, op.phase)
                .expect("the swapped operands have the same types");
            for (&old, new) in op.outputs.iter().zip(new) {
                map.insert(old, new);
            }
        }
        assert!(swapped, "no op to corrupt");
        for &v in graph.outputs() {
            out.add_output(map[&v]);
        }
        out
    }

    #[test]
    fn translation_validation_accepts_the_fused_graph_and_catches_a_miswired_one() {
        let (f, g, _) = fuse_on("llama-tiny", "rtx3090");
        let limits = FuseLimits::default();
        assert_eq!(validate_fused(&f, &g, &limits), Vec::<String>::new());
        // k and v weights swapped in the first q/k/v group: same types, wrong computation.
        let qkv = |k: &OpKind| matches!(k, OpKind::FusedLinear { count: 3, .. });
        let wrong = with_swapped_inputs(&g, qkv, 2, 3);
        assert_eq!(validate_fused(&f, &wrong, &limits), ["loss"]);
        // Gate and up weights swapped in the first gate/up/swiglu op.
        let swiglu = |k: &OpKind| {
            matches!(
                k,
                OpKind::FusedLinear {
                    epilogue: Epilogue::Swiglu,
                    ..
                }
            )
        };
        let wrong = with_swapped_inputs(&g, swiglu, 1, 2);
        assert_eq!(validate_fused(&f, &wrong, &limits), ["loss"]);
        // The unfused graph is trivially equivalent to itself.
        assert!(validate_fused(&f, &f, &limits).is_empty());
    }
    /// Fusion and translation validation of placement encode a graph with one encoder: the
    /// same graph added by either lands in the same nodes and classes. (With the two encodings
    /// this replaced, validation's e-graph had no kind leaves and this failed.)
    #[test]
    fn fusion_and_validation_encode_an_op_into_one_e_class() {
        use egg::EGraph;
        use protrain_compiler::egraph::{add_graph, Node, Plain};
        use protrain_compiler::validate::validate;
        for model in ["gpt2-tiny", "llama-tiny", "opt-tiny"] {
            let f = forward(model, 2, 16, DType::F32);
            let cost = Roofline::new(HardwareProfile::preset("rtx3090").expect("preset"));
            // No rewrite runs, so fusion's e-graph holds the forward graph and its unchanged
            // rebuild; validation's holds the forward graph twice.
            let none = FuseLimits {
                iterations: 0,
                ..Default::default()
            };
            let (g, report) = fused(&f, &cost, &none).expect("fuses");
            assert_eq!(g.op_count(), f.op_count(), "{model}");
            assert_eq!(report.egraph_nodes, validate(&f, &f).nodes, "{model}");
            assert_eq!(report.egraph_nodes, validate(&f, &g).nodes, "{model}");
            let mut egraph: EGraph<Node, Plain> = EGraph::default();
            let first = add_graph(&mut egraph, &f);
            let second = add_graph(&mut egraph, &g);
            egraph.rebuild();
            assert_eq!(
                egraph.total_number_of_nodes(),
                report.egraph_nodes,
                "{model}"
            );
            assert_eq!(egraph.number_of_classes(), report.egraph_classes, "{model}");
            // Every value of the rebuilt graph is in the class of the value of its name.
            let by_name: std::collections::HashMap<&str, ValueId> =
                f.values().map(|(id, v)| (v.name.as_str(), id)).collect();
            assert_eq!(by_name.len(), f.values().len(), "{model}: names are unique");
            for (id, v) in g.values() {
                let original = by_name[v.name.as_str()];
                assert_eq!(
                    egraph.find(first[original.index()]),
                    egraph.find(second[id.index()]),
                    "{model}: {}",
                    v.name
                );
            }
        }
    }
}
