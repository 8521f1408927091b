#!/usr/bin/env bash
# Prints the `export` lines a shell needs so that cudarc (feature `cuda`) finds NVRTC from the
# PyPI wheel, for the kernel compile check on machines without a CUDA toolkit:
#
#   source <(bash scripts/nvrtc-env.sh --install)
#   cargo test -p protrain-runtime --features cuda --test it -- nvrtc::
#
# Source it too before running a CUDA test binary by hand (target/gpu-check/bin/runtime-tests,
# protrain-tests): libnvrtc loads libnvrtc-builtins.so.13 through LD_LIBRARY_PATH, so without these
# lines every kernel compile fails even where libnvrtc itself is found.
#
# With --install it first installs the pinned wheels below, if they are not there yet, with
# `pip install --target` into $PROTRAIN_NVRTC_PREFIX (default ~/.cache/protrain/nvrtc), apart
# from any Python environment (torch pins its own NVRTC; this leaves it alone). The pin is
# CUDA 13.0, the version of the H200 machines' driver (580): PTX from a newer NVRTC has a PTX
# ISA that driver cannot JIT (13.2 emits `.version 9.2`; 13.0 drivers take up to 9.0).
#
# It looks for nvidia/cu13/lib/libnvrtc.so.13 under $PROTRAIN_NVRTC_PREFIX first, then in the
# site-packages of `python3` (or $PYTHON): an NVRTC installed any other way with
# `pip install nvidia-cuda-nvrtc` also works for the compile check.
# cudarc's loader tries libnvrtc.so and libnvrtc.so.13 among other names, so putting the
# wheel's lib folder on LD_LIBRARY_PATH is enough (libnvrtc finds its libnvrtc-builtins there
# too). If the nvidia-cuda-runtime wheel is there as well, its include folder (cuda_bf16.h,
# cuda_fp16.h) is exported as PROTRAIN_CUDA_INCLUDE, which the compile passes to NVRTC; the
# kernels need no header today.
# On failure it prints nothing to stdout, says what to install on stderr, and exits 1.
set -euo pipefail

NVRTC_WHEELS=("nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.96")
prefix="${PROTRAIN_NVRTC_PREFIX:-$HOME/.cache/protrain/nvrtc}"

if [[ "${1:-}" == "--install" ]]; then
  if [[ ! -e "$prefix/nvidia/cu13/lib/libnvrtc.so.13" ]]; then
    "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
      --target "$prefix" "${NVRTC_WHEELS[@]}" >&2
  fi
elif [[ -n "${1:-}" ]]; then
  echo "usage: bash scripts/nvrtc-env.sh [--install]" >&2
  exit 2
fi

roots=("$prefix")
python="${PYTHON:-python3}"
if command -v "$python" >/dev/null 2>&1; then
  while IFS= read -r dir; do
    [[ -n "$dir" ]] && roots+=("$dir")
  done < <("$python" - <<'PY' 2>/dev/null || true
import site, sys
dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
dirs.append(site.getusersitepackages())
dirs.extend(p for p in sys.path if p.endswith("-packages"))
seen = set()
for d in dirs:
    if d not in seen:
        seen.add(d)
        print(d)
PY
)
fi

lib=""
include=""
for root in "${roots[@]}"; do
  if [[ -z "$lib" && -e "$root/nvidia/cu13/lib/libnvrtc.so.13" ]]; then
    lib="$root/nvidia/cu13/lib"
  fi
  if [[ -z "$include" && -e "$root/nvidia/cu13/include/cuda_bf16.h" ]]; then
    include="$root/nvidia/cu13/include"
  fi
done

if [[ -z "$lib" ]]; then
  {
    echo "nvrtc-env.sh: no nvidia/cu13/lib/libnvrtc.so.13 found under: ${roots[*]:-(no python3)}"
    echo "install NVRTC from PyPI first: run this script with --install, which runs"
    echo "  pip install --target $prefix ${NVRTC_WHEELS[*]}"
  } >&2
  exit 1
fi

printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$lib"
if [[ -n "$include" ]]; then
  printf 'export PROTRAIN_CUDA_INCLUDE=%q\n' "$include"
fi
