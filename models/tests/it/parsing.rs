//! How configs parse: transformers' defaults, v4 and v5 RoPE formats, presets, spec resolution.

use protrain_ir::RopeScaling;
use protrain_models::{
    load, presets, Architecture, ConfigSource, LlamaLayout, ModelConfig, OptLayout, QkNorm,
};

const MODELS: &str = env!("CARGO_MANIFEST_DIR");

fn parse(json: &str) -> ModelConfig {
    ModelConfig::from_json(json, ConfigSource::Text("test".into()))
        .unwrap_or_else(|e| panic!("{json}: {e}"))
}

/// Checks that two config texts mean the same model.
fn check_same(a: &str, b: &str) {
    assert_eq!(parse(a), parse(b), "\n{a}\n{b}");
}

fn llama_layout(config: &ModelConfig) -> &LlamaLayout {
    match &config.architecture {
        Architecture::Llama(layout)
        | Architecture::Mistral(layout)
        | Architecture::Qwen2(layout)
        | Architecture::Qwen3(layout)
        | Architecture::Olmo2(layout) => layout,
        Architecture::Mixtral(arch) | Architecture::Qwen3Moe(arch) => &arch.layout,
        other => panic!("not a rotary model: {other:?}"),
    }
}

const LLAMA: &str = r#""model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 131072"#;

