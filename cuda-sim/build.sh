#!/usr/bin/env bash
# Builds the CUDA simulator into $1 (default target/cuda-sim): lib/libcudasim.so, installed
# under the names cudarc dlopens (libcuda.so, libcuda.so.1, libcublas.so, libcublas.so.13,
# libcublasLt.so, libcublasLt.so.13, libnccl.so, and NCCL's soname libnccl.so.2), and bin/strict, its own test program. Rebuilds only when
# a source (the simulator's, a kernel's, or the intrinsics it shares with the emulation
# harness) is newer than the library. Needs g++ 12 or newer
# (C++20) on x86-64 Linux. Prints nothing on success.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/target/cuda-sim}"
lib="$out/lib/libcudasim.so"
sources=("$root"/cuda-sim/src/* "$root"/cuda-sim/tests/* "$root"/runtime/src/cuda/kernels/* "$root"/runtime/src/cuda/emu/intrinsics.h "$root"/runtime/src/cuda/mod.rs "$root"/cuda-sim/build.sh)
if [[ -e "$lib" && -e "$out/bin/strict" ]]; then
  stale=0
  for s in "${sources[@]}"; do [[ "$s" -nt "$lib" ]] && stale=1 && break; done
  [[ $stale == 0 ]] && exit 0
fi
mkdir -p "$out/lib" "$out/bin" "$out/gen"
# Every `extern "C" __global__` entry point, for the simulator's kernel table.
grep -ho 'extern "C" __global__ void [A-Za-z_0-9]*' "$root"/runtime/src/cuda/kernels/*.cu "$root"/cuda-sim/tests/test_kernels.cuh \
  | sed 's/.* void \(.*\)/K(\1)/' > "$out/gen/kernels.inc.tmp"
mv "$out/gen/kernels.inc.tmp" "$out/gen/kernels.inc"
# The kernels' compile-time constants, exactly as runtime/src/cuda/mod.rs gives NVRTC.
defines=$(sed -n '/^pub const KERNEL_DEFINES/,/^];/p' "$root/runtime/src/cuda/mod.rs" \
  | sed -n 's/.*("\([A-Z_0-9]*\)", *\([0-9]*\)).*/-D\1=\2/p' | tr '\n' ' ')
[[ -n "$defines" ]] || { echo "cuda-sim/build.sh: no KERNEL_DEFINES found in runtime/src/cuda/mod.rs" >&2; exit 1; }
flags=(-std=c++20 -O2 -g -fPIC -pthread -fvisibility=hidden -ffp-contract=off -Wall -Wno-unknown-pragmas -Wno-unused-function)
objs=()
for src in driver cublas fiber nccl; do
  # shellcheck disable=SC2086
  g++ "${flags[@]}" $defines -I"$out/gen" -c "$root/cuda-sim/src/$src.cpp" -o "$out/gen/$src.o"
  objs+=("$out/gen/$src.o")
done
g++ -shared -pthread -Wl,-soname,libcuda.so.1 -o "$lib.tmp" "${objs[@]}"
mv "$lib.tmp" "$lib"
for name in libcuda.so libcuda.so.1 libcublas.so libcublas.so.13 libcublasLt.so libcublasLt.so.13 libnccl.so libnccl.so.2; do
  ln -sfn libcudasim.so "$out/lib/$name"
done
g++ -std=c++20 -O1 -g -pthread -o "$out/bin/strict" "$root/cuda-sim/tests/strict.cpp" -ldl
