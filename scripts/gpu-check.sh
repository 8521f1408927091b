#!/usr/bin/env bash
# The CUDA backend's checks that need a GPU (an H200 with driver 580 / CUDA 13.0 in mind):
#
#   1. every kernel family against the host kernel (runtime/tests/it/cuda.rs);
#   2. tiny GPT-2 and LLaMA models: 3 steps on the GPU against the host backend in f32 under
#      three policies (the first step and the first update's weights tightly, later losses
#      within a bound derived from the host's run), and bf16 losses close to them
#      (tests/it/cuda_e2e.rs);
#   3. a GPT-2 1.5B-shaped model (gpt2-xl) trained in bf16 fully resident, then under
#      --gpu-memory 12GiB (which streams chunks and recomputes or swaps layers);
#   4. a LLaMA 13B-shaped model (llama-2-13b's width: hidden 5120, 40 heads, MLP 13824) whose
#      model states do not fit in its device budget, so most of them live in pinned host
#      memory and the CPU Adam updates them;
#   5. NCCL in a world of one rank (runtime/tests/it/nccl.rs; one H200 cannot host two ranks):
#      the communicator, its collectives at device addresses, and the CUDA backend's
#      collective stream, each an exact copy. libnccl comes from the nvidia-nccl-cu13 wheel
#      (through a libnccl.so link, since cudarc does not look for libnccl.so.2) or the system.
#
# For each training run it prints tokens/s, achieved TFLOP/s (the step's FLOPs, as the
# compiler counts them, over the measured step), MFU against the h200 preset's bf16 peak
# (989 TFLOP/s, NVIDIA's datasheet) and the predicted against the measured step time, then a
# summary. Each part has its own `timeout`; the limits add up to 240 s, so that a device
# session of 15 minutes holds a machine start, one run and one rerun. The exit status is
# non-zero when a part fails; the performance targets (40% MFU resident, 60% of
# the resident tokens/s under 12 GiB, predicted step within 10%) are reported, not enforced.
#
#   bash scripts/gpu-check.sh                 # build here (needs cargo), then check
#   bash scripts/gpu-check.sh --bundle        # on a build machine: build the binaries into
#                                             # target/gpu-check/bin, for a GPU machine
#                                             # without a Rust toolchain
#   bash scripts/gpu-check.sh --bundled       # run the binaries in target/gpu-check/bin, even
#                                             # where cargo exists (no build on the GPU's time)
#
# Logs. Every part's full log, the build's, the JSON figures and summary.txt go to $OUT when
# it is set (the device machine's output folder), else to the work folder; the terminal gets
# only each part's last lines, so the whole transcript fits a 12 KB reply. The terminal
# transcript itself is also teed to gpu-check.log there.
#
# The exact call on a device machine (the `run` tool), from the repository root:
#
#   here:   bash scripts/gpu-check.sh --bundle
#   run:    carry ["target/gpu-check/bin"], timeout_s 330, command
#           chmod +x target/gpu-check/bin/* && bash scripts/gpu-check.sh --bundled
#
# (the carried files lose their executable bit, hence the chmod; 330 s is the 240 s of parts
# plus the library probe and slack, leaving the session time for a rerun). To run one test
# binary by hand, source the NVRTC environment first: NVRTC loads its builtins library
# (libnvrtc-builtins.so.13, beside libnvrtc.so.13) through LD_LIBRARY_PATH, and without it
# every kernel compile fails:
#
#   source <(bash scripts/nvrtc-env.sh) && target/gpu-check/bin/runtime-tests --include-ignored cuda::attention
#
# Libraries: cudarc loads libcuda (the driver's), libcublas.so.13 and libnvrtc.so.13 at run
# time. They are looked for in the pip wheels of `python3` (nvidia/cu13/lib, as PyTorch for
# CUDA 13 installs them; scripts/nvrtc-env.sh) and in the CUDA toolkit (/usr/local/cuda),
# and put on LD_LIBRARY_PATH. Nothing is downloaded.
#
# Environment: PROTRAIN_GPU_CHECK_DIR (work folder, default target/gpu-check), OUT (where the
# logs go, default the work folder), LLAMA_LAYERS (layers of the 13B-shaped model, default 2;
# 40 is the real depth, whose 210 GB of model state cannot be split between a 141 GB device
# and 128 GiB of host memory that also holds the 52 GB of f32 initial weights the CLI draws,
# and whose initial weights take minutes to draw on one core).
set -uo pipefail
cd "$(dirname "$0")/.."

