#!/usr/bin/env bash
# Trains gpt2-tiny for 20 steps in f32 with the CUDA backend on the simulator and with the host
# backend, and fails unless every step's loss agrees within 1e-5 relative. Takes the protrain
# binary (built with --features cuda) as $1, default target/debug/protrain; extra arguments go
# to both `train` runs (a policy, --gpu-memory). Set PROTRAIN_CUDA_SIM_CHAOS to run the CUDA
# side in chaos mode. About 1.5 CPU-minutes in a debug build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$root/target/debug/protrain}"
shift || true
eval "$(bash "$root/scripts/cuda-sim-env.sh")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
common=(train gpt2-tiny --dtype f32 --steps 20 --json "$@")
timeout 1800 "$bin" "${common[@]}" --backend cuda > "$tmp/cuda.json"
timeout 600 "$bin" "${common[@]}" --backend host > "$tmp/host.json"
python3 - "$tmp/host.json" "$tmp/cuda.json" <<'PY'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            d = json.loads(line)
            if "loss" in d and "step" in d:
                out[d["step"]] = d["loss"]
    return out
host, cuda = losses(sys.argv[1]), losses(sys.argv[2])
if sorted(host) != list(range(1, 21)) or sorted(cuda) != sorted(host):
    sys.exit(f"steps differ: host {sorted(host)}, cuda {sorted(cuda)}")
worst = max(abs(cuda[s] - host[s]) / abs(host[s]) for s in host)
print(f"gpt2-tiny f32, 20 steps: largest relative loss difference cuda-sim vs host {worst:.2e}")
if not worst <= 1e-5:
    sys.exit("the CUDA backend on the simulator does not give the host backend's losses (1e-5)")
PY
