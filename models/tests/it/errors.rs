//! Every error a user can cause, with the exact text they read.

use protrain_ir::DType;
use protrain_models::{build_forward, load, BuildOptions, ConfigSource, ModelConfig};

const MODELS: &str = env!("CARGO_MANIFEST_DIR");

/// Parses `json` as a file named `config.json` and checks the error's text.
fn check(json: &str, expected: &str) {
    match ModelConfig::from_json(json, ConfigSource::File("config.json".into())) {
        Ok(config) => panic!("{json} parsed: {config:?}"),
        Err(e) => assert_eq!(e.to_string(), expected, "{json}"),
    }
}

/// Loads `spec` and checks the error's text.
fn check_load(spec: &str, expected: &str) {
    match load(spec) {
        Ok(config) => panic!("{spec} loaded: {config:?}"),
        Err(e) => assert_eq!(e.to_string(), expected, "{spec}"),
    }
}

/// Builds preset `name` at `options` and checks the error's text.
fn check_build(name: &str, options: BuildOptions, expected: &str) {
    let config = load(name).unwrap();
    match build_forward(&config, &options) {
        Ok(_) => panic!("{name} built at {options:?}"),
        Err(e) => assert_eq!(e.to_string(), expected, "{name} {options:?}"),
    }
}

const GPT2: &str = r#""model_type": "gpt2", "vocab_size": 256, "n_positions": 64"#;
const LLAMA: &str =
    r#""model_type": "llama", "vocab_size": 256, "intermediate_size": 128, "num_hidden_layers": 2"#;

#[test]
fn unknown_preset_suggests_the_closest() {
    check_load(
        "lama-2-7b",
        "unknown model 'lama-2-7b'; did you mean 'llama-2-7b'? `protrain models` lists the presets, \
         or give a path to a config.json",
    );
    for (typo, preset) in [
        ("gpt2-mediun", "gpt2-medium"),
        ("mistral7b", "mistral-7b"),
        ("opt-1.3", "opt-1.3b"),
    ] {
        check_load(
            typo,
            &format!(
                "unknown model '{typo}'; did you mean '{preset}'? `protrain models` lists the presets, or give a \
                 path to a config.json"
            ),
        );
    }
    check_load(
        "bert-base-uncased",
        "unknown model 'bert-base-uncased'; `protrain models` lists the presets, or give a path to a config.json",
    );
}

#[test]
fn missing_files_and_directories() {
    check_load(
        "no/such/config.json",
        "config file no/such/config.json does not exist",
    );
    check_load(
        "no-such-config.json",
        "config file no-such-config.json does not exist",
    );
    let dir = format!("{MODELS}/tests/it/snapshots");
    check_load(
        &dir,
        &format!("directory {dir} holds no config.json; give the path of a Hugging Face config.json or a preset name"),
    );
}

#[test]
fn invalid_json_says_where() {
    let file = format!("{MODELS}/tests/bad-configs/missing-comma.json");
    check_load(
        &file,
        &format!("{file}: invalid JSON at line 5, column 3: expected `,` or `}}`"),
    );
    let file = format!("{MODELS}/tests/bad-configs/truncated.json");
    check_load(
        &file,
        &format!("{file}: invalid JSON at line 1, column 43: EOF while parsing an object"),
    );
    check(
        "",
        "config.json: invalid JSON at line 1, column 0: EOF while parsing a value",
    );
    check(
        "[1, 2]",
        "config.json: a config must be a JSON object, found an array",
    );
}

#[test]
fn model_type_must_be_known() {
    check(
        r#"{"n_embd": 768}"#,
        "config.json: missing required field `model_type`; supported: gemma2, gemma3_text, gpt2, llama, mistral, mixtral, olmo2, opt, phi3, qwen2, qwen3, qwen3_moe",
    );
    check(
        r#"{"model_type": "bert"}"#,
        "config.json: unknown model_type 'bert'; supported: gemma2, gemma3_text, gpt2, llama, mistral, mixtral, olmo2, opt, phi3, qwen2, qwen3, qwen3_moe",
    );
    check(
        r#"{"model_type": 2}"#,
        "config.json: field `model_type` must be a string, found 2",
    );
}

