//! Parameter names, shapes, order, ties and exact counts, held against what transformers builds.
//!
//! `data/hf_params.json` is written by `data/make_hf_params.py` (transformers on the `meta`
//! device); `tests/fixtures/*/expected.json` at the repository root by its own script.

use protrain_ir::Graph;
use protrain_models::{
    build_forward, find_preset, load, presets, BuildOptions, ModelConfig, ModelStateBytes,
};
use serde_json::Value;
use std::path::{Path, PathBuf};

const MODELS: &str = env!("CARGO_MANIFEST_DIR");

fn real_configs() -> PathBuf {
    Path::new(MODELS).join("tests/real-configs")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn hf_params() -> Value {
    read_json(&Path::new(MODELS).join("tests/data/hf_params.json"))
}

fn graph_of(config: &ModelConfig) -> Graph {
    build_forward(config, &BuildOptions::new(1, 1))
        .unwrap_or_else(|e| panic!("{}: {e}", config.name))
}

/// Checks a config against transformers' description of it: the parameter count (from the graph
/// and from `ModelInfo`), which names `lm_head.weight` aliases, and, where the description lists
/// them, every parameter's name and shape in `named_parameters()` order.
fn check(config: &ModelConfig, expected: &Value) {
    let name = &config.name;
    let graph = graph_of(config);
    let count = expected["parameters"].as_u64().expect("a count");
    assert_eq!(graph.param_count(), count, "{name}: parameter count");
    assert_eq!(
        config.info().unwrap().parameters,
        count,
        "{name}: ModelInfo"
    );

    let tied: Vec<(String, String)> = expected["tied"]
        .as_object()
        .expect("a tied map")
        .iter()
        .map(|(alias, target)| (alias.clone(), target.as_str().unwrap().to_string()))
        .collect();
    let ours: Vec<(String, String)> = graph
        .params()
        .flat_map(|(_, p)| {
            p.aliases
                .iter()
                .filter(|a| *a == "lm_head.weight")
                .map(|a| (a.clone(), p.name.clone()))
        })
        .collect();
    assert_eq!(ours, tied, "{name}: tied weights");

    if let Some(params) = expected["params"].as_array() {
        let theirs: Vec<(String, Vec<u64>)> = params
            .iter()
            .map(|p| {
                let name = p[0].as_str().or(p["name"].as_str()).unwrap().to_string();
                let shape = p.get(1).unwrap_or(&p["shape"]).as_array().unwrap();
                (name, shape.iter().map(|d| d.as_u64().unwrap()).collect())
            })
            .collect();
        let ours: Vec<(String, Vec<u64>)> = graph
            .params()
            .map(|(_, p)| (p.name.clone(), graph.value(p.value).ty.shape.clone()))
            .collect();
        assert_eq!(
            ours, theirs,
            "{name}: parameters in named_parameters() order"
        );
    }
}

#[test]
fn presets_match_transformers() {
    let hf = hf_params();
    for preset in presets() {
        check(
            &preset.config().unwrap(),
            &hf[format!("preset/{}", preset.name)],
        );
    }
}

#[test]
fn test_configs_match_transformers() {
    let hf = hf_params();
    let dir = Path::new(MODELS).join("tests/configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    for file in files {
        let stem = file.file_stem().unwrap().to_str().unwrap().to_string();
        check(
            &ModelConfig::from_file(&file).unwrap(),
            &hf[format!("test/{stem}")],
        );
    }
}

#[test]
fn reference_fixtures_match_transformers() {
    // The configs transformers 5 wrote for the numerics fixtures, with everything it records.
    for model in [
        "gpt2",
        "llama",
        "mistral",
        "opt",
        "qwen2",
        "qwen3",
        "olmo2",
        "gemma2",
        "gemma3",
        "phi3",
        "qwen2_yarn",
    ] {
        let dir = Path::new(MODELS).join("../tests/fixtures").join(model);
        let mut expected = read_json(&dir.join("expected.json"));
        expected["parameters"] = expected["param_count"].clone();
        let config = load(dir.to_str().unwrap()).unwrap();
        check(&config, &expected);
    }
}

/// Checks that a model spec has exactly `parameters` parameters.
fn check_count(spec: &str, parameters: u64) {
    let config = load(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    assert_eq!(graph_of(&config).param_count(), parameters, "{spec}");
}

#[test]
fn real_configs_have_their_published_counts() {
    for (file, parameters) in [
        ("gpt2.json", 124_439_808),
        ("gpt2-medium.json", 354_823_168),
        ("gpt2-large.json", 774_030_080),
        ("gpt2-xl.json", 1_557_611_200),
        ("llama-2-7b.json", 6_738_415_616),
        ("mistral-7b.json", 7_241_732_096),
        ("opt-1.3b.json", 1_315_758_080),
        ("qwen2.5-0.5b.json", 494_032_768),
        ("qwen2.5-7b.json", 7_615_616_512),
        ("qwen3-0.6b.json", 596_049_920),
        ("qwen3-8b.json", 8_190_735_360),
        ("olmo-2-1b.json", 1_484_916_736),
        ("gemma-2-2b.json", 2_614_341_888),
        ("gemma-2-9b.json", 9_241_705_984),
        ("gemma-3-1b.json", 999_885_952),
        ("gemma-3-4b.json", 3_880_263_168),
        ("phi-3-mini-4k.json", 3_821_079_552),
        ("phi-3-mini-128k.json", 3_821_079_552),
    ] {
        check_count(real_configs().join(file).to_str().unwrap(), parameters);
    }
}

#[test]
fn every_real_config_is_covered() {
    let hf = hf_params();
    for entry in std::fs::read_dir(real_configs()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let stem = path.file_stem().unwrap().to_str().unwrap();
            check(
                &ModelConfig::from_file(&path).unwrap(),
                &hf[format!("real/{stem}")],
            );
        }
    }
}

#[test]
fn presets_have_their_published_counts() {
    for (preset, parameters) in [
        ("gpt2", 124_439_808),
        // 96 layers x (12 x 12288^2 + 13 x 12288) + 50257 x 12288 tokens + 2048 x 12288
        // positions + 2 x 12288 final norm: GPT-3's "175.0B" (Brown et al. 2020, table 2.1).
        ("gpt3-175b", 174_604_259_328),
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        // 80 layers x (8192 x (8192 + 2 x 1024 + 8192) attention + 3 x 8192 x 28672 MLP + 2 x 8192
        // norms) + 2 x 32000 x 8192 embedding and head + 8192 final norm.
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen3-8b", 8_190_735_360),
        // transformers on the meta device (models/tests/data/make_hf_params.py).
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("olmo2-1b", 1_484_916_736),
        ("opt-1.3b", 1_315_758_080),
        ("gemma-2-2b", 2_614_341_888),
        ("gemma-2-9b", 9_241_705_984),
        ("gemma-3-1b", 999_885_952),
        ("gemma-3-4b", 3_880_263_168),
        ("phi-3-mini", 3_821_079_552),
        ("phi-3-mini-128k", 3_821_079_552),
        ("opt-13b", 12_853_473_280),
        // 48 layers x 616,655,872 + 50272 x 7168 tokens + 2050 x 7168 positions + 2 x 7168 final
        // norm, as transformers builds it (not 29,974,401,024, a figure that circulates).
        ("opt-30b", 29_974_540_288),
    ] {
        check_count(preset, parameters);
    }
}

#[test]
fn model_state_is_sixteen_bytes_per_parameter() {
    let info = find_preset("llama-2-7b")
        .unwrap()
        .config()
        .unwrap()
        .info()
        .unwrap();
    let p = 6_738_415_616;
    assert_eq!(
        info.model_state_bytes,
        ModelStateBytes {
            params: 2 * p,
            grads: 2 * p,
            master: 4 * p,
            adam_m: 4 * p,
            adam_v: 4 * p,
            total: 16 * p,
            grads_in_params: 14 * p,
            staged: 12 * p,
        }
    );
    let json: Value = serde_json::to_value(&info).unwrap();
    for key in [
        "parameters",
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "vocab",
        "head_dim",
        "intermediate",
    ] {
        assert!(json.get(key).is_some_and(Value::is_u64), "{key} in {json}");
    }
    assert_eq!(json["parameters"], p);
    assert_eq!(
        (json["layers"].as_u64(), json["kv_heads"].as_u64()),
        (Some(32), Some(32))
    );
}