WORK="${PROTRAIN_GPU_CHECK_DIR:-target/gpu-check}"
BIN_DIR="$WORK/bin"
LOGS="${OUT:-$WORK}"
mkdir -p "$WORK" "$LOGS"

# The h200 preset's dense bf16 peak (ir/src/hardware.rs), for MFU.
H200_BF16_PEAK=989e12

say() { printf '%s\n' "$*" >&2; }

# ---------------------------------------------------------------------------------------
# Building.

# Release binaries: the CLI and the two test executables that hold the GPU tests (the
# runtime's and the CLI crate's, one per crate), paths printed one per line as `NAME PATH`.
build() {
  cargo build --release --features cuda --bin protrain >&2 || return 1
  echo "protrain target/release/protrain"
  local json
  json=$(cargo test --release --features cuda -p protrain-runtime --test it --no-run \
    --message-format=json) || { say "building the runtime's tests failed"; return 1; }
  echo "runtime-tests $(test_executable <<<"$json")"
  json=$(cargo test --release --features cuda -p protrain --test it --no-run \
    --message-format=json) || { say "building the end-to-end tests failed"; return 1; }
  echo "protrain-tests $(test_executable <<<"$json")"
}

# The executable of the test target `it` in cargo's JSON messages on standard input.
test_executable() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "it":
        print(m["executable"])'
}

BUNDLED=0
if [[ "${1:-}" == "--bundled" ]]; then
  BUNDLED=1
elif [[ "${1:-}" == "--bundle" ]]; then
  mkdir -p "$BIN_DIR"
  built=$(build) || { say "gpu-check: the build failed"; exit 1; }
  while read -r name path; do
    [[ -n "$path" && -x "$path" ]] || { say "gpu-check: no executable for $name"; exit 1; }
    cp "$path" "$BIN_DIR/$name"
    command -v strip >/dev/null && strip --strip-debug "$BIN_DIR/$name"
  done <<<"$built"
  du -sh "$BIN_DIR" >&2
  say "gpu-check: bundle in $BIN_DIR; carry it to the GPU machine and run scripts/gpu-check.sh there"
  exit 0
elif [[ -n "${1:-}" ]]; then
  say "usage: bash scripts/gpu-check.sh [--bundle | --bundled]"
  exit 2
fi

# The transcript, as the terminal sees it, into the logs too.
exec > >(tee -a "$LOGS/gpu-check.log") 2> >(tee -a "$LOGS/gpu-check.log" >&2)

# ---------------------------------------------------------------------------------------
# Libraries.

add_lib_dir() {
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$1:"*) ;;
    *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
}

if env_lines=$(bash scripts/nvrtc-env.sh 2>/dev/null); then
  eval "$env_lines"
