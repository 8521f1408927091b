//! Phi-3's config as transformers reads it (LongRoPE, partial rotary, windows), what it refuses,
//! what `info` shows, and the graph its builder makes.

use protrain_ir::{OpKind, QkvLayout, RopeScaling};
use protrain_models::{
    build_forward, load, Architecture, BuildOptions, ConfigSource, ModelConfig, ModelError,
    Phi3Layout,
};

const MODELS: &str = env!("CARGO_MANIFEST_DIR");

/// A small Phi-3: head_dim 8, 4 heads over 2 KV heads.
const PHI3: &str = r#""model_type": "phi3", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
    "original_max_position_embeddings": 16"#;

fn parse(json: &str) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json(json, ConfigSource::Text("test".into()))
}

fn layout(config: &ModelConfig) -> &Phi3Layout {
    match &config.architecture {
        Architecture::Phi3(layout) => layout,
        other => panic!("not Phi-3: {other:?}"),
    }
}

fn phi3(extra: &str) -> ModelConfig {
    let json = format!("{{{PHI3}{extra}}}");
    parse(&json).unwrap_or_else(|e| panic!("{json}: {e}"))
}

#[test]
fn phi3_mini_128k_uses_its_short_factors_up_to_4096_tokens_and_its_long_ones_beyond() {
    let config = load(&format!("{MODELS}/tests/real-configs/phi-3-mini-128k.json")).unwrap();
    let l = layout(&config);
    let longrope = l.longrope.as_ref().expect("type su is longrope");
    assert_eq!(
        (l.rotary_dim, longrope.original_max_position_embeddings),
        (96, 4096)
    );
    // transformers: factor = 131072 / 4096 = 32, sqrt(1 + ln 32 / ln 4096) = sqrt(17 / 12).
    assert!((longrope.attention_factor - (17.0f64 / 12.0).sqrt()).abs() < 1e-15);
    let factors = |seq| match l.rope_scaling(seq) {
        RopeScaling::LongRope {
            factors,
            attention_factor,
        } => {
            assert_eq!(attention_factor, longrope.attention_factor);
            factors
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(factors(4096), longrope.short_factor);
    assert_eq!(factors(4097), longrope.long_factor);
    assert_eq!(
        (factors(1)[0], factors(8192)[0]),
        (1.05, 1.0299999713897705)
    );
    // The 4k model has no scaling, and a 2047-token window on every layer.
    let four_k = load("phi-3-mini").unwrap();
    let l = layout(&four_k);
    assert_eq!(
        (&l.longrope, l.sliding_window, l.rotary_dim),
        (&None, Some(2047), 96)
    );
    assert_eq!(l.rope_scaling(100_000), RopeScaling::None);
}

#[test]
fn longrope_reads_as_phi3config_reads_it() {
    let factors = r#""short_factor": [1.0, 2.0, 3.0, 4.0], "long_factor": [5.0, 6.0, 7.0, 8.0]"#;
    // v4's rope_scaling with `type` su or yarn, and v5's rope_parameters, are one model.
    let v5 = phi3(&format!(
        r#", "rope_parameters": {{"rope_type": "longrope", "rope_theta": 10000.0, {factors}}}"#
    ));
    for kind in ["su", "yarn", "longrope"] {
        let v4 = phi3(&format!(
            r#", "rope_theta": 10000.0, "rope_scaling": {{"type": "{kind}", {factors}}}"#
        ));
        assert_eq!(v4.architecture, v5.architecture, "{kind}");
    }
    // 64 / 16 positions: factor 4; the dict's factor and attention_factor win.
    let attention = |c: &ModelConfig| layout(c).longrope.as_ref().unwrap().attention_factor;
    assert!((attention(&v5) - (1.0 + 4f64.ln() / 16f64.ln()).sqrt()).abs() < 1e-15);
    let given = phi3(&format!(
        r#", "rope_scaling": {{"type": "longrope", "factor": 2.0, {factors}}}"#
    ));
    assert!((attention(&given) - (1.0 + 2f64.ln() / 16f64.ln()).sqrt()).abs() < 1e-15);
    let given = phi3(&format!(
        r#", "rope_scaling": {{"type": "longrope", "attention_factor": 1.5, {factors}}}"#
    ));
    assert_eq!(attention(&given), 1.5);
    // Partial rotary: half of each head, so two factors per list.
    let partial = phi3(
        r#", "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 2], "long_factor": [3, 4]}"#,
    );
    assert_eq!(layout(&partial).rotary_dim, 4);
    // Defaults: no window, pad row 32000 only when the vocabulary has one, untied.
    let plain = phi3("");
    assert_eq!(
        (
            layout(&plain).sliding_window,
            plain.padding_idx,
            plain.tie_word_embeddings,
            plain.norm_eps
        ),
        (None, None, false, 1e-5)
    );
}

#[test]
fn phi3_refuses_what_it_does_not_build_by_name() {
    let err = |extra: &str| {
        parse(&format!("{{{PHI3}{extra}}}"))
            .expect_err(extra)
            .to_string()
    };
    let e = err(r#", "rope_scaling": {"type": "dynamic", "factor": 2.0}"#);
    assert!(
        e.contains("rope_scaling.rope_type 'dynamic' is not supported for phi3"),
        "{e}"
    );
    let e = err(
        r#", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1, 2, 3, 4]}"#,
    );
    assert!(
        e.contains("rope_scaling.short_factor") && e.contains("a list of 4 positive numbers"),
        "{e}"
    );
    let e = err(r#", "rope_scaling": {"type": "longrope", "short_factor": [1, 2, 3, 4]}"#);
    assert!(e.contains("rope_scaling.long_factor"), "{e}");
    let e = err(r#", "partial_rotary_factor": 0.1"#);
    assert!(
        e.contains("partial_rotary_factor") && e.contains("= 0"),
        "{e}"
    );
    let e = err(r#", "hidden_act": "gelu""#);
    assert!(e.contains("hidden_act 'gelu'"), "{e}");
}

#[test]
fn info_shows_what_makes_a_phi3() {
    let features = |extra: &str| phi3(extra).info().unwrap().features;
    let plain = features("");
    assert!(
        plain
            .iter()
            .any(|l| l.starts_with("projections: fused qkv_proj")),
        "{plain:?}"
    );
    for variant in [
        r#", "sliding_window": 8"#,
        r#", "partial_rotary_factor": 0.5"#,
        r#", "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2]}"#,
        r#", "rope_theta": 5000"#,
        r#", "tie_word_embeddings": true"#,
    ] {
        assert_ne!(features(variant), plain, "{variant} is not seen in info");
    }
}

#[test]
fn phi3_rotates_q_and_k_inside_the_packed_projection_and_splits_gate_up() {
    let config = phi3(
        r#", "partial_rotary_factor": 0.5, "sliding_window": 5,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 2], "long_factor": [3, 4]}"#,
    );
    for (seq, factors) in [(16, vec![1.0, 2.0]), (17, vec![3.0, 4.0])] {
        let graph = build_forward(&config, &BuildOptions::new(1, seq)).unwrap();
        let kinds: Vec<&OpKind> = graph.ops().map(|(_, op)| &op.kind).collect();
        let attention_factor = (1.0f64 + 4f64.ln() / 16f64.ln()).sqrt();
        let rope = OpKind::PartialRope {
            head_dim: 8,
            rotary_dim: 4,
            heads: 6,
            theta: 10000.0,
            scaling: RopeScaling::LongRope {
                factors,
                attention_factor,
            },
        };
        assert_eq!(kinds.iter().filter(|k| ***k == rope).count(), 2, "{seq}");
        assert_eq!(
            kinds
                .iter()
                .filter(|k| matches!(k, OpKind::PackedSwiglu))
                .count(),
            2
        );
        assert!(kinds.iter().any(|k| matches!(
            k,
            OpKind::Attention {
                qkv: QkvLayout::Packed,
                window: Some(5),
                heads: 4,
                kv_heads: 2,
                ..
            }
        )));
    }
}
