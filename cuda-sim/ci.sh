#!/usr/bin/env bash
# Everything CI runs on the CUDA simulator, in order: the simulator's own strictness checks,
# the backend's kernel, NCCL (two real processes, a killed rank) and end-to-end tests (the
# schedule-level ones also under three chaos seeds; the CLI's, with the launcher's worker
# processes, checkpoints resumed across backends, two and four ranks, bf16 and f16), and the
# CLI's 20-step gpt2-tiny run against the host backend. Each part's time is printed. Run from anywhere; needs the Rust toolchain,
# g++ 12+, python3 with pip (NVRTC's wheel). Its environment stays inside this script, so what
# runs after it does not see the simulator.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part_start=$SECONDS
part() {
  echo "cuda-sim/ci.sh: $1 took $((SECONDS - part_start)) s"
  part_start=$SECONDS
}
bash cuda-sim/test.sh
eval "$(bash scripts/cuda-sim-env.sh)"
part "the simulator's build and strictness checks"
# The device tests are `#[ignore = "needs a GPU or the CUDA simulator"]`: --include-ignored
# runs them here, on the simulator.
cargo test --features cuda -p protrain-runtime --test it -- --include-ignored cuda:: cuda_probe:: nccl::
part "kernel, probe and NCCL tests"
cargo test --features cuda --test it -- --include-ignored cuda_e2e::
part "end-to-end tests"
# Chaos mode reorders the streams of the schedule-level tests; the CLI tests (cli_*), which
# start processes of their own, ran once above, and one of them two ranks under chaos below.
for seed in 1 2 3; do
  PROTRAIN_CUDA_SIM_CHAOS=$seed cargo test --features cuda --test it -- --include-ignored cuda_e2e:: \
    --skip cli_ --skip chaos_mode_catches --skip counters_per_step
done
PROTRAIN_CUDA_SIM_CHAOS=1 cargo test --features cuda --test it -- --include-ignored \
  --exact cuda_e2e::cli_two_ranks_sharded_give_the_hosts_losses
part "end-to-end tests under chaos seeds 1-3"
cargo build --features cuda
bash cuda-sim/e2e.sh target/debug/protrain
part "the CLI's 20 steps against the host"
