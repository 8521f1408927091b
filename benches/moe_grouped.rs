//! The host grouped matmul (`kernels::grouped_linear_forward`) against PyTorch's per-expert
//! loop on the same shapes and the same routing, in one run.
//
// A mixture-of-experts layer's expert projection: `R = N*k` packed rows grouped by expert
// (group sizes from a fixed pseudo-random routing of `N` tokens to `k` of `E` experts), each
// group times its expert's `[out, in]` weight transposed. PyTorch's side is what transformers'
// eager experts do: `for e in range(E): ys[a:b] = xs[a:b] @ W[e].T` over the same groups, in a
// `$MOE_PYTHON` (default `python3`) process with the same thread count, timed there with
// `time.perf_counter`; protrain's with `Instant`. Each figure is the median of `MOE_STEPS`
// calls after one untimed call; the ratio is PyTorch's seconds over protrain's (above 1:
// protrain faster). Shapes: `MOE_SHAPES`, `;`-separated `N,k,E,in,out` (default: a
// Mixtral-like `512,2,8,1024,3584` and a Qwen3-MoE-like `512,8,64,1024,768`, hidden sizes
// halved to keep the run short).
//
// `cargo bench --bench moe_grouped`. Environment: `MOE_STEPS` (default 10), `MOE_SHAPES`,
// `MOE_PYTHON`, `RAYON_NUM_THREADS`.

#[allow(dead_code)] // each bench uses part of the shared helpers
mod common;
use common::{env, median};
use protrain::runtime::kernels;
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

/// The torch side: prints the median seconds of the per-expert loop.
const TORCH: &str = r#"
import sys, time, statistics, torch
threads, steps, d_in, d_out = (int(a) for a in sys.argv[1:5])
offsets = [int(o) for o in sys.argv[5].split(",")]
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
xs = torch.randn(offsets[-1], d_in, generator=g)
ws = [torch.randn(d_out, d_in, generator=g) for _ in range(len(offsets) - 1)]
ys = torch.empty(offsets[-1], d_out)
def run():
    for e, w in enumerate(ws):
        a, b = offsets[e], offsets[e + 1]
        if a < b:
            torch.matmul(xs[a:b], w.t(), out=ys[a:b])
run()
ts = []
for _ in range(steps):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
print(statistics.median(ts), flush=True)
"#;

/// Deterministic values in [-1, 1).
fn wave(n: usize, k: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(k) >> 8) as f32 / 8_388_608.0 - 1.0)
        .collect()
}

/// Group starts of `n` tokens each sent to `k` distinct experts of `e`, chosen by a fixed
/// hash (uneven groups, as real routing gives).
fn offsets(n: usize, k: usize, e: usize) -> Vec<i32> {
    let mut sizes = vec![0i32; e];
    for t in 0..n {
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
        let mut h = (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        while chosen.len() < k {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            // Skewed: low experts are chosen more often.
            let x = (h % (e * e) as u64) as f64;
            let pick = (x.sqrt() as usize).min(e - 1);
            if !chosen.contains(&pick) {
                chosen.push(pick);
            }
        }
        for c in chosen {
            sizes[c] += 1;
        }
    }
    let mut out = vec![0i32];
    for s in sizes {
        out.push(out.last().copied().unwrap_or(0) + s);
    }
    out
}

fn main() {
    let steps: usize = env("MOE_STEPS", 10);
    let shapes: String = env(
        "MOE_SHAPES",
        "512,2,8,1024,3584;512,8,64,1024,768".to_string(),
    );
    let threads = match env("RAYON_NUM_THREADS", 0usize) {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let python: String = env("MOE_PYTHON", "python3".to_string());
    println!("grouped matmul, {threads} threads, median of {steps} calls");
    for shape in shapes.split(';') {
        let dims: Vec<usize> = shape
            .split(',')
            .map(|d| d.trim().parse().expect("MOE_SHAPES: N,k,E,in,out"))
            .collect();
        let [n, k, e, d_in, d_out] = dims[..] else {
            panic!("MOE_SHAPES: {shape} is not N,k,E,in,out")
        };
        let offsets = offsets(n, k, e);
        let rows = n * k;
        let xs = wave(rows * d_in, 1);
        let weights: Vec<Vec<f32>> = (0..e).map(|i| wave(d_out * d_in, 2 + i as u32)).collect();
        let views: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
        let mut ys = vec![0.0f32; rows * d_out];
        let mut call = || {
            kernels::grouped_linear_forward(&mut ys, &xs, &offsets, &views, d_in, d_out);
            black_box(&mut ys);
        };
        call();
        let ours = median(
            (0..steps)
                .map(|_| {
                    let t = Instant::now();
                    call();
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        );
        let list: Vec<String> = offsets.iter().map(i32::to_string).collect();
        let torch = Command::new(&python)
            .arg("-c")
            .arg(TORCH)
            .args([threads, steps, d_in, d_out].map(|v| v.to_string()))
            .arg(list.join(","))
            .output()
            .map_err(|err| format!("{python} did not run: {err}"))
            .and_then(|out| {
                String::from_utf8_lossy(&out.stdout)
                    .trim()
                    .parse::<f64>()
                    .map_err(|_| format!("{python}: {}", String::from_utf8_lossy(&out.stderr)))
            });
        let flops = 2.0 * (rows * d_in * d_out) as f64;
        let largest = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        print!(
            "N={n} k={k} E={e} {d_in}->{d_out} (largest group {largest} of {rows} rows): \
             protrain {:.2} ms ({:.1} GFLOP/s)",
            ours * 1e3,
            flops / ours / 1e9
        );
        match torch {
            Ok(t) => println!(
                ", torch per-expert loop {:.2} ms ({:.1} GFLOP/s), torch/protrain {:.2}x",
                t * 1e3,
                flops / t / 1e9,
                t / ours
            ),
            Err(why) => println!(", torch skipped: {why}"),
        }
    }
}
