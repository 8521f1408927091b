#!/usr/bin/env bash
# Prints the `export` lines that make the CUDA backend run on the CPU simulator (cuda-sim/):
#
#   eval "$(bash scripts/cuda-sim-env.sh)"
#   cargo build --features cuda && target/debug/protrain train gpt2-tiny --backend cuda
#
# It builds the simulator into target/cuda-sim if a source changed, puts target/cuda-sim/lib
# (libcuda.so, libcublas.so under the names cudarc dlopens) first on LD_LIBRARY_PATH, and adds
# the real NVRTC from the PyPI wheel (scripts/nvrtc-env.sh --install), which compiles the
# kernels as on a GPU machine. Nothing changes on a machine with a real driver unless these
# lines are evaluated. On failure it prints nothing to stdout, says why on stderr, and exits 1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! bash "$root/cuda-sim/build.sh" "$root/target/cuda-sim" >&2; then
  echo "cuda-sim-env.sh: building the simulator failed (it needs g++ 12 or newer on x86-64 Linux)" >&2
  exit 1
fi
nvrtc="$(bash "$root/scripts/nvrtc-env.sh" --install)" || {
  echo "cuda-sim-env.sh: NVRTC is not available (see scripts/nvrtc-env.sh)" >&2
  exit 1
}
echo "$nvrtc"
echo "export LD_LIBRARY_PATH=$root/target/cuda-sim/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
