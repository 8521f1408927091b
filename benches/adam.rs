//! The host CPU Adam against `torch.optim.AdamW(fused=True)` and a memory copy, in one run.
//
// For 4M and 32M parameters, all cores (rayon's pool; torch gets the same thread count), the
// median of `ADAM_STEPS` steps of:
//
// - `protrain f32`: `kernels::adamw_step_fused` with f32 gradients (reads p, g, m, v; writes
//   p, m, v: 28 bytes per parameter);
// - `protrain bf16`: the same with bf16 gradients, the f32 master weight, and the bf16
//   parameter for the next upload written in the same pass (reads 4 + 2 + 4 + 4, writes
//   4 + 4 + 4 + 2: 28 bytes per parameter), the 16-byte host layout, where the gradient has
//   storage of its own;
// - `protrain bf16 in place`: the 14-byte host layout, where the bf16 gradient lies in the
//   parameter's storage and the new bf16 parameter is written over it (`Grad::InLow`: reads
//   4 + 2 + 4 + 4, writes the same bytes back, 28 per parameter; with no fresh buffer to
//   write, no cache line is read only to be overwritten, which the 16-byte layout's bf16 copy
//   costs);
// - `copy`: `copy_from_slice` on as many threads of 14 bytes per parameter into another buffer
//   (14 read, 14 written: the same 28 bytes per parameter), the bytes-moved bound;
// - `torch fused`: `torch.optim.AdamW([p], fused=True).step()` on an f32 tensor with an f32
//   gradient, in a `$ADAM_PYTHON` (default `python3`) process that imports torch and stays up
//   for the whole run; skipped with a note when it does not start.
//
// The five are measured one after the other, size after size, in `ADAM_ROUNDS` rounds: on a
// shared machine memory bandwidth drifts by several percent from one half-minute to the next,
// so each ratio is taken within a round (seconds apart), and the summary is the median over
// rounds of each rate and of each ratio. Targets: >= 1.0x torch fused and >= 0.70x the copy.
//
// `cargo bench --bench adam`. Environment: `ADAM_STEPS` (timed steps, default 20),
// `ADAM_ROUNDS` (default 5), `ADAM_SIZES` (comma-separated parameter counts, default
// `4194304,33554432`), `ADAM_PYTHON`, `RAYON_NUM_THREADS`, and `PROTRAIN_CPU_ISA=avx2` to
// measure an AVX2-only machine's kernels on an AVX-512 one (torch is then started with
// `ATEN_CPU_CAPABILITY=avx2`, so both sides run their AVX2 code), and `ADAM_CLOCK=cpu` to time
// each step by the process's CPU time instead of the wall clock (both sides), for a machine
// shared with other work, where wall time counts the other processes' turns: meaningful with
// `RAYON_NUM_THREADS=1` (torch then runs on its calling thread; with more threads, waiting
// threads that spin count as work). Run it on an idle machine where you can.

