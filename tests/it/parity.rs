//! Parity with PyTorch: tiny GPT-2, LLaMA (grouped KV heads, bf16 weights), Mistral (sliding
//! window) and OPT models trained three AdamW steps by protrain's reference interpreter must
//! match what transformers computed (fixtures made by `tests/fixtures/make_fixtures.py`).

use protrain::runtime::data::{Batcher, TokenStream};
use protrain::runtime::interpreter::Interpreter;
use protrain::runtime::params::load_params;
use protrain::runtime::weights::WeightFile;
use protrain::OptimizerConfig;
use std::path::PathBuf;

/// What a fixture expects, read from its `expected.json`.
struct Expected {
    optimizer: OptimizerConfig,
    batch: u64,
    seq: u64,
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    param_count: u64,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn read_expected(dir: &std::path::Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("fixture expected.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let f = |k: &str| {
        v[k].as_f64()
            .unwrap_or_else(|| panic!("expected.json has no number {k}"))
    };
    let list = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .expect(k)
            .iter()
            .map(|x| x.as_f64().expect(k))
            .collect()
    };
    Expected {
        optimizer: OptimizerConfig {
            lr: f("lr"),
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            grad_clip: v["grad_clip"].as_f64(),
        },
        batch: f("batch") as u64,
        seq: f("seq") as u64,
        losses: list("losses"),
        grad_norms: list("grad_norms_preclip"),
        param_count: f("param_count") as u64,
    }
}

/// How far a tensor is from PyTorch's: the largest absolute difference, and the largest
/// magnitude of PyTorch's tensor.
struct Diff {
    max_abs: f64,
    scale: f64,
}

fn diff(actual: &[f32], expected: &[f32]) -> Diff {
    assert_eq!(actual.len(), expected.len());
    let mut d = Diff {
        max_abs: 0.0,
        scale: 0.0,
    };
    for (&a, &e) in actual.iter().zip(expected) {
        d.max_abs = d.max_abs.max((f64::from(a) - f64::from(e)).abs());
        d.scale = d.scale.max(f64::from(e).abs());
    }
    d
}