#[test]
fn v4_and_v5_rope_settings_parse_alike() {
    check_same(
        &format!(r#"{{{LLAMA}, "rope_theta": 500000.0, "rope_scaling": null}}"#),
        &format!(
            r#"{{{LLAMA}, "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ),
    );
    check_same(
        &format!(r#"{{{LLAMA}}}"#),
        &format!(
            r#"{{{LLAMA}, "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0}}}}"#
        ),
    );
    // v4's old key `type`, and `rope_theta` beside the scaling dict.
    check_same(
        &format!(
            r#"{{{LLAMA}, "rope_theta": 1e6, "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#
        ),
        &format!(
            r#"{{{LLAMA}, "rope_parameters": {{"rope_type": "linear", "factor": 2, "rope_theta": 1000000}}}}"#
        ),
    );
    // A rope_theta inside the dict wins over a top-level one, as transformers' setdefault has it.
    check_same(
        &format!(
            r#"{{{LLAMA}, "rope_theta": 1.0, "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ),
        &format!(r#"{{{LLAMA}, "rope_theta": 500000.0}}"#),
    );
}

#[test]
fn llama3_rope_scaling_parses() {
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let v4 = format!(
        r#"{{{LLAMA}, "rope_theta": 500000.0, "rope_scaling": {{"factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}}}"#
    );
    let v5 = format!(
        r#"{{{LLAMA}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
    );
    check_same(&v4, &v5);
    let config = parse(&v5);
    assert_eq!(llama_layout(&config).rope_scaling, llama3);
    assert_eq!(llama_layout(&config).rope_theta, 500000.0);
    // Without original_max_position_embeddings, transformers uses max_position_embeddings.
    let config = parse(&format!(
        r#"{{{LLAMA}, "rope_scaling": {{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}}}}"#
    ));
    assert!(matches!(
        llama_layout(&config).rope_scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 131072,
            ..
        }
    ));
    // The rope op carries it into the graph.
    let graph =
        protrain_models::build_forward(&parse(&v4), &protrain_models::BuildOptions::new(1, 8))
            .unwrap();
    assert!(graph
        .to_text()
        .contains("rope[head_dim=16, theta=500000, scaling=llama3(8,1,4,8192)]"));
}

#[test]
fn transformers_defaults_apply() {
    let gpt2 = parse(
        r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": null}"#,
    );
    assert_eq!(
        (gpt2.intermediate_size, gpt2.head_dim, gpt2.num_kv_heads),
        (256, 16, 4)
    );
    assert_eq!(
        (gpt2.norm_eps, gpt2.tie_word_embeddings, gpt2.padding_idx),
        (1e-5, true, None)
    );
    // GPT2Config's attribute_map names.
    check_same(
        r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}"#,
        r#"{"model_type": "gpt2", "vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}"#,
    );

    let llama = parse(&format!(r#"{{{LLAMA}}}"#));
    assert_eq!(
        (llama.num_kv_heads, llama.head_dim, llama.norm_eps),
        (4, 16, 1e-6)
    );
    assert!(!llama.tie_word_embeddings);
    let layout = llama_layout(&llama);
    assert_eq!(
        (
            layout.attention_bias,
            layout.mlp_bias,
            layout.sliding_window
        ),
        (false, false, None)
    );
    assert_eq!(llama.padding_idx, None);

    let mistral = |extra: &str| {
        parse(&format!(
            r#"{{"model_type": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 16{extra}}}"#
        ))
    };
    // Absent: MistralConfig's defaults; null: none and "as many as the heads".
    let absent = mistral("");
    assert_eq!(
        (absent.num_kv_heads, llama_layout(&absent).sliding_window),
        (8, Some(4096))
    );
    assert_eq!(absent.max_position_embeddings, 131072);
    let null = mistral(r#", "num_key_value_heads": null, "sliding_window": null"#);
    assert_eq!(
        (null.num_kv_heads, llama_layout(&null).sliding_window),
        (16, None)
    );
    let explicit = mistral(r#", "num_key_value_heads": 2, "sliding_window": 6, "head_dim": 8"#);
    assert_eq!(
        (
            explicit.num_kv_heads,
            explicit.head_dim,
            llama_layout(&explicit).sliding_window
        ),
        (2, 8, Some(6))
    );

    let opt = |extra: &str| {
        parse(&format!(
            r#"{{"model_type": "opt", "vocab_size": 256, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 64{extra}}}"#
        ))
    };
    let pre = opt("");
    let layout = OptLayout {
        word_embed_proj_dim: 64,
        do_layer_norm_before: true,
        final_layer_norm: true,
        enable_bias: true,
    };
    assert_eq!(pre.architecture, Architecture::Opt(layout.clone()));
    assert_eq!(
        (pre.padding_idx, pre.tie_word_embeddings, pre.norm_eps),
        (Some(1), true, 1e-5)
    );
    let post =
        opt(r#", "do_layer_norm_before": false, "word_embed_proj_dim": 32, "pad_token_id": null"#);
    let post_layout = OptLayout {
        word_embed_proj_dim: 32,
        do_layer_norm_before: false,
        final_layer_norm: false,
        ..layout
    };
    assert_eq!(post.architecture, Architecture::Opt(post_layout));
    assert_eq!(post.padding_idx, None);
}

#[test]
fn specs_resolve_to_presets_files_and_directories() {
    let fixture = format!("{MODELS}/../tests/fixtures/llama");
    let from_dir = load(&fixture).unwrap();
    let from_file = load(&format!("{fixture}/config.json")).unwrap();
    assert_eq!(from_dir.architecture, from_file.architecture);
    assert_eq!(from_file.name, format!("{fixture}/config.json"));
    // transformers 5 wrote it: rope_parameters, 2 KV heads.
    assert_eq!(
        (from_dir.num_kv_heads, llama_layout(&from_dir).rope_theta),
        (2, 10000.0)
    );
    assert_eq!(load("llama-tiny").unwrap().name, "llama-tiny");
    let file = format!("{MODELS}/tests/configs/opt-350m.json");
    assert_eq!(load(&file).unwrap().model_type(), "opt");
}

#[test]
fn presets_are_listed_in_a_stable_order() {
    let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        [
            "gpt2",
            "gpt2-medium",
            "gpt2-large",
            "gpt2-xl",
            "gpt3-175b",
            "llama-2-7b",
            "llama-2-13b",
            "llama-2-70b",
            "llama-3-8b",
            "mistral-7b",
            "qwen2.5-7b",
            "qwen3-8b",
            "mixtral-8x7b",
            "qwen3-30b-a3b",
            "olmo2-1b",
            "opt-1.3b",
            "opt-13b",
            "opt-30b",
            "gemma-2-2b",
            "gemma-2-9b",
            "gemma-3-1b",
            "gemma-3-4b",
            "phi-3-mini",
            "phi-3-mini-128k",
            "gpt2-tiny",
            "llama-tiny",
            "mistral-tiny",
            "opt-tiny",
        ]
    );
    for preset in presets() {
        let config = preset.config().unwrap();
        assert_eq!(config.name, preset.name);
        assert!(
            !preset.description.is_empty() && !preset.description.contains('\n'),
            "{}",
            preset.name
        );
        // GPT-3 has no transformers model type of its own: its shape is built as GPT-2's.
        // Gemma's presets are named as Google names them (`gemma-2-9b`), its types `gemma2`
        // and `gemma3_text`, Phi-3's as Microsoft names them (`phi-3-mini`), its type `phi3`, and
        // Qwen3's mixture of experts as Qwen names it (`qwen3-30b-a3b`), its type `qwen3_moe`.
        let family = match preset.name {
            n if n.starts_with("gpt3-") => "gpt2",
            n if n.starts_with("phi-3-") => "phi3",
            n if n.starts_with("gemma-2-") => "gemma2",
            n if n.starts_with("gemma-3-") => "gemma3_text",
            n if n.starts_with("qwen3-30b-a3b") => "qwen3_moe",
            n => n,
        };
        assert!(family.starts_with(config.model_type()), "{}", preset.name);
    }
}

#[test]
fn tiny_presets_fit_the_synthetic_corpus() {
    for name in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
        let c = load(name).unwrap();
        let dims = (
            c.hidden_size,
            c.num_layers,
            c.vocab_size,
            c.max_position_embeddings,
        );
        assert_eq!(dims, (64, 2, 256, 256), "{name}");
    }
    let llama = load("llama-tiny").unwrap();
    assert!(llama.num_kv_heads < llama.num_heads, "grouped KV heads");
    let mistral = load("mistral-tiny").unwrap();
    assert!(
        llama_layout(&mistral)
            .sliding_window
            .is_some_and(|w| w < 16),
        "window shorter than seq 16"
    );
    let llama_70b = load("llama-2-70b").unwrap();
    let dims = (
        llama_70b.num_layers,
        llama_70b.hidden_size,
        llama_70b.num_kv_heads,
        llama_70b.intermediate_size,
    );
    assert_eq!(dims, (80, 8192, 8, 28672));
    let llama_3 = load("llama-3-8b").unwrap();
    assert_eq!(
        (
            llama_3.vocab_size,
            llama_3.num_kv_heads,
            llama_3.intermediate_size
        ),
        (128256, 8, 14336)
    );
    assert_eq!(llama_layout(&llama_3).rope_theta, 500000.0);
    assert_eq!(
        llama_layout(&load("mistral-7b").unwrap()).sliding_window,
        Some(4096)
    );
}

const QWEN: &str = r#""vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 4"#;

#[test]
fn qwen_windows_sit_on_the_layers_transformers_gives_them() {
    let qwen2 = |extra: &str| {
        parse(&format!(
            r#"{{"model_type": "qwen2", {QWEN}, "num_attention_heads": 32, "head_dim": 8{extra}}}"#
        ))
    };
    // No window unless `use_sliding_window`, whatever `sliding_window` says.
    let off = qwen2(r#", "sliding_window": 3"#);
    let layout = llama_layout(&off);
    assert_eq!(
        (0..4).map(|i| layout.window_of(i)).collect::<Vec<_>>(),
        [None; 4]
    );
    // With it: the layers at or above `max_window_layers`.
    let on = qwen2(r#", "use_sliding_window": true, "sliding_window": 3, "max_window_layers": 1"#);
    let windows: Vec<_> = (0..4).map(|i| llama_layout(&on).window_of(i)).collect();
    assert_eq!(windows, [None, Some(3), Some(3), Some(3)]);
    // An explicit `layer_types` says the same.
    check_same(
        &format!(
            r#"{{"model_type": "qwen2", {QWEN}, "num_attention_heads": 4, "num_key_value_heads": 2,
            "use_sliding_window": true, "sliding_window": 3, "max_window_layers": 1}}"#
        ),
        &format!(
            r#"{{"model_type": "qwen2", {QWEN}, "num_attention_heads": 4, "num_key_value_heads": 2,
            "use_sliding_window": true, "sliding_window": 3, "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
            "sliding_attention"]}}"#
        ),
    );
    // transformers' defaults: the window 4096 above layer 28, 32 KV heads when absent.
    let defaults = qwen2(r#", "use_sliding_window": true"#);
    assert_eq!(llama_layout(&defaults).sliding_window, Some(4096));
    assert_eq!(llama_layout(&defaults).full_attention_layers, 4);
    assert_eq!(defaults.num_kv_heads, 32);
}

#[test]
fn each_rotary_family_has_its_own_biases_norms_and_defaults() {
    let family = |t: &str, extra: &str| {
        parse(&format!(
            r#"{{"model_type": "{t}", {QWEN}, "num_attention_heads": 4,
            "num_key_value_heads": 4{extra}}}"#
        ))
    };
    let qwen2 = family("qwen2", r#", "attention_bias": true"#);
    let l = llama_layout(&qwen2);
    // Qwen2 has q/k/v biases and no o_proj bias whatever `attention_bias` says.
    assert!(l.qkv_bias && !l.attention_bias && l.qk_norm == QkNorm::None && !l.post_norm);
    let qwen3 = family("qwen3", r#", "attention_bias": true"#);
    let l = llama_layout(&qwen3);
    assert!(!l.qkv_bias && l.attention_bias && l.qk_norm == QkNorm::PerHead && !l.post_norm);
    // Qwen3Config's head_dim defaults to 128, not hidden / heads.
    assert_eq!(qwen3.head_dim, 128);
    let olmo2 = family("olmo2", "");
    let l = llama_layout(&olmo2);
    assert!(!l.qkv_bias && l.qk_norm == QkNorm::Whole && l.post_norm);
    assert_eq!(
        (olmo2.head_dim, olmo2.num_kv_heads, olmo2.norm_eps),
        (8, 4, 1e-5)
    );
    // OLMo2Config's pad_token_id defaults to 1.
    assert_eq!(olmo2.padding_idx, Some(1));
    assert_eq!(qwen2.padding_idx, None);
}

mod gemma {
    use super::*;

    const GEMMA3: &str = r#""model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4"#;

    fn layout(config: &ModelConfig) -> &protrain_models::GemmaLayout {
        match &config.architecture {
            Architecture::Gemma2(l) | Architecture::Gemma3(l) => l,
            other => panic!("not Gemma: {other:?}"),
        }
    }

    /// transformers' defaults: Gemma 2's soft-caps 50 and 30 and every second layer global;
    /// Gemma 3's none, five sliding layers to one global, RoPE 1e6 global and 1e4 local, and
    /// `rope_scaling` on the global layers only.
    #[test]
    fn defaults_follow_transformers() {
        let g2 = load("gemma-2-2b").unwrap();
        let l = layout(&g2);
        assert_eq!(
            (l.attn_logit_softcapping, l.final_logit_softcapping),
            (Some(50.0), Some(30.0))
        );
        assert_eq!((g2.padding_idx, g2.tie_word_embeddings), (Some(0), true));
        assert_eq!(l.window(0), Some(4096));
        assert_eq!(l.window(1), None);
        let g3 = parse(&format!(
            r#"{{{GEMMA3}, "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#
        ));
        let l = layout(&g3);
        assert_eq!(
            (l.attn_logit_softcapping, l.final_logit_softcapping),
            (None, None)
        );
        let globals: Vec<usize> = (0..12).filter(|&i| l.window(i).is_none()).collect();
        assert_eq!(globals, [5, 11]);
        assert_eq!(l.rope(5).theta, 1e6);
        assert_eq!(l.rope(5).scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(
            (l.rope(0).theta, l.rope(0).scaling.clone()),
            (1e4, RopeScaling::None)
        );
        // v5's per-layer-type `rope_parameters` mean the same model.
        check_same(
            &format!(r#"{{{GEMMA3}, "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#),
            &format!(
                r#"{{{GEMMA3}, "rope_parameters": {{
                    "full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
                    "sliding_attention": {{"rope_type": "default", "rope_theta": 1e4}}}}}}"#
            ),
        );
        // `sliding_window_pattern` sets the layer types when they are not given.
        let g3 = parse(&format!(r#"{{{GEMMA3}, "sliding_window_pattern": 3}}"#));
        let globals: Vec<usize> = (0..12)
            .filter(|&i| layout(&g3).window(i).is_none())
            .collect();
        assert_eq!(globals, [2, 5, 8, 11]);
    }

    /// YaRN on Gemma 3's global layers as transformers reads it: the original length from the
    /// settings, else `max_position_embeddings` (131072 by default); `truncate` always true
    /// (transformers reads it from the top level of `rope_parameters`, which Gemma 3 nests by
    /// layer type, so a `truncate` inside the global settings is never seen); the local layers
    /// unscaled. Gemma 2's flat settings keep their `truncate`.
    #[test]
    fn yarn_on_global_layers_reads_as_transformers_reads_it() {
        let g3 = parse(&format!(
            r#"{{{GEMMA3}, "rope_scaling": {{"rope_type": "yarn", "factor": 8.0,
                "truncate": false}}}}"#
        ));
        let want = RopeScaling::Yarn {
            factor: 8.0,
            original_max_position_embeddings: 131072,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 0.1 * 8f64.ln() + 1.0,
        };
        assert_eq!(layout(&g3).rope(5).scaling, want);
        assert_eq!(layout(&g3).rope(0).scaling, RopeScaling::None);
        check_same(
            &format!(r#"{{{GEMMA3}, "rope_scaling": {{"rope_type": "yarn", "factor": 8.0}}}}"#),
            &format!(
                r#"{{{GEMMA3}, "rope_parameters": {{
                    "full_attention": {{"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                        "original_max_position_embeddings": 131072, "truncate": false}},
                    "sliding_attention": {{"rope_type": "default", "rope_theta": 1e4}}}}}}"#
            ),
        );
        let g2 = parse(
            r#"{"model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                    "original_max_position_embeddings": 4096, "truncate": false}}"#,
        );
        match &layout(&g2).rope(1).scaling {
            RopeScaling::Yarn {
                truncate,
                original_max_position_embeddings,
                ..
            } => assert_eq!(
                (*truncate, *original_max_position_embeddings),
                (false, 4096)
            ),
            other => panic!("{other:?}"),
        }
    }

    /// `info` lists the soft-caps, windows, norms and RoPE, so configs that differ in them
    /// read differently.
    #[test]
    fn info_shows_what_makes_a_gemma() {
        let features = |json: &str| parse(json).info().unwrap().features;
        let base = format!(r#"{GEMMA3}, "layer_types": null"#);
        let plain = features(&format!("{{{base}}}"));
        assert!(
            plain.iter().any(|l| l == "attention soft-cap: none"),
            "{plain:?}"
        );
        assert!(
            plain
                .iter()
                .any(|l| l == "windows: 4096 tokens on 10 of 12 layers; global layers 5, 11"),
            "{plain:?}"
        );
        assert!(
            plain.iter().any(|l| l.starts_with("q/k norms")),
            "{plain:?}"
        );
        for variant in [
            r#""final_logit_softcapping": 30.0"#,
            r#""sliding_window": 512"#,
            r#""sliding_window_pattern": 2"#,
            r#""rope_local_base_freq": 5000"#,
            r#""query_pre_attn_scalar": 144"#,
            r#""tie_word_embeddings": false"#,
        ] {
            let other = features(&format!("{{{base}, {variant}}}"));
            assert_ne!(other, plain, "{variant} is not seen in info");
        }
        let g2 = load("gemma-2-9b").unwrap().info().unwrap().features;
        assert!(
            g2.iter().any(|l| l.starts_with("attention soft-cap: 50")),
            "{g2:?}"
        );
        assert!(!g2.iter().any(|l| l.starts_with("q/k norms")), "{g2:?}");
    }
}

