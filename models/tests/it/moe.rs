//! Mixture-of-experts configs (Mixtral, Qwen3-MoE): transformers' defaults, which layers are
//! sparse, what is refused by name, and the graph a sparse layer lowers to.

use protrain_ir::{DType, OpKind};
use protrain_models::{build_forward, Architecture, BuildOptions, ConfigSource, ModelConfig};

fn parse(json: &str) -> Result<ModelConfig, String> {
    ModelConfig::from_json(json, ConfigSource::Text("test".into())).map_err(|e| e.to_string())
}

const MIXTRAL: &str = r#""model_type": "mixtral", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4"#;
const QWEN3_MOE: &str = r#""model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4"#;

#[test]
fn mixtral_takes_transformers_defaults() {
    let config = parse(
        r#"{"model_type": "mixtral", "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8}"#,
    )
    .unwrap();
    let Architecture::Mixtral(arch) = &config.architecture else {
        panic!("not mixtral: {:?}", config.architecture)
    };
    // MixtralConfig: 8 experts, top-2, renormalised; no window; theta 1e6; 8 KV heads.
    assert_eq!((arch.moe.experts, arch.moe.top_k), (8, 2));
    assert!(arch.moe.normalize);
    assert_eq!(arch.moe.expert_intermediate_size, 48);
    assert_eq!(arch.moe.sparse_layers, [true, true]);
    assert_eq!(arch.layout.sliding_window, None);
    assert_eq!(arch.layout.rope_theta, 1e6);
    assert_eq!(config.norm_eps, 1e-5);
    assert_eq!(config.num_kv_heads, 8);
}

#[test]
fn qwen3_moe_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() {
    let config = parse(&format!(
        r#"{{{QWEN3_MOE}, "num_key_value_heads": 2, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 24}}"#
    ))
    .unwrap();
    let Architecture::Qwen3Moe(arch) = &config.architecture else {
        panic!("not qwen3_moe")
    };
    // (i + 1) % 2 == 0 and i not in [3]: layer 1 only.
    assert_eq!(arch.moe.sparse_layers, [false, true, false, false]);
    assert!(!arch.moe.normalize, "norm_topk_prob defaults to false");
    assert_eq!(arch.moe.expert_intermediate_size, 24);
    // head_dim is hidden / heads when absent (Qwen3-MoE has no default of 128).
    assert_eq!(config.head_dim, 8);
    let defaults = parse(&format!("{{{QWEN3_MOE}}}")).unwrap();
    let Architecture::Qwen3Moe(arch) = &defaults.architecture else {
        panic!("not qwen3_moe")
    };
    assert_eq!((arch.moe.experts, arch.moe.top_k), (128, 8));
    assert_eq!(defaults.num_kv_heads, 4);
    // transformers 5 writes Qwen3-MoE's count as `num_local_experts`, the Hub's configs as
    // `num_experts`: both name one field of both classes.
    for field in ["num_experts", "num_local_experts"] {
        let config = parse(&format!("{{{QWEN3_MOE}, \"{field}\": 8}}")).unwrap();
        let Architecture::Qwen3Moe(arch) = &config.architecture else {
            panic!("not qwen3_moe")
        };
        assert_eq!(arch.moe.experts, 8, "{field}");
    }
    let err = parse(&format!(
        r#"{{{QWEN3_MOE}, "num_experts": 8, "num_local_experts": 4}}"#
    ))
    .unwrap_err();
    assert!(err.contains("num_local_experts"), "{err}");
}