#[test]
fn missing_and_invalid_fields_are_named() {
    check(
        &format!(r#"{{{GPT2}, "n_layer": 2, "n_head": 4}}"#),
        "config.json: missing required field `n_embd`, which model_type 'gpt2' needs",
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": null, "num_attention_heads": 4}}"#),
        "config.json: missing required field `hidden_size`, which model_type 'llama' needs",
    );
    check(
        r#"{"model_type": "opt", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}"#,
        "config.json: missing required field `ffn_dim`, which model_type 'opt' needs",
    );
    check(
        &format!(r#"{{{GPT2}, "n_embd": 64, "n_layer": 2, "n_head": "four"}}"#),
        r#"config.json: field `n_head` must be an integer from 1 to 16777216, found "four""#,
    );
    check(
        &format!(r#"{{{GPT2}, "n_embd": 64, "n_layer": 0, "n_head": 4}}"#),
        "config.json: field `n_layer` must be an integer from 1 to 65536, found 0",
    );
    check(
        &format!(r#"{{{GPT2}, "n_embd": 64.0, "n_layer": 2, "n_head": 4}}"#),
        "config.json: field `n_embd` must be an integer from 1 to 16777216, found 64.0",
    );
    check(
        &format!(
            r#"{{{GPT2}, "n_embd": 64, "n_layer": 2, "n_head": 4, "tie_word_embeddings": "yes"}}"#
        ),
        r#"config.json: field `tie_word_embeddings` must be true or false, found "yes""#,
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": -1}}"#),
        "config.json: field `rms_norm_eps` must be a non-negative number, found -1",
    );
}

#[test]
fn errors_name_the_json_path() {
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {{"rope_type": "linear", "factor": -2}}}}"#
        ),
        "config.json: field `rope_scaling.factor` must be a positive number, found -2",
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {{"rope_theta": "1e4"}}}}"#
        ),
        r#"config.json: field `rope_parameters.rope_theta` must be a positive number, found "1e4""#,
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {{"type": 3}}}}"#
        ),
        "config.json: field `rope_scaling.type` must be a string, found 3",
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": [1]}}"#
        ),
        r#"config.json: field `rope_scaling` must be an object such as {"rope_type": "default"}, found an array"#,
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {{"full_attention": {{}}}}}}"#),
        "config.json: rope_parameters 'per-layer-type settings ('full_attention')' is not supported for llama; \
         supported: one set of RoPE settings for every layer",
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "pad_token_id": 256}}"#
        ),
        "config.json: field `pad_token_id` must be null or a token id in -256..256, found 256",
    );
}

#[test]
fn a_field_and_its_alias_together_are_refused() {
    // transformers would keep whichever it set last; which one is meant is the user's call.
    check(
        &format!(r#"{{{GPT2}, "n_embd": 64, "hidden_size": 64, "n_layer": 2, "n_head": 4}}"#),
        "config.json: field `n_embd` is given twice, under its name and under its transformers alias; keep one",
    );
}

#[test]
fn heads_must_divide() {
    check(
        &format!(r#"{{{GPT2}, "n_embd": 100, "n_layer": 2, "n_head": 12}}"#),
        "config.json: hidden size 100 is not divisible by the 12 attention heads",
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3}}"#
        ),
        "config.json: the 4 attention heads are not divisible by the 3 key/value heads",
    );
    // Mistral's default is 8 KV heads when the field is absent, as MistralConfig has it.
    check(
        r#"{"model_type": "mistral", "vocab_size": 256, "intermediate_size": 128, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}"#,
        "config.json: the 4 attention heads are not divisible by the 8 key/value heads",
    );
}

