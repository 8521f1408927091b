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