#[allow(dead_code)] // each bench uses part of the shared helpers
mod common;
use common::{env, median};
use protrain::runtime::kernels::{self, bf16, AdamWConfig, Grad};
use std::hint::black_box;
use std::io::{BufRead, BufReader, Lines, Read, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

/// Whether steps are timed by the process's CPU time (`ADAM_CLOCK=cpu`), not the wall clock.
fn cpu_clock() -> bool {
    std::env::var("ADAM_CLOCK").is_ok_and(|c| c == "cpu")
}

/// Seconds of CPU time this process (all its threads) has used.
fn process_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Median seconds of `steps` calls of `f` (after one untimed call), given the 1-based step,
/// by the wall clock or the process's CPU time ([`cpu_clock`]).
fn time(steps: usize, mut f: impl FnMut(u64)) -> f64 {
    f(1);
    let cpu = cpu_clock();
    let times = (0..steps)
        .map(|i| {
            let (began, began_cpu) = (Instant::now(), cpu.then(process_cpu_seconds));
            f(i as u64 + 2);
            match began_cpu {
                Some(c) => process_cpu_seconds() - c,
                None => began.elapsed().as_secs_f64(),
            }
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

/// The torch side: a server that, for each parameter count read from a line of stdin, prints
/// one line `n params_per_s` (the median of `steps` steps after one untimed step, on tensors
/// it keeps per count).
const TORCH: &str = r#"
import sys, time, statistics, torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
clock = time.process_time if sys.argv[3] == "cpu" else time.perf_counter
torch.set_num_threads(threads)
opts = {}
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    if n not in opts:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        opts[n] = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt = opts[n]
    opt.step()
    ts = []
    for _ in range(steps):
        t = clock(); opt.step(); ts.append(clock() - t)
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

/// The torch server ([`TORCH`]), started, or why it did not start.
struct Torch {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Torch {
    fn start(steps: usize) -> Result<Torch, String> {
        let python: String = env("ADAM_PYTHON", "python3".to_string());
        let mut command = Command::new(&python);
        // The same instruction set cap for torch's kernels as for protrain's.
        if let Ok(isa) = std::env::var(kernels::ISA_CAP_VAR) {
            if std::env::var_os("ATEN_CPU_CAPABILITY").is_none() {
                command.env("ATEN_CPU_CAPABILITY", isa.trim().to_ascii_lowercase());
            }
        }
        let mut child = command
            .arg("-c")
            .arg(TORCH)
            .arg(threads().to_string())
            .arg(steps.to_string())
            .arg(if cpu_clock() { "cpu" } else { "wall" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{python} did not run: {e}"))?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        match lines.next() {
            Some(Ok(line)) if line == "ready" => Ok(Torch { child, lines }),
            _ => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                let _ = child.wait();
                Err(format!(
                    "{python} with torch did not start: {}",
                    err.lines().last().unwrap_or("")
                ))
            }
        }
    }

    /// Parameters/s of torch fused AdamW on `n` parameters, or why there is no answer.
    fn rate(&mut self, n: usize) -> Result<f64, String> {
        let stdin = self.child.stdin.as_mut().expect("piped");
        writeln!(stdin, "{n}").map_err(|e| format!("torch: {e}"))?;
        stdin.flush().map_err(|e| format!("torch: {e}"))?;
        let line = self
            .lines
            .next()
            .ok_or("torch ended early")?
            .map_err(|e| format!("torch: {e}"))?;
        line.split_whitespace()
            .nth(1)
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| format!("torch printed {line:?}"))
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// One round's rates (parameters/s) on one size.
#[derive(Clone, Copy)]
struct Rates {
    f32: f64,
    bf16: f64,
    in_low: f64,
    copy: f64,
    torch: Option<f64>,
}

/// Median seconds of `steps` AdamW steps of `p` from `grad`, writing the bf16 copy to `low`
/// when given.
fn adam_seconds(
    steps: usize,
    config: &AdamWConfig,
    p: &mut [f32],
    grad: Grad<'_>,
    m: &mut [f32],
    v: &mut [f32],
    mut low: Option<&mut [bf16]>,
) -> f64 {
    time(steps, |step| {
        let narrow = low.as_deref_mut().map(kernels::Low::Bf16);
        kernels::adamw_step_fused(p, grad, None, m, v, narrow, step, config);
        black_box(&mut *p);
    })
}

/// Times protrain's three forms and the copy on `n` parameters, `steps` steps each.
fn protrain_rates(n: usize, steps: usize, threads: usize, config: &AdamWConfig) -> Rates {
    let mut p = wave(n, 1);
    let g = wave(n, 2).iter().map(|x| x * 1e-2).collect::<Vec<f32>>();
    let g16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut low = vec![bf16::ZERO; n];
    let f32_s = adam_seconds(steps, config, &mut p, Grad::F32(&g), &mut m, &mut v, None);
    let bf16_s = adam_seconds(
        steps,
        config,
        &mut p,
        Grad::Bf16(&g16),
        &mut m,
        &mut v,
        Some(&mut low),
    );
    // The gradient in the parameter storage; each step leaves the new parameter there, which
    // the next step reads as its gradient: other values, the same work.
    low.copy_from_slice(&g16);
    let in_low_s = adam_seconds(
        steps,
        config,
        &mut p,
        Grad::InLow,
        &mut m,
        &mut v,
        Some(&mut low),
    );
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
    Rates {
        f32: rate(f32_s),
        bf16: rate(bf16_s),
        in_low: rate(in_low_s),
        copy: rate(copy_s),
        torch: None,
    }
}

fn main() {
    let steps: usize = env("ADAM_STEPS", 20);
    let rounds: usize = env("ADAM_ROUNDS", 5usize).max(1);
    let sizes: Vec<usize> = env("ADAM_SIZES", "4194304,33554432".to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let threads = threads();
    let config = AdamWConfig::default();
    println!(
        "adam: {threads} threads, median of {steps} steps ({} time), {rounds} rounds; parameters/s \
         (M), ratios within each round; {}={}",
        if cpu_clock() { "CPU" } else { "wall" },
        kernels::ISA_CAP_VAR,
        std::env::var(kernels::ISA_CAP_VAR).unwrap_or_else(|_| "(unset: the widest)".into())
    );
    let mut torch = Torch::start(steps)
        .map_err(|why| println!("torch fused: skipped ({why})"))
        .ok();
    let mut all: Vec<Vec<Rates>> = vec![Vec::new(); sizes.len()];
    for round in 1..=rounds {
        for (i, &n) in sizes.iter().enumerate() {
            let t = torch.as_mut().map(|t| t.rate(n)).transpose();
            let t = t.unwrap_or_else(|why| {
                println!("torch fused: stopped ({why})");
                torch = None;
                None
            });
            let mut r = protrain_rates(n, steps, threads, &config);
            r.torch = t;
            let vs_torch = |x: f64| t.map_or("-".into(), |t| format!("{:.2}x", x / t));
            println!(
                "round {round} n={n}: f32 {:.0}, bf16 {:.0}, bf16 in place {:.0}, copy {:.0}, \
                 torch {}; /torch: f32 {}, bf16 {}, in place {}",
                r.f32 / 1e6,
                r.bf16 / 1e6,
                r.in_low / 1e6,
                r.copy / 1e6,
                t.map_or("-".into(), |t| format!("{:.0}", t / 1e6)),
                vs_torch(r.f32),
                vs_torch(r.bf16),
                vs_torch(r.in_low),
            );
            all[i].push(r);
        }
    }
    println!("median over rounds:");
    for (&n, rs) in sizes.iter().zip(&all) {
        let med = |f: &dyn Fn(&Rates) -> f64| median(rs.iter().map(f).collect());
        let gb = |r: f64| r * 28.0 / 1e9;
        let (f, b, l, c) = (
            med(&|r| r.f32),
            med(&|r| r.bf16),
            med(&|r| r.in_low),
            med(&|r| r.copy),
        );
        println!(
            "n={n}: protrain f32 {:.0} ({:.1} GB/s), bf16 {:.0} ({:.1} GB/s), bf16 in place {:.0} \
             ({:.1} GB/s), copy {:.0} ({:.1} GB/s)",
            f / 1e6,
            gb(f),
            b / 1e6,
            gb(b),
            l / 1e6,
            gb(l),
            c / 1e6,
            gb(c)
        );
        print!(
            "  protrain/copy: f32 {:.2}x, bf16 {:.2}x, bf16 in place {:.2}x",
            med(&|r| r.f32 / r.copy),
            med(&|r| r.bf16 / r.copy),
            med(&|r| r.in_low / r.copy),
        );
        if rs.iter().all(|r| r.torch.is_some()) {
            let t = |r: &Rates| r.torch.unwrap_or(f64::NAN);
            println!(
                "; torch fused {:.0}; protrain/torch: f32 {:.2}x, bf16 {:.2}x, bf16 in place \
                 {:.2}x",
                med(&|r| t(r)) / 1e6,
                med(&|r| r.f32 / t(r)),
                med(&|r| r.bf16 / t(r)),
                med(&|r| r.in_low / t(r)),
            );
        } else {
            println!();
        }
    }
}