fi
site_dirs=$(python3 -c 'import site, sys
dirs = list(site.getsitepackages()) + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")]
print("\n".join(dict.fromkeys(dirs)))' 2>/dev/null || true)
for lib in libnvrtc.so.13 libcublas.so.13; do
  found=""
  while IFS= read -r dir; do
    for cand in "$dir/nvidia/cu13/lib" "$dir/nvidia/cublas/lib" "$dir/nvidia/cuda_nvrtc/lib"; do
      if [[ -z "$found" && -n "$dir" && -e "$cand/$lib" ]]; then found="$cand"; fi
    done
  done <<<"$site_dirs"
  for cand in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/lib64; do
    if [[ -z "$found" && -e "$cand/$lib" ]]; then found="$cand"; fi
  done
  if [[ -n "$found" ]]; then
    add_lib_dir "$found"
    say "gpu-check: $lib from $found"
  else
    say "gpu-check: $lib not found (install the CUDA 13 toolkit or the nvidia-cublas / nvidia-cuda-nvrtc wheels); the checks will say what is missing"
  fi
done
for cand in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
  [[ -e "$cand/libcuda.so.1" ]] && add_lib_dir "$cand"
done
# NCCL: cudarc looks for libnccl.so, the nvidia-nccl-cu13 wheel installs only libnccl.so.2
# (runtime/src/cuda/nccl.rs), so a link named libnccl.so in the work folder points at it.
nccl_found=0
if ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_found=1
else
  nccl=""
  while IFS= read -r dir; do
    for cand in "$dir/nvidia/nccl/lib" "$dir/nvidia/cu13/lib"; do
      if [[ -z "$nccl" && -n "$dir" && -e "$cand/libnccl.so.2" ]]; then nccl="$cand/libnccl.so.2"; fi
    done
  done <<<"$site_dirs"
  if [[ -n "$nccl" ]]; then
    mkdir -p "$WORK/nccl" && ln -sf "$nccl" "$WORK/nccl/libnccl.so"
    add_lib_dir "$(cd "$WORK/nccl" && pwd)"
    nccl_found=1
    say "gpu-check: libnccl.so -> $nccl"
  else
    say "gpu-check: no NCCL (pip install nvidia-nccl-cu13); the nccl part is not run and counts as failed"
  fi
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 ||
  say "gpu-check: nvidia-smi failed; is there a GPU?"

# ---------------------------------------------------------------------------------------
# The parts, each timed and logged.

declare -a SUMMARY=()
FAILED=0
started=$(date +%s)

# part NAME SECONDS COMMAND...: runs COMMAND under `timeout`, its output in $LOGS/NAME.log.
part() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS status
  say ""
  say "== $name (at most ${limit} s)"
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  status=$?
  local took=$((SECONDS - t0))
  tail -n 12 "$LOGS/$name.log" >&2
  case $status in
    0) SUMMARY+=("$(printf '%-22s ok       %4d s' "$name" "$took")") ;;
    124 | 137) SUMMARY+=("$(printf '%-22s TIMEOUT  %4d s (limit %d s; log %s)' "$name" "$took" "$limit" "$LOGS/$name.log")"); FAILED=1 ;;
    *) SUMMARY+=("$(printf '%-22s FAILED   %4d s (exit %d; log %s)' "$name" "$took" "$status" "$LOGS/$name.log")"); FAILED=1 ;;
  esac
  return $status
}

if [[ $BUNDLED == 0 ]] && command -v cargo >/dev/null 2>&1; then
  t0=$SECONDS
  if built=$(build 2>"$LOGS/build.log"); then
    mkdir -p "$BIN_DIR"
    while read -r name path; do cp "$path" "$BIN_DIR/$name"; done <<<"$built"
    SUMMARY+=("$(printf '%-22s ok       %4d s (not counted in the 240 s)' build $((SECONDS - t0)))")
  else
    tail -n 40 "$LOGS/build.log" >&2
    say "gpu-check: cargo build --release --features cuda failed"
    exit 1
  fi
  # The test binaries as cargo runs them (cargo test also builds nothing more now).
  # The device tests are `#[ignore = "needs a GPU or the CUDA simulator"]` (so that a
  # machine with neither never passes them by skipping): --include-ignored runs them here.
  kernel_tests=(cargo test --release --features cuda -p protrain-runtime --test it -- --include-ignored cuda::)
  nccl_tests=(cargo test --release --features cuda -p protrain-runtime --test it -- --include-ignored nccl::)
  e2e_tests=(cargo test --release --features cuda -p protrain --test it -- --include-ignored cuda_e2e::)