#[test]
fn unsupported_values_list_what_is_supported() {
    check(
        &format!(
            r#"{{{GPT2}, "n_embd": 64, "n_layer": 2, "n_head": 4, "activation_function": "gelu"}}"#
        ),
        "config.json: activation_function 'gelu' is not supported for gpt2; supported: gelu_new, \
         gelu_pytorch_tanh, relu, silu, swish",
    );
    check(
        &format!(
            r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "hidden_act": "gelu_new"}}"#
        ),
        "config.json: hidden_act 'gelu_new' is not supported for llama; supported: silu, swish",
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {{"rope_type": "longrope", "factor": 4.0}}}}"#),
        "config.json: rope_scaling.rope_type 'longrope' is not supported for llama; supported: default, linear, llama3, yarn",
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {{"type": "dynamic"}}}}"#),
        "config.json: rope_parameters.rope_type 'dynamic' is not supported for llama; supported: default, linear, llama3, yarn",
    );
    check(
        &format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {{"rope_type": "linear"}}}}"#),
        "config.json: field `rope_scaling.factor` must be a positive number (needed by rope_type 'linear'), found null",
    );
    check(
        r#"{"model_type": "opt", "vocab_size": 256, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "layer_norm_elementwise_affine": false}"#,
        "config.json: layer_norm_elementwise_affine 'false' is not supported for opt; supported: true (layer norms \
         with weight and bias)",
    );
    check(
        &format!(r#"{{{GPT2}, "n_embd": 64, "n_layer": 2, "n_head": 4, "scale_attn_by_inverse_layer_idx": true}}"#),
        "config.json: scale_attn_by_inverse_layer_idx 'true' is not supported for gpt2; supported: false",
    );
}

#[test]
fn sequences_longer_than_learned_positions_are_refused() {
    check_build(
        "gpt2-tiny",
        BuildOptions::new(1, 257),
        "sequence length 257 is longer than the 256 positions gpt2-tiny has learned; use a sequence length \
         of at most 256",
    );
    check_build(
        "opt-1.3b",
        BuildOptions::new(1, 4096),
        "sequence length 4096 is longer than the 2048 positions opt-1.3b has learned; use a sequence length \
         of at most 2048",
    );
    // Rotary models have no table: a longer sequence builds.
    assert!(build_forward(&load("llama-tiny").unwrap(), &BuildOptions::new(1, 1024)).is_ok());
}

#[test]
fn batch_geometry_must_be_usable() {
    check_build(
        "gpt2-tiny",
        BuildOptions::new(0, 16),
        "batch size must be at least 1",
    );
    check_build(
        "gpt2-tiny",
        BuildOptions::new(2, 0),
        "sequence length must be at least 1",
    );
    check_build(
        "gpt2-tiny",
        BuildOptions::new(2, 16).with_dtype(DType::I32),
        "element type i32 is not floating point; use f32, bf16 or f16",
    );
    check_build(
        "llama-2-70b",
        BuildOptions::new(u64::MAX, 1 << 20),
        "batch 18446744073709551615 x sequence 1048576 of llama-2-70b is too large to describe: its sizes \
         overflow 64 bits",
    );
}

