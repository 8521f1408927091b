//! `protrain profile` as a user runs it, and `protrain compile --hardware` reading its output.

use crate::cli_support;
use cli_support::{compile_gpt2_tiny, protrain, stderr};

use protrain::ir::{op_key, HardwareProfile, TensorType};
use protrain::OptimizerConfig;
use std::collections::BTreeSet;

/// The op keys of gpt2-tiny's training graph at batch 2 x seq 16.
/// The op keys of gpt2-tiny's fused and unfused training graphs (batch 2 x seq 16).
fn graph_keys() -> BTreeSet<String> {
    let config = protrain::models::load("gpt2-tiny").unwrap();
    let graphs = protrain::profiling_graphs(
        &config,
        2,
        16,
        protrain::ir::DType::F32,
        &OptimizerConfig::default(),
        &HardwareProfile::host(),
    )
    .unwrap();
    assert!(graphs[1]
        .ops()
        .any(|(_, op)| op.kind.mnemonic() == "fused_linear"));
    graphs
        .iter()
        .flat_map(|graph| {
            graph.ops().map(|(_, op)| {
                let types: Vec<&TensorType> =
                    op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
                op_key(&op.kind, &types)
            })
        })
        .collect()
}

#[test]
fn a_profile_covers_the_graph_and_compile_accepts_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.json");
    let file = file.to_str().unwrap();
    let out = protrain(&[
        "profile",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--repeats",
        "2",
        "-o",
        file,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("profiled gpt2-tiny"), "{stdout}");
    assert!(stdout.contains("beside the compute kernels"), "{stdout}");

    let profile = HardwareProfile::from_json_file(file).expect("the profile reads back");
    let keys: BTreeSet<String> = profile.measured_ops.iter().map(|m| m.key.clone()).collect();
    assert!(!keys.is_empty());
    assert_eq!(keys.len(), profile.measured_ops.len(), "one entry per key");
    assert_eq!(
        keys,
        graph_keys(),
        "the table holds exactly the op keys of the fused and the unfused graph"
    );
    assert!(profile.measured_ops.iter().all(|m| m.seconds > 0.0));
    for (field, rate) in [
        ("h2d_bandwidth", profile.h2d_bandwidth),
        ("d2h_bandwidth", profile.d2h_bandwidth),
        ("host_memcpy_bandwidth", profile.host_memcpy_bandwidth),
        ("cpu_adam_params_per_s", profile.cpu_adam_params_per_s),
        ("gpu_adam_params_per_s", profile.gpu_adam_params_per_s),
    ] {
        assert!(rate.is_finite() && rate > 0.0, "{field} = {rate}");
    }
    // The CPU Adam was timed beside the backward kernels, the copies and both (the graph is
    // timed in place).
    for (field, share) in [
        ("cpu_adam_compute_share", profile.cpu_adam_compute_share),
        ("cpu_adam_copy_share", profile.cpu_adam_copy_share),
        (
            "cpu_adam_compute_copy_share",
            profile.cpu_adam_compute_copy_share,
        ),
    ] {
        let share = share.unwrap_or_else(|| panic!("{field} is not measured"));
        assert!(share > 0.0 && share <= 1.0, "{field} = {share}");
    }
    // Capacities come from the host preset.
    let host = HardwareProfile::host();
    assert_eq!(profile.device_memory_bytes, host.device_memory_bytes);
    assert_eq!(profile.host_memory_bytes, host.host_memory_bytes);

    let schedule = dir.path().join("tiny.ptsched");
    let out = compile_gpt2_tiny(&schedule, &["--hardware", file, "--json"]);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary["predicted_step_s"].as_f64().unwrap() > 0.0);
    // The same call as a user would type it, at the default batch.
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        file,
        "--dtype",
        "f32",
        "--seq",
        "16",
        "-o",
        schedule.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn profile_writes_json_to_stdout_without_an_output_file() {
    let out = protrain(&[
        "profile",
        "gpt2-tiny",
        "--batch",
        "1",
        "--seq",
        "8",
        "--repeats",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    let profile = HardwareProfile::from_json(&text).expect("stdout is the profile");
    assert!(!profile.measured_ops.is_empty());
}

/// What `--backend cuda` must do here: fail with why and the way out where the CUDA backend
/// cannot run (not built in, or built without a usable GPU), run where it can. So the test is
/// true in every build on every machine.
#[test]
fn the_cuda_backend_runs_or_says_why_not() {
    let args = [
        "profile",
        "gpt2-tiny",
        "--backend",
        "cuda",
        "--batch",
        "2",
        "--seq",
        "8",
        "--repeats",
        "1",
    ];
    let out = protrain(&args);
    let err = stderr(&out);
    match protrain::runtime::cuda::available() {
        Ok(()) => {
            assert!(out.status.success(), "a GPU is here: {err}");
            // The profile records the GPU's compute capability, which decides whether the
            // compiler plans flash attention for it.
            let profile = HardwareProfile::from_json(&String::from_utf8_lossy(&out.stdout))
                .unwrap_or_else(|e| panic!("{e}: {err}"));
            assert!(profile.compute_capability.is_some(), "{profile:?}");
        }
        Err(why) => {
            assert_eq!(out.status.code(), Some(2), "{err}");
            if cfg!(feature = "cuda") {
                assert!(err.contains("no CUDA device is available"), "{err}");
                assert!(err.contains(&why), "{err}");
            } else {
                assert!(err.contains("cuda backend is not built"), "{err}");
                assert!(err.contains("--features cuda"), "{err}");
                assert!(err.contains("--backend host"), "{err}");
            }
        }
    }
}

#[test]
fn bad_arguments_are_rejected() {
    let out = protrain(&["profile", "gpt2-tiny", "--repeats", "0", "--seq", "8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--repeats must be at least 1"));
    let out = protrain(&["profile", "no-such-model"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no-such-model"), "{}", stderr(&out));
}