/// Trains the fixture's model three steps and compares losses, gradient norms, every
/// gradient after the first step and every weight after the last.
fn check(name: &str) {
    let dir = fixture(name);
    let expected = read_expected(&dir);
    let config =
        protrain::models::load(dir.to_str().expect("utf-8 path")).expect("fixture config parses");
    let forward =
        protrain::forward_graph(&config, expected.batch, expected.seq).expect("forward graph");
    assert_eq!(
        forward.param_count(),
        expected.param_count,
        "{name}: parameter count"
    );
    let graph = protrain::training_graph(&forward, &expected.optimizer).expect("training graph");
    let values = load_params(&graph, &dir.join("model.safetensors")).expect("weights load");
    let mut interp = Interpreter::new(&graph);
    for ((id, _), data) in graph.params().zip(&values) {
        interp.set_param(id, data).expect("parameter sizes match");
    }
    let stream = TokenStream::open(dir.join("tokens.npy")).expect("tokens load");
    let batcher =
        Batcher::new(stream, expected.batch as usize, expected.seq as usize).expect("batcher");
    let grads = WeightFile::open(dir.join("grads.safetensors")).expect("grads fixture");
    let finals = WeightFile::open(dir.join("final.safetensors")).expect("final fixture");

    // The worst errors seen, printed for the record (`--nocapture`).
    let (mut worst_loss, mut worst_grad) = (0.0f64, 0.0f64);
    for (step, (&want_loss, &want_norm)) in
        expected.losses.iter().zip(&expected.grad_norms).enumerate()
    {
        let batch = batcher.batch(step as u64);
        let inputs: Vec<i32> = batch.inputs.iter().map(|&t| t as i32).collect();
        let targets: Vec<i32> = batch.targets.iter().map(|&t| t as i32).collect();
        let report = interp.step(&[&inputs, &targets]).expect("step runs");
        let rel = (f64::from(report.loss) - want_loss).abs() / want_loss.abs();
        worst_loss = worst_loss.max(rel);
        assert!(
            rel < 1e-4,
            "{name} step {step}: loss {} vs PyTorch {want_loss} (rel {rel:e})",
            report.loss
        );
        if let Some(norm) = report.grad_norm {
            let rel = (f64::from(norm) - want_norm).abs() / want_norm;
            assert!(
                rel < 1e-4,
                "{name} step {step}: grad norm {norm} vs PyTorch {want_norm}"
            );
        }
        if step == 0 {
            for (id, p) in graph.params() {
                let want = grads
                    .read_f32_vec(&p.name)
                    .expect("fixture holds every gradient");
                let got = interp
                    .param_grad(id)
                    .unwrap_or_else(|| panic!("{name}: {} has no gradient", p.name));
                // Within 1e-4 of the tensor's largest gradient. A gradient that is zero in exact
                // arithmetic (the key bias: softmax ignores a shift shared by every key) is
                // rounding noise on both sides, so an absolute floor of 1e-7 applies too.
                let d = diff(got, &want);
                worst_grad = worst_grad.max(d.max_abs / d.scale.max(f64::MIN_POSITIVE));
                assert!(
                    d.max_abs <= 1e-4 * d.scale + 1e-7,
                    "{name}: gradient of {} off by {:e} (its largest magnitude is {:e})",
                    p.name,
                    d.max_abs,
                    d.scale
                );
            }
        }
    }
    eprintln!(
        "{name}: largest loss error {worst_loss:.2e} (relative), largest gradient error \
         {worst_grad:.2e} (of each tensor's largest magnitude)"
    );
    for ((id, p), initial) in graph.params().zip(&values) {
        // AdamW's first update is lr * sign(g) whatever |g|, and later ones are ratios of
        // moments, so elements whose gradients are rounding noise (the key bias's, zero in
        // exact arithmetic) or come out of cancellation (the key weights') can move by a
        // sizeable fraction of lr either way. Elementwise bounds would be meaningless there;
        // the check is that the whole update agrees: the distance to PyTorch's weights is
        // within 2% of the distance PyTorch's weights travelled in three steps.
        let want = finals
            .read_f32_vec(&p.name)
            .expect("fixture holds every final weight");
        let got = interp.param(id);
        let grad0 = grads
            .read_f32_vec(&p.name)
            .expect("fixture holds every gradient");
        if grad0.iter().all(|g| g.abs() < NOISE) {
            // A tensor whose whole gradient is rounding noise (OPT's key bias, zero in exact
            // arithmetic) moves in directions that rounding picks, on both sides: there is no
            // distance to hold. What a wrong gradient would break is that protrain's gradient
            // is noise too (a bias gradient that is not the zero it should be exceeds NOISE).
            let ours = interp.param_grad(id).expect("checked at step 0 above");
            let worst = ours.iter().fold(0.0f32, |m, g| m.max(g.abs()));
            assert!(
                worst < NOISE,
                "{name}: {}'s gradient should be rounding noise, as PyTorch's is, but reaches {worst:e}",
                p.name
            );
            continue;
        }
        assert!(
            weights_agree(got, &want, initial),
            "{name}: final {} is {:e} from PyTorch's, which moved {:e} in {} steps",
            p.name,
            distance(got, &want),
            distance(&want, initial),
            expected.losses.len()
        );
        // The bound can fail: weights that took PyTorch's steps the other way, as a gradient
        // of the wrong sign would, are refused.
        let mirrored: Vec<f32> = want.iter().zip(initial).map(|(w, i)| i - (w - i)).collect();
        assert!(
            !weights_agree(&mirrored, &want, initial),
            "{name}: the weight check cannot tell {}'s update from its mirror image",
            p.name
        );
    }
}

/// Below this everywhere, a gradient is rounding noise.
const NOISE: f32 = 1e-6;

/// The Euclidean distance between two tensors, in f64.
fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Whether weights `got` are within 2% of the distance PyTorch's weights `want` travelled
/// from `initial`.
fn weights_agree(got: &[f32], want: &[f32], initial: &[f32]) -> bool {
    distance(got, want) <= 0.02 * distance(want, initial)
}

#[test]
fn gpt2_matches_pytorch() {
    check("gpt2");
}

#[test]
fn llama_with_grouped_kv_heads_and_bf16_weights_matches_pytorch() {
    check("llama");
}

#[test]
fn mistral_with_sliding_window_matches_pytorch() {
    check("mistral");
}

#[test]
fn opt_with_padding_row_matches_pytorch() {
    check("opt");
}

#[test]
fn qwen2_with_qkv_biases_tied_embeddings_and_a_window_on_layer_1_matches_pytorch() {
    check("qwen2");
}

#[test]
fn qwen3_with_per_head_qk_norms_and_a_wider_head_dim_matches_pytorch() {
    check("qwen3");
}

#[test]
fn olmo2_with_post_norms_and_whole_projection_qk_norms_matches_pytorch() {
    check("olmo2");
}