#[test]
fn fields_that_change_the_model_and_are_not_built_are_refused_by_name() {
    for (extra, field) in [
        (r#""router_jitter_noise": 0.1"#, "router_jitter_noise"),
        (r#""num_experts_per_tok": 9"#, "num_experts_per_tok"),
        (r#""num_local_experts": 300"#, "num_local_experts"),
    ] {
        let err = parse(&format!(
            "{{{MIXTRAL}, \"num_key_value_heads\": 2, {extra}}}"
        ))
        .unwrap_err();
        assert!(err.contains(field), "{extra}: {err}");
    }
    for (extra, field) in [
        (r#""use_sliding_window": true"#, "use_sliding_window"),
        (
            r#""shared_expert_intermediate_size": 64"#,
            "shared_expert_intermediate_size",
        ),
    ] {
        let err = parse(&format!("{{{QWEN3_MOE}, {extra}}}")).unwrap_err();
        assert!(err.contains(field), "{extra}: {err}");
    }
}

#[test]
fn a_sparse_layer_routes_dispatches_runs_grouped_experts_and_combines() {
    let config = parse(&format!(
        r#"{{{MIXTRAL}, "num_key_value_heads": 2, "num_local_experts": 4}}"#
    ))
    .unwrap();
    let graph = build_forward(&config, &BuildOptions::new(2, 8).with_dtype(DType::F32)).unwrap();
    let kinds: Vec<&OpKind> = graph.ops().map(|(_, op)| &op.kind).collect();
    let count = |f: fn(&OpKind) -> bool| kinds.iter().filter(|k| f(k)).count();
    assert_eq!(count(|k| matches!(k, OpKind::MoeRoute { .. })), 2);
    assert_eq!(
        count(|k| matches!(k, OpKind::GroupedLinear { experts: 4 })),
        6
    );
    assert_eq!(count(|k| matches!(k, OpKind::MoeCombine { top_k: 2 })), 2);
    // Every expert's weight is a parameter of its own, with the Hub's name.
    let names: Vec<&str> = graph.params().map(|(_, p)| p.name.as_str()).collect();
    assert!(names.contains(&"model.layers.1.block_sparse_moe.experts.3.w2.weight"));
    assert!(names.contains(&"model.layers.0.block_sparse_moe.gate.weight"));
    // The packed buffer holds B*T*k rows whatever the routing.
    let (_, dispatch) = graph
        .ops()
        .find(|(_, op)| matches!(op.kind, OpKind::MoeDispatch { .. }))
        .unwrap();
    assert_eq!(graph.value(dispatch.outputs[0]).ty.shape, [2 * 8 * 2, 32]);
}

#[test]
fn output_router_logits_adds_the_load_balancing_loss_over_the_sparse_layers() {
    // Layer 1 is dense (`mlp_only_layers`): the loss reads the other two layers' logits.
    let config = parse(&format!(
        r#"{{{QWEN3_MOE}, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "mlp_only_layers": [1], "num_experts": 8, "num_experts_per_tok": 2,
            "output_router_logits": true, "router_aux_loss_coef": 0.25}}"#
    ))
    .unwrap();
    let Architecture::Qwen3Moe(arch) = &config.architecture else {
        panic!("not qwen3_moe")
    };
    assert_eq!(arch.moe.aux_loss_coef, Some(0.25));
    let graph = build_forward(&config, &BuildOptions::new(2, 8).with_dtype(DType::F32)).unwrap();
    let &loss = graph.outputs().first().unwrap();
    let op = graph.op(graph.value(loss).producer.unwrap());
    assert_eq!(
        op.kind,
        OpKind::MoeAuxLoss {
            experts: 8,
            top_k: 2,
            layers: 2,
            coef: 0.25
        }
    );
    let names: Vec<&str> = op
        .inputs
        .iter()
        .map(|&v| graph.value(v).name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "cross_entropy",
            "layers.0.mlp.router",
            "layers.2.mlp.router"
        ]
    );
    // transformers' default weight, and no loss without `output_router_logits`.
    let config = parse(&format!(
        r#"{{{MIXTRAL}, "num_key_value_heads": 2, "output_router_logits": true}}"#
    ))
    .unwrap();
    let Architecture::Mixtral(arch) = &config.architecture else {
        panic!("not mixtral")
    };
    assert_eq!(arch.moe.aux_loss_coef, Some(0.001));
    let plain = parse(&format!("{{{MIXTRAL}, \"num_key_value_heads\": 2}}")).unwrap();
    let graph = build_forward(&plain, &BuildOptions::new(1, 4).with_dtype(DType::F32)).unwrap();
    assert!(graph
        .ops()
        .all(|(_, op)| !matches!(op.kind, OpKind::MoeAuxLoss { .. })));
}
