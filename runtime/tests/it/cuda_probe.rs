//! `cuda::available()` on whatever machine runs it: with a GPU it must find one the backend can
//! use; without one (CI) it must say what is missing and the way out, never panic. CI runs
//! this with `--features cuda` on a machine with no NVIDIA driver.

use protrain_runtime::cuda::{available, CudaBackend};
use protrain_runtime::Backend;

#[test]
fn available_finds_a_usable_device_or_names_what_is_missing() {
    match available() {
        Ok(()) => {
            // A GPU machine: the probe's answer must hold, so the backend comes up.
            CudaBackend::new(1 << 20, 1 << 20, 2)
                .expect("available() said yes, so a backend with a 1 MiB arena comes up");
        }
        Err(why) => {
            let causes = [
                "libcuda.so",
                "does not answer",
                "driver supports CUDA",
                "no usable GPU",
                "sees no GPU",
                "libcublas.so.13",
                "libnvrtc.so.13",
            ];
            assert!(
                causes.iter().any(|c| why.contains(c)),
                "an unexplained refusal: {why}"
            );
            assert!(
                why.contains("--backend host") || why.contains("nvrtc-env.sh"),
                "the refusal gives no way out: {why}"
            );
        }
    }
}

/// `scripts/gpu-check.sh` fits a device session: about 15 minutes must hold a machine start,
/// the check and a rerun, so its parts' time limits add up to at most 4 minutes.
#[test]
fn the_gpu_check_fits_a_device_session() {
    let script = include_str!("../../../scripts/gpu-check.sh");
    let limits: Vec<u64> = script
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            match words.next()? {
                "part" | "train" => words.nth(1)?.parse().ok(),
                _ => None,
            }
        })
        .collect();
    assert_eq!(limits.len(), 6, "the parts of gpu-check.sh: {limits:?}");
    let total: u64 = limits.iter().sum();
    assert!(
        total <= 240,
        "the parts may take {total} s in all; at most 240 fit"
    );
}

/// A device test never passes by returning early: every test of a file that needs a device
/// (one that defines `require_gpu` or `require_nccl`, which fail naming what is missing) is
/// `#[ignore = "needs a GPU or the CUDA simulator"]`, and the scripts that run them on the
/// simulator and on a GPU pass `--include-ignored`. Reads the test sources wherever they live
/// under the workspace's test folders.
#[test]
fn device_tests_are_ignored_not_skipped_and_the_device_scripts_include_them() {
    const IGNORE: &str = "#[ignore = \"needs a GPU or the CUDA simulator\"]";
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    let mut dirs = vec![root.join("tests"), root.join("runtime/tests")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut device_files = 0;
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        // Spelt in two halves so that this file, which names them, is not one of them.
        let markers = [
            concat!("fn require", "_gpu()"),
            concat!("fn require", "_nccl()"),
        ];
        if !markers.iter().any(|m| text.contains(m)) {
            continue;
        }
        device_files += 1;
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for (i, line) in lines.iter().enumerate() {
            if *line == "#[test]" {
                assert_eq!(
                    lines.get(i + 1).copied(),
                    Some(IGNORE),
                    "{}:{}: a device test without `{IGNORE}`",
                    path.display(),
                    i + 1
                );
            }
        }
    }
    assert!(
        device_files >= 3,
        "found {device_files} files of device tests"
    );
    for script in ["cuda-sim/ci.sh", "scripts/gpu-check.sh"] {
        let text = std::fs::read_to_string(root.join(script)).unwrap();
        for line in text.lines().filter(|l| {
            l.contains("--features cuda")
                && l.contains("cargo test")
                && !l.contains("--no-run")
                && !l.trim_start().starts_with('#')
        }) {
            assert!(
                line.contains("--include-ignored"),
                "{script} runs device tests without --include-ignored: {line}"
            );
        }
    }
}
