#!/usr/bin/env bash
# Everything CI runs on the CUDA simulator, in order: the simulator's own strictness checks,
# the backend's kernel and end-to-end tests (also under three chaos seeds), and the CLI's
# 20-step gpt2-tiny run against the host backend. Run from anywhere; needs the Rust toolchain,
# g++ 12+, python3 with pip (NVRTC's wheel). Its environment stays inside this script, so what
# runs after it does not see the simulator.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash cuda-sim/test.sh
eval "$(bash scripts/cuda-sim-env.sh)"
# The device tests are `#[ignore = "needs a GPU or the CUDA simulator"]`: --include-ignored
# runs them here, on the simulator.
cargo test --features cuda -p protrain-runtime --test cuda --test cuda_probe --test nccl -- --include-ignored
cargo test --features cuda --test cuda_e2e -- --include-ignored
for seed in 1 2 3; do
  PROTRAIN_CUDA_SIM_CHAOS=$seed cargo test --features cuda --test cuda_e2e -- --include-ignored
done
cargo build --features cuda
bash cuda-sim/e2e.sh target/debug/protrain
