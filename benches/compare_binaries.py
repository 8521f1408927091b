#!/usr/bin/env python3
"""Two `protrain` binaries on the same training run, alternating: a change's speed-up.

On a shared machine a ratio of two runs taken minutes apart measures the load, not the
change. This runs `protrain train` of binary A then B (then B then A, and so on) for
--rounds rounds, each on the same config, batch, sequence length and policy, with
RAYON_NUM_THREADS set, and prints per round each binary's median tokens/s over the timed
steps, the run's CPU time (user + system, from the kernel's accounting of the child), and
the ratios B/A of both. CPU time is robust to load where wall time is not: it says how much
work a step takes, not how much of the machine it got.

Usage:
    python3 benches/compare_binaries.py BEFORE AFTER CONFIG_DIR [--batch 8] [--seq 256]
        [--steps 8] [--warmup 2] [--rounds 4] [--threads 2] [--policy auto]

CONFIG_DIR holds a Hugging Face config.json (or is a preset name); `compare_pytorch.py`
writes the GPT-2 ones it uses.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="the binary built before the change (A)")
    p.add_argument("after", help="the binary built after it (B)")
    p.add_argument("model", help="a config.json directory or a preset name")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policy", default="auto")
    return p.parse_args()


def run(args, binary):
    """(median tokens/s of the timed steps, CPU seconds of the run, the policy line)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [binary, "train", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
         "--steps", str(args.steps), "--policy", args.policy, "--log-json"],
        env=dict(os.environ, RAYON_NUM_THREADS=str(args.threads)),
        capture_output=True, text=True, check=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rates = [json.loads(line)["tokens_per_s"] for line in out.stdout.splitlines()
             if line.startswith("{")][args.warmup:]
    policy = next((line.split(None, 1)[1] for line in out.stderr.splitlines()
                   if line.startswith("policy")), "?")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return statistics.median(rates), cpu, policy


def main():
    args = parse_args()
    rate, cpu = {"A": [], "B": []}, {"A": [], "B": []}
    for r in range(args.rounds):
        order = [("A", args.before), ("B", args.after)]
        for name, binary in order if r % 2 == 0 else order[::-1]:
            tokens, seconds, policy = run(args, binary)
            rate[name].append(tokens)
            cpu[name].append(seconds)
            print(f"round {r + 1} {name}: {tokens:8.1f} tokens/s  cpu {seconds:7.2f} s  "
                  f"load {os.getloadavg()[0]:.1f}  {policy}", flush=True)
    wall = [b / a for a, b in zip(rate["A"], rate["B"])]
    work = [b / a for a, b in zip(cpu["A"], cpu["B"])]
    print("B/A tokens/s per round: " + " ".join(f"{x:.3f}" for x in wall)
          + f"  median {statistics.median(wall):.3f}")
    print("B/A CPU time per round: " + " ".join(f"{x:.3f}" for x in work)
          + f"  median {statistics.median(work):.3f}")


if __name__ == "__main__":
    main()
