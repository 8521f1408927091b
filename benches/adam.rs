//! The host CPU Adam against `torch.optim.AdamW(fused=True)` and a memory copy, in one run.
//
// For 4M and 32M parameters, all cores (rayon's pool; torch gets the same thread count), the
// median of `ADAM_STEPS` steps of:
//
// - `protrain f32`: `kernels::adamw_step_fused` with f32 gradients (reads p, g, m, v; writes
//   p, m, v: 28 bytes per parameter);
// - `protrain bf16`: the same with bf16 gradients, the f32 master weight, and the bf16
//   parameter for the next upload written in the same pass (reads 4 + 2 + 4 + 4, writes
//   4 + 4 + 4 + 2: 28 bytes per parameter);
// - `copy`: `copy_from_slice` on as many threads of 14 bytes per parameter into another buffer (14 read,
//   14 written: the same 28 bytes per parameter), the bytes-moved bound;
// - `torch fused`: `torch.optim.AdamW([p], fused=True).step()` on an f32 tensor with an f32
//   gradient, run by `$ADAM_PYTHON` (default `python3`) when it imports torch; skipped with a
//   note otherwise.
//
// Prints parameters/s of each and the ratios protrain/torch and protrain/copy. Targets:
// >= 1.0x torch fused and >= 0.70x the copy.
//
// `cargo bench --bench adam`. Environment: `ADAM_STEPS` (timed steps, default 20),
// `ADAM_SIZES` (comma-separated parameter counts, default `4194304,33554432`), `ADAM_PYTHON`,
// `RAYON_NUM_THREADS`. Run it on an idle machine.

#[allow(dead_code)] // each bench uses part of the shared helpers
mod common;
use common::{env, median};
use protrain::runtime::kernels::{self, bf16, AdamWConfig, Grad};
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

/// Median seconds of `steps` calls of `f` (after one untimed call), given the 1-based step.
fn time(steps: usize, mut f: impl FnMut(u64)) -> f64 {
    f(1);
    let times = (0..steps)
        .map(|i| {
            let began = Instant::now();
            f(i as u64 + 2);
            began.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

/// Deterministic values in [-1, 1).
fn wave(n: usize, k: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(k) >> 8) as f32 / 8_388_608.0 - 1.0)
        .collect()
}

/// The torch side: prints one line `n params_per_s` per size.
const TORCH: &str = r#"
import sys, time, statistics, torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
for n in map(int, sys.argv[3:]):
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t)
    print(n, n / statistics.median(ts), flush=True)
"#;

/// rayon's thread count: `RAYON_NUM_THREADS`, else every core.
fn threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match env("RAYON_NUM_THREADS", 0) {
        0 => cores,
        n => n,
    }
}

/// Parameters/s of torch fused AdamW per size, or why there are none.
fn torch(sizes: &[usize], steps: usize) -> Result<Vec<f64>, String> {
    let python: String = env("ADAM_PYTHON", "python3".to_string());
    let mut cmd = Command::new(&python);
    cmd.arg("-c")
        .arg(TORCH)
        .arg(threads().to_string())
        .arg(steps.to_string());
    cmd.args(sizes.iter().map(|n| n.to_string()));
    let out = cmd
        .output()
        .map_err(|e| format!("{python} did not run: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "{python} with torch failed: {}",
            err.lines().last().unwrap_or("")
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect())
}

fn main() {
    let steps: usize = env("ADAM_STEPS", 20);
    let sizes: Vec<usize> = env("ADAM_SIZES", "4194304,33554432".to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let threads = threads();
    let config = AdamWConfig::default();
    println!("adam: {threads} threads, median of {steps} steps; parameters/s (M)");
    let torch = torch(&sizes, steps);
    if let Err(why) = &torch {
        println!("torch fused: skipped ({why})");
    }
    for (i, &n) in sizes.iter().enumerate() {
        let mut p = wave(n, 1);
        let g = wave(n, 2).iter().map(|x| x * 1e-2).collect::<Vec<f32>>();
        let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut low = vec![bf16::ZERO; n];
        let f32_s = time(steps, |step| {
            kernels::adamw_step_fused(
                &mut p,
                Grad::F32(&g),
                None,
                &mut m,
                &mut v,
                None,
                step,
                &config,
            );
            black_box(&mut p);
        });
        let bf16_s = time(steps, |step| {
            kernels::adamw_step_fused(
                &mut p,
                Grad::Bf16(&g16),
                None,
                &mut m,
                &mut v,
                Some(kernels::Low::Bf16(&mut low)),
                step,
                &config,
            );
            black_box(&mut low);
        });
        drop((p, g, g16, m, v, low));
        // 14 bytes per parameter each way, as f32 words (rounded up).
        let words = (14 * n).div_ceil(4);
        let src = wave(words, 3);
        let mut dst = vec![0.0f32; words];
        let copy_s = time(steps, |_| {
            let part = words.div_ceil(threads);
            std::thread::scope(|scope| {
                for (d, s) in dst.chunks_mut(part).zip(black_box(&src).chunks(part)) {
                    scope.spawn(move || d.copy_from_slice(s));
                }
            });
            black_box(&mut dst);
        });
        let rate = |s: f64| n as f64 / s;
        let (f, b, c) = (rate(f32_s), rate(bf16_s), rate(copy_s));
        let gb = |r: f64| r * 28.0 / 1e9;
        println!(
            "n={n}: protrain f32 {:.0} ({:.1} GB/s), protrain bf16 {:.0} ({:.1} GB/s), copy {:.0} \
             ({:.1} GB/s)",
            f / 1e6,
            gb(f),
            b / 1e6,
            gb(b),
            c / 1e6,
            gb(c)
        );
        print!("  protrain/copy: f32 {:.2}x, bf16 {:.2}x", f / c, b / c);
        match torch.as_ref().ok().and_then(|t| t.get(i)) {
            Some(&t) => println!(
                "; torch fused {:.0}; protrain/torch: f32 {:.2}x, bf16 {:.2}x",
                t / 1e6,
                f / t,
                b / t
            ),
            None => println!(),
        }
    }
}
