#!/usr/bin/env python3
"""The GPU prediction table of benches/RESULTS.md: predicted MFU and tokens/s per GPU preset,
beside published figures of other trainers.

Every figure this script prints for protrain is a PREDICTION of the compiler's simulator
(`protrain compile --json`), not a measurement: nothing is trained and no GPU is needed. They
stay predictions until `scripts/gpu-check.sh` has run the same schedules on the GPU.

MFU counts 6N + 12·L·d·T FLOPs per token (N parameters, L layers, d hidden, T sequence length;
the attention term with the causal mask counted once, as PaLM's appendix B counts it) against
the preset's dense bf16 tensor peak as its vendor states it.

Usage (from anywhere in the repository; builds the release binary first):
    python3 benches/gpu_table.py [--markdown] [--binary target/debug/protrain]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Dense bf16 tensor peaks with f32 accumulate, TFLOP/s, as the presets of ir/src/hardware.rs
# take them from the vendors' whitepapers and datasheets.
PEAK_TFLOPS = {
    "rtx3090": 71.0,
    "rtx4090": 165.2,
    "a100-80gb": 312.0,
    "h100": 989.0,
    "h200": 989.0,
}

# (model, preset, host memory, batch, seq, published figure, its source)
SETUPS = [
    ("gpt2-xl", "h200", None, 8, 1024, "", ""),
    ("gpt2-xl", "h100", None, 8, 1024, "", ""),
    ("gpt2-xl", "a100-80gb", None, 8, 1024, "", ""),
    ("gpt2-xl", "rtx4090", "256GiB", 8, 1024, "", ""),
    ("gpt2-xl", "rtx3090", "256GiB", 8, 1024, "", ""),
    (
        "llama-3-8b",
        "h100",
        "512GiB",
        4,
        8192,
        "11,400 tokens/s (ml_dataflow, offloading); 9,027 tokens/s (NVIDIA's reference, "
        "not offloaded)",
        "figures quoted in issue 35 for one H100",
    ),
    ("llama-3-8b", "h200", "512GiB", 4, 8192, "", ""),
    ("llama-3-8b", "a100-80gb", "512GiB", 4, 8192, "", ""),
    ("llama-3-8b", "rtx4090", "256GiB", 1, 4096, "", ""),
    ("llama-3-8b", "rtx3090", "256GiB", 1, 4096, "", ""),
    (
        "llama-2-13b",
        "h200",
        "1536GiB",
        4,
        1024,
        "MegaTrain: 1.84x the throughput of DeepSpeed ZeRO-3 with CPU offloading at 14B on one "
        "H200 with 1.5 TB of host memory; trains up to 120B there",
        "arXiv 2604.05091, abstract",
    ),
]


def run(args):
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--binary", help="a protrain binary to use instead of building the release one")
    opts = p.parse_args()
    binary = opts.binary
    if not binary:
        run(["cargo", "build", "--release", "--quiet"])
        binary = str(REPO / "target" / "release" / "protrain")
    rows = []
    scratch = tempfile.mkdtemp(prefix="protrain-gpu-table-")
    for model, preset, host, batch, seq, published, source in SETUPS:
        info = json.loads(run([binary, "info", model, "--json"]))
        args = [binary, "compile", model, "--hardware", preset, "--batch", str(batch)]
        args += ["--seq", str(seq), "--json", "-o", f"{scratch}/s.ptsched"]
        if host:
            args += ["--host-memory", host]
        c = json.loads(run(args))
        per_token = 6 * info["parameters"] + 12 * info["layers"] * info["hidden"] * seq
        tflops = c["tokens_per_s"] * per_token / 1e12
        mfu = tflops / PEAK_TFLOPS[preset]
        rows.append(
            {
                "model": model,
                "hardware": preset,
                "host": host or "preset",
                "batch": f"{batch}x{seq}",
                "policy": c["policy"],
                "tokens_per_s": c["tokens_per_s"],
                "tflops": tflops,
                "mfu": mfu,
                "published": published,
                "source": source,
            }
        )
    if not opts.markdown:
        for r in rows:
            print(json.dumps(r))
        return
    print("| model | GPU, host | batch | predicted tokens/s | predicted TFLOP/s | predicted MFU "
          "| published figure (source) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pub = f"{r['published']} ({r['source']})" if r["published"] else ""
        print(
            f"| {r['model']} | {r['hardware']}, {r['host']} | {r['batch']} "
            f"| {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {pub} |"
        )


if __name__ == "__main__":
    main()