elif [[ -x "$BIN_DIR/protrain" ]]; then
  say "gpu-check: using the binaries in $BIN_DIR"
  kernel_tests=("$BIN_DIR/runtime-tests" --include-ignored cuda::)
  nccl_tests=("$BIN_DIR/runtime-tests" --include-ignored nccl::)
  e2e_tests=("$BIN_DIR/protrain-tests" --include-ignored cuda_e2e::)
else
  say "gpu-check: no cargo (or --bundled) and no executable $BIN_DIR/protrain; install Rust, or run"
  say "  bash scripts/gpu-check.sh --bundle"
  say "on an x86-64 build machine, bring $BIN_DIR along and chmod +x its files"
  exit 1
fi
PROTRAIN="$BIN_DIR/protrain"

# Time limits add up to 240 s (4 minutes), so that a device session holds a machine start,
# the check and a rerun even when every part runs into its limit.
part kernel-tests 40 "${kernel_tests[@]}"
part e2e-tests 55 "${e2e_tests[@]}"
# A world of one NCCL rank (one H200 cannot host two): the rendezvous, ncclCommInitRank, the
# three collectives at raw device addresses, and the CUDA backend's in-place collectives on a
# collective stream with the rank's host collectives, each an exact copy (the backend compiles
# its kernels with NVRTC first). The test binary passes without libnccl by naming what is
# missing, so without NCCL the part is not run and counts as failed.
if [[ $nccl_found == 1 ]]; then
  part nccl-one-rank 15 "${nccl_tests[@]}"
else
  SUMMARY+=("$(printf '%-22s MISSING  libnccl.so not found (pip install nvidia-nccl-cu13)' nccl-one-rank)")
  FAILED=1
fi

# train NAME SECONDS MODEL BATCH SEQ STEPS COMPILE_FLAGS...: compiles MODEL in bf16 for the
# h200 preset and runs it on the GPU; its figures go to $LOGS/NAME.json.
train() {
  local name=$1 limit=$2 model=$3 batch=$4 seq=$5 steps=$6
  shift 6
  local sched="$WORK/$name.ptsched"
  part "$name" "$limit" bash -c '
    set -euo pipefail
    protrain=$1 model=$2 batch=$3 seq=$4 steps=$5 sched=$6 out=$7
    shift 7
    "$protrain" compile "$model" --hardware h200 --dtype bf16 --batch "$batch" --seq "$seq" \
      --host-memory 96GiB "$@" -o "$sched" --json > "$out.compile.json"
    cat "$out.compile.json"
    "$protrain" run "$sched" --backend cuda --steps "$steps" --log-json \
      > "$out.steps.jsonl" 2> "$out.run.stderr" || { cat "$out.run.stderr"; exit 1; }
    cat "$out.run.stderr" "$out.steps.jsonl"
  ' _ "$PROTRAIN" "$model" "$batch" "$seq" "$steps" "$sched" "$LOGS/$name" "$@" || return 1
  python3 - "$LOGS/$name" "$H200_BF16_PEAK" "$batch" "$seq" > "$LOGS/$name.json" <<'PY'
import json, sys
base, peak, batch, seq = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
compiled = json.load(open(base + ".compile.json"))
steps = [json.loads(l) for l in open(base + ".steps.jsonl") if l.strip()]
# The step's FLOPs as the compiler counts them (its predicted rate times its predicted time).
predicted = compiled["predicted_step_s"]
flops = compiled["tflops"] * 1e12 * predicted
# As `protrain run` reports it: the mean over the steps after the first (which compiles
# nothing but meets cold caches, first-use scratch allocations and cuBLAS's heuristics).
times = [s["step_s"] for s in steps]
measured = sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0]
achieved = flops / measured
print(json.dumps({
    "policy": compiled["policy"],
    "device_bytes": compiled["peak_device_bytes"],
    "host_bytes": compiled["host_bytes"],
    "tokens_per_s": batch * seq / measured,
    "tflops": achieved / 1e12,
    "mfu": achieved / peak,
    "predicted_step_s": predicted,
    "measured_step_s": measured,
    "losses": [s["loss"] for s in steps],
}))
PY
  python3 - "$LOGS/$name.json" "$name" >&2 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]}: {r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.1f} TFLOP/s, "
      f"MFU {100 * r['mfu']:.1f}%, step predicted {r['predicted_step_s']:.3f} s, measured "
      f"{r['measured_step_s']:.3f} s ({100 * (r['predicted_step_s'] / r['measured_step_s'] - 1):+.1f}%); "
      f"policy {r['policy']}; losses {', '.join(f'{l:.4f}' for l in r['losses'])}")