/// The fixture's weights of `family` split over two shards with their index, as the Hub
/// publishes large models, load as the single file does; and saved back, they carry the Hub's
/// names (tied weights once) with the same values.
fn check_hub_weights_round_trip(family: &str) {
    use protrain::runtime::params::save_params;
    use protrain::runtime::weights::{save_safetensors, StorageDtype};
    let dir = fixture(family);
    let expected = read_expected(&dir);
    let config = protrain::models::load(dir.to_str().expect("utf-8")).expect("fixture config");
    let graph = protrain::forward_graph(&config, 1, 4).expect("forward graph");
    let single = load_params(&graph, &dir.join("model.safetensors")).expect("weights load");
    let file = WeightFile::open(dir.join("model.safetensors")).expect("fixture weights");
    let names: Vec<String> = file.names().map(str::to_string).collect();
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut weight_map = serde_json::Map::new();
    for (k, shard) in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    .iter()
    .enumerate()
    {
        let mine: Vec<(&str, Vec<usize>, Vec<f32>)> = names
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == k)
            .map(|(_, n)| {
                let shape = file.shape(n).expect("shape").to_vec();
                (n.as_str(), shape, file.read_f32_vec(n).expect("values"))
            })
            .collect();
        let tensors: Vec<(&str, &[usize], &[f32])> = mine
            .iter()
            .map(|(n, s, v)| (*n, s.as_slice(), v.as_slice()))
            .collect();
        save_safetensors(tmp.path().join(shard), &tensors, StorageDtype::F32, &[])
            .expect("shard written");
        for (n, _, _) in &mine {
            weight_map.insert(n.to_string(), serde_json::Value::from(*shard));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    let index_path = tmp.path().join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).expect("index written");
    let sharded = load_params(&graph, &index_path).expect("sharded weights load");
    assert_eq!(
        sharded, single,
        "{family}: sharded and single-file weights differ"
    );

    let saved = tmp.path().join("saved.safetensors");
    save_params(&graph, &single, &saved, StorageDtype::F32).expect("weights saved");
    let back = WeightFile::open(&saved).expect("saved weights open");
    let mut saved_names: Vec<&str> = back.names().collect();
    saved_names.sort_unstable();
    let mut hub_names: Vec<&str> = names.iter().map(String::as_str).collect();
    hub_names.sort_unstable();
    assert_eq!(
        saved_names, hub_names,
        "{family}: saved names are not the Hub's"
    );
    for n in &names {
        assert_eq!(
            back.read_f32_vec(n).expect("saved tensor"),
            file.read_f32_vec(n).expect("fixture tensor"),
            "{family}: {n}"
        );
    }
    assert_eq!(graph.param_count(), expected.param_count, "{family}");
}

#[test]
fn hub_weights_load_from_shards_and_save_with_hub_names() {
    for family in [
        "qwen2",
        "qwen3",
        "olmo2",
        "gemma2",
        "gemma3",
        "phi3",
        "mixtral",
        "qwen3_moe",
    ] {
        check_hub_weights_round_trip(family);
    }
}

#[test]
fn gemma2_with_soft_caps_sandwich_norms_and_alternating_windows_matches_pytorch() {
    check("gemma2");
}

#[test]
fn gemma3_with_qk_norms_and_per_layer_type_rope_matches_pytorch() {
    check("gemma3");
}

/// YaRN on the global layer (the sliding ones unscaled): blended frequencies and cos and sin
/// scaled by the attention factor.
#[test]
fn gemma3_with_yarn_on_global_layers_matches_pytorch() {
    check("gemma3_yarn");
}

#[test]
fn mixtral_with_renormalised_top_2_of_4_experts_matches_pytorch() {
    check("mixtral");
}

#[test]
fn qwen3_moe_with_a_dense_layer_and_top_2_of_8_experts_unnormalised_matches_pytorch() {
    check("qwen3_moe");
}

#[test]
fn mixtral_with_the_load_balancing_loss_matches_pytorch() {
    check("mixtral_aux");
}

#[test]
fn qwen3_moe_with_the_load_balancing_loss_over_its_sparse_layers_matches_pytorch() {
    check("qwen3_moe_aux");
}

#[test]
fn phi3_with_fused_projections_partial_longrope_and_a_window_matches_pytorch() {
    check("phi3");
}

#[test]
fn qwen2_with_yarn_rope_scaling_matches_pytorch() {
    check("qwen2_yarn");
}