/// YaRN as `_compute_yarn_parameters` reads it: the factor given or derived, the original
/// context from the top level, the dict or the positions, betas 32 and 1 when absent or 0, the
/// attention factor given, from `mscale` and `mscale_all_dim`, or `0.1 ln(factor) + 1`.
#[test]
fn yarn_reads_as_transformers_reads_it() {
    let scaling = |json: &str| llama_layout(&parse(json)).rope_scaling.clone();
    let qwen = r#""model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 131072"#;
    let v4 = scaling(&format!(
        r#"{{{qwen}, "rope_scaling": {{"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}}}}"#
    ));
    assert_eq!(
        v4,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
        }
    );
    let v5 = scaling(&format!(
        r#"{{{qwen}, "rope_parameters": {{"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768, "beta_fast": 0, "rope_theta": 1e4}}}}"#
    ));
    assert_eq!(v4, v5);
    // No factor: max_position_embeddings / original; the given attention factor wins.
    match scaling(&format!(
        r#"{{{qwen}, "original_max_position_embeddings": 4096, "rope_scaling": {{"type": "yarn",
            "attention_factor": 1.5, "beta_fast": 16, "truncate": false}}}}"#
    )) {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            truncate,
            attention_factor,
            ..
        } => assert_eq!(
            (
                factor,
                original_max_position_embeddings,
                beta_fast,
                truncate,
                attention_factor
            ),
            (32.0, 4096, 16.0, false, 1.5)
        ),
        other => panic!("{other:?}"),
    }
    // DeepSeek's mscale pair: mscale(f, m) / mscale(f, m_all).
    let RopeScaling::Yarn {
        attention_factor, ..
    } = scaling(&format!(
        r#"{{{qwen}, "rope_scaling": {{"type": "yarn", "factor": 40.0,
            "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5}}}}"#
    ))
    else {
        panic!("yarn")
    };
    let m = |s: f64, k: f64| 0.1 * k * s.ln() + 1.0;
    assert_eq!(attention_factor, m(40.0, 1.0) / m(40.0, 0.5));
    // Other types are refused by name, with what is supported.
    let err = ModelConfig::from_json(
        &format!(r#"{{{qwen}, "rope_scaling": {{"type": "dynamic", "factor": 2.0}}}}"#),
        ConfigSource::Text("test".into()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rope_scaling.rope_type 'dynamic' is not supported for qwen2")
            && err.contains("default, linear, llama3, yarn"),
        "{err}"
    );
}
