#!/usr/bin/env bash
# Builds the CUDA simulator if needed and runs its own strictness tests (cuda-sim/tests/strict.cpp)
# against it. About a minute on two cores, most of it the first build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/cuda-sim/build.sh" "$root/target/cuda-sim"
LD_LIBRARY_PATH="$root/target/cuda-sim/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  timeout 600 "$root/target/cuda-sim/bin/strict" "$@"