PY
}

# Each run spends its first 10-30 s drawing the initial weights on one host core
# (runtime/src/params.rs) and compiling the kernels; a few steps follow, the first of which
# the step-time figures leave out.
# GPT-2 XL, batch 4 x 1024: about 25 GB of model states and 10 GB of activations resident.
train gpt2-xl-resident 45 gpt2-xl 4 1024 3
# The same under a 12 GiB device budget: chunks streamed from pinned host memory, layers
# recomputed or swapped, offloaded chunks updated by the CPU Adam during the backward pass.
train gpt2-xl-12gib 45 gpt2-xl 4 1024 3 --gpu-memory 12GiB

# LLaMA-2-13B's width at LLAMA_LAYERS layers (1.0 B parameters at 2), under a 12 GiB budget
# that its model states (16 bytes a parameter in bf16 with f32 master weights and moments,
# 16 GB at 2 layers) exceed.
layers="${LLAMA_LAYERS:-2}"
llama_dir="$WORK/llama-13b-shaped"
mkdir -p "$llama_dir"
cat > "$llama_dir/config.json" <<JSON
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 5120,
  "intermediate_size": 13824,
  "num_attention_heads": 40,
  "num_key_value_heads": 40,
  "num_hidden_layers": $layers,
  "vocab_size": 32000,
  "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false
}
JSON
train llama-13b-shaped 40 "$llama_dir" 2 1024 3 --gpu-memory 12GiB

# ---------------------------------------------------------------------------------------
# Summary.

elapsed=$(($(date +%s) - started))
{
  echo ""
  echo "== gpu-check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1), ${elapsed} s after the build)"
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  python3 - "$LOGS" <<'PY'
import json, os, sys
work = sys.argv[1]
def load(name):
    p = os.path.join(work, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
runs = {n: load(n) for n in ["gpt2-xl-resident", "gpt2-xl-12gib", "llama-13b-shaped"]}
print(f"  {'run':<20}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'pred s':>9}{'meas s':>9}{'pred/meas':>10}")
for n, r in runs.items():
    if r is None:
        print(f"  {n:<20}  (no result)")
        continue
    print(f"  {n:<20}{r['tokens_per_s']:>10.0f}{r['tflops']:>9.1f}{100 * r['mfu']:>6.1f}%"
          f"{r['predicted_step_s']:>9.3f}{r['measured_step_s']:>9.3f}"
          f"{r['predicted_step_s'] / r['measured_step_s']:>10.2f}")
res, tight = runs["gpt2-xl-resident"], runs["gpt2-xl-12gib"]
targets = []
if res:
    targets.append(("resident GPT-2 1.5B at >= 40% MFU", res["mfu"] >= 0.40, f"{100 * res['mfu']:.1f}%"))
if res and tight:
    ratio = tight["tokens_per_s"] / res["tokens_per_s"]
    targets.append(("12 GiB at >= 60% of resident tokens/s", ratio >= 0.60, f"{100 * ratio:.0f}%"))
for n, r in runs.items():
    if r:
        err = abs(r["predicted_step_s"] / r["measured_step_s"] - 1)
        targets.append((f"{n} predicted within 10%", err <= 0.10, f"{100 * err:.1f}% off"))
for what, ok, value in targets:
    print(f"  target {'met   ' if ok else 'MISSED'} {what}: {value}")
PY
} | tee "$LOGS/summary.txt"
exit $FAILED