#[test]
fn no_json_makes_the_parser_panic() {
    // Odd but well-formed inputs: each must parse or fail with an error, never panic.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let cases = [
        "null".to_string(),
        "{}".to_string(),
        r#"{"model_type": null}"#.to_string(),
        deep,
        format!(r#"{{{GPT2}, "n_embd": 18446744073709551615, "n_layer": 2, "n_head": 1}}"#),
        format!(r#"{{{GPT2}, "n_embd": 1e400, "n_layer": 2, "n_head": 1}}"#),
        format!(r#"{{{GPT2}, "n_embd": -64, "n_layer": 2, "n_head": 1}}"#),
        format!(r#"{{{GPT2}, "n_embd": 16777216, "n_layer": 65536, "n_head": 1, "n_inner": 16777216}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 0}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 3}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 0}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_scaling": []}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {{"full": {{}}}}}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "pad_token_id": 99999}}"#),
        format!(r#"{{{LLAMA}, "hidden_size": 64, "num_attention_heads": 4, "pad_token_id": -1}}"#),
        r#"{"model_type": "mistral", "vocab_size": 1, "intermediate_size": 1, "num_hidden_layers": 1, "hidden_size": 2, "num_attention_heads": 1, "sliding_window": 0}"#.to_string(),
        r#"{"model_type": "opt", "vocab_size": 1, "hidden_size": 1, "ffn_dim": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 16777216, "word_embed_proj_dim": 16777216}"#.to_string(),
    ];
    for json in &cases {
        if let Ok(config) = ModelConfig::from_json(json, ConfigSource::Text("case".into())) {
            for options in [
                BuildOptions::new(1, 1),
                BuildOptions::new(u64::MAX, u64::MAX),
                BuildOptions::new(3, 1 << 24),
            ] {
                let _ = build_forward(&config, &options);
            }
        }
    }
}

#[test]
fn qwen_layer_types_other_than_full_then_sliding_are_refused_by_name() {
    let qwen = r#""model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2"#;
    check(
        &format!(r#"{{{qwen}, "layer_types": ["sliding_attention", "full_attention"]}}"#),
        "config.json: layer_types 'full_attention at layer 1' is not supported for qwen2; \
         supported: full_attention layers followed by sliding_attention layers",
    );
    check(
        &format!(r#"{{{qwen}, "layer_types": ["full_attention"]}}"#),
        "config.json: field `layer_types` must be a list of 2 layer types (one per layer), \
         found 1 entries",
    );
}

#[test]
fn rope_scaling_types_not_implemented_are_refused_by_name_for_the_new_families() {
    // Phi-3's LongRoPE, which transformers' Qwen2 does not read.
    let qwen = r#""model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2"#;
    check(
        &format!(
            r#"{{{qwen}, "rope_scaling": {{"type": "longrope", "factor": 4.0,
            "original_max_position_embeddings": 32768}}}}"#
        ),
        "config.json: rope_scaling.rope_type 'longrope' is not supported for qwen2; supported: \
         default, linear, llama3, yarn",
    );
    check(
        &format!(r#"{{{qwen}, "partial_rotary_factor": 0.5}}"#),
        "config.json: partial_rotary_factor '0.5' is not supported for qwen2; supported: 1.0 \
         (transformers' modelling of this family rotates the whole head; Phi-3 is the family \
         that rotates part of it)",
    );
}

const GEMMA2: &str = r#""model_type": "gemma2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4"#;
const GEMMA3: &str = r#""model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4"#;

/// Gemma fields that would change the model and that the builder does not express are refused
/// by name, never ignored.
#[test]
fn gemma_fields_that_change_the_model_are_refused_by_name() {
    check(
        &format!(r#"{{{GEMMA3}, "attn_logit_softcapping": 50.0}}"#),
        "config.json: attn_logit_softcapping '50' is not supported for gemma3_text; supported: \
         null (transformers' Gemma 3 attention does not soft-cap its scores)",
    );
    check(
        &format!(r#"{{{GEMMA2}, "use_bidirectional_attention": true}}"#),
        "config.json: use_bidirectional_attention 'true' is not supported for gemma2; supported: \
         false (causal language models)",
    );
    check(
        &format!(r#"{{{GEMMA2}, "hidden_activation": "gelu"}}"#),
        "config.json: hidden_activation 'gelu' is not supported for gemma2; supported: gelu_new, \
         gelu_pytorch_tanh",
    );
    check(
        &format!(r#"{{{GEMMA3}, "rope_scaling": {{"rope_type": "longrope", "factor": 8.0}}}}"#),
        "config.json: rope_scaling.rope_type 'longrope' is not supported for gemma3_text; \
         supported: default, linear, yarn",
    );
    check(
        &format!(r#"{{{GEMMA3}, "layer_types": ["sliding_attention", "chunked_attention"]}}"#),
        "config.json: layer_types[1] 'chunked_attention' is not supported for gemma3_text; \
         supported: sliding_attention, full_attention",
    );
    check(
        &format!(r#"{{{GEMMA2}, "layer_types": ["sliding_attention"]}}"#),
        "config.json: field `layer_types` must be a list of num_hidden_layers = 2 layer types, \
         found 1 of them",
    );
    check(
        &format!(r#"{{{GEMMA3}, "rope_parameters": {{"global": {{"rope_type": "default"}}}}}}"#),
        "config.json: rope_parameters.global 'a layer type' is not supported for gemma3_text; \
         supported: full_attention, sliding_attention",
    );
    check(
        &format!(r#"{{{GEMMA2}, "final_logit_softcapping": -1}}"#),
        "config.json: field `final_logit_softcapping` must be a positive number, found -1",
    );
}
