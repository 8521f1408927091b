#!/usr/bin/env python3
"""The scaling table of benches/RESULTS.md: what the simulator predicts on 1 to 8 GPUs of a kind.

For each setup (a GPU preset, a count of GPUs in one node, the node's host memory) it runs
`protrain compile ... --json` (the release build, made first) and reads what the compiler
predicts; nothing is trained and no GPU is needed:

- tokens/s of llama-2-7b, llama-2-13b and gpt2-xl at sequence length 1024, for the best of the
  batch sizes --batches (per GPU, every rank's tokens counted), or "does not fit";
- the largest model that compiles: LLaMA-2-13B's width (hidden 5120, 40 heads, intermediate
  13824, vocabulary 32000) with as many layers as fit, found by bisection over the layer count
  at batch 1 x seq 1024, in billions of parameters.

Host memory is per node: a preset's node holds at most NODE_GPUS of its GPUs (4 for the
consumer cards), and more are spread over nodes of that many. A setup "fits" a model when `compile --policy auto` finds a policy within the device and host
budgets; any other failure stops the script with the compiler's message.

Usage (from anywhere in the repository):
    python3 benches/scaling_table.py [--gpus 1,2,4,8] [--batches 1,2,4,8,16]
        [--setups rtx3090:384GiB,a100-80gb:1TiB] [--no-largest] [--max-layers 1024]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODELS = ["gpt2-xl", "llama-2-7b", "llama-2-13b"]

# GPUs one node of a preset holds (`protrain compile --gpus` refuses more); more GPUs are
# spread over nodes of this many, each with the setup's host memory.
NODE_GPUS = {"rtx3090": 4, "rtx4090": 4}

# LLaMA-2-13B's width, with the layer count left to fill in.
WIDE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2,4,8", help="GPU counts per node (default 1,2,4,8)")
    p.add_argument(
        "--batches",
        default="1,2,4,8,16",
        help="per-GPU batch sizes tried for tokens/s; the best is reported (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--setups",
        default="rtx3090:384GiB,a100-80gb:1TiB",
        help="PRESET:HOST_MEMORY_PER_NODE pairs (default: ProTrain's 3090 box, 384 GB, and "
        "an A100 node with 1 TB)",
    )
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--no-largest", action="store_true", help="skip the largest-model bisection")
    p.add_argument(
        "--max-layers",
        type=int,
        default=1024,
        help="upper end of the layer bisection (default 1024)",
    )
    return p.parse_args()


def build_protrain():
    """Builds the release binary first, so compiling is not timed."""
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "--bin", "protrain"], cwd=REPO, check=True
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return (REPO / target) / "release" / "protrain"


def compile_json(binary, model, preset, gpus, host, batch, seq, out):
    """The compile summary, or None when no policy fits the budgets."""
    args = [
        str(binary),
        "compile",
        str(model),
        "--hardware",
        preset,
        "--host-memory",
        host,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "-o",
        str(out),
        "--json",
    ]
    per_node = NODE_GPUS.get(preset, gpus)
    if gpus > 1:
        args += ["--gpus", str(min(gpus, per_node))]
    if gpus > per_node:
        args += ["--nodes", str(gpus // per_node)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode == 0:
        return json.loads(done.stdout)
    if "budget" in done.stderr or "does not fit" in done.stderr or "no policy" in done.stderr:
        return None
    sys.exit(f"protrain {' '.join(args[1:])} failed:\n{done.stderr}")


def best_rate(binary, model, preset, gpus, host, batches, seq, out):
    """(tokens/s, batch) of the fastest batch that fits, or None."""
    best = None
    for batch in batches:
        v = compile_json(binary, model, preset, gpus, host, batch, seq, out)
        if v is None:
            break  # a larger batch needs more memory still
        if best is None or v["tokens_per_s"] > best[0]:
            best = (v["tokens_per_s"], batch)
    return best


def largest(binary, preset, gpus, host, seq, max_layers, tmp):
    """(layers, parameters) of the deepest LLaMA-13B-width model that compiles, or None."""
    config_dir = Path(tmp) / "wide"
    config_dir.mkdir(exist_ok=True)
    out = Path(tmp) / "wide.ptsched"

    def fits(layers):
        (config_dir / "config.json").write_text(json.dumps(dict(WIDE, num_hidden_layers=layers)))
        return compile_json(binary, config_dir, preset, gpus, host, 1, seq, out)

    v = fits(1)
    if v is None:
        return None
    lo, hi, found = 1, max_layers + 1, v
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = fits(mid)
        if v is None:
            hi = mid
        else:
            lo, found = mid, v
    return lo, found


def parameters(binary, tmp, layers):
    """The parameter count of the LLaMA-13B-width model with `layers` layers."""
    config_dir = Path(tmp) / "count"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(dict(WIDE, num_hidden_layers=layers)))
    done = subprocess.run(
        [str(binary), "info", str(config_dir), "--json"], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"protrain info failed:\n{done.stderr}")
    return json.loads(done.stdout)["parameters"]


def main():
    args = parse_args()
    gpu_counts = [int(g) for g in args.gpus.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    setups = [tuple(s.split(":")) for s in args.setups.split(",")]
    binary = build_protrain()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.ptsched"
        for preset, host in setups:
            for gpus in gpu_counts:
                per_node = NODE_GPUS.get(preset, gpus)
                nodes = f" ({gpus // per_node} nodes)" if gpus > per_node else ""
                row = [f"{gpus}x {preset}{nodes}, {host} host per node"]
                for model in MODELS:
                    r = best_rate(binary, model, preset, gpus, host, batches, args.seq, out)
                    row.append("does not fit" if r is None else f"{r[0]:,.0f} (batch {r[1]})")
                if not args.no_largest:
                    l = largest(binary, preset, gpus, host, args.seq, args.max_layers, tmp)
                    if l is None:
                        row.append("none")
                    else:
                        n = parameters(binary, tmp, l[0])
                        row.append(f"{n / 1e9:.1f}B ({l[0]} layers)")
                print(" | ".join(row), file=sys.stderr, flush=True)
                rows.append(row)
    header = ["setup"] + [f"{m} tokens/s" for m in MODELS]
    if not args.no_largest:
        header.append("largest 13B-width model")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
