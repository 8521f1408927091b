#!/usr/bin/env python3
"""Tokens per second of one training step: protrain's host backend against PyTorch CPU eager.

Both train the same GPT-2 on the same batch shape with the same number of threads, in the
same run, without dropout, in f32. Two models (--model):

- `small` (the default): 4 layers, hidden 256, 4 heads, vocabulary 8192, 256 positions;
- `gpt2`: GPT-2 124M, the `gpt2` preset (12 layers, hidden 768, 12 heads, vocabulary 50257,
  1024 positions), usually at --batch 4.

- PyTorch: transformers' GPT2LMHeadModel with eager attention; a step is forward, mean
  cross-entropy over all B*T positions, backward, and an AdamW step (zero_grad(set_to_none)).
- protrain: `protrain train <dir> --log-json` (the release build, made first) on a config.json
  with the same fields, with RAYON_NUM_THREADS set to the thread count: it compiles a schedule
  for the host (--policy, `auto` by default) and runs it on the host executor; tokens/s is read
  from the JSON lines. The step is the same: forward, mean cross-entropy over B*T, backward,
  AdamW.

Each side takes --warmup untimed steps, then --steps timed ones, each timed on its own;
tokens/s is B*T over the median step time (robust to a step that another process on a shared
machine slowed down; the mean is printed too). With --rounds R the two alternate R times
(protrain first), so a noisy machine disturbs both alike; every round's ratio and the median of
the ratios are printed.

Usage (from anywhere in the repository):
    python3 benches/compare_pytorch.py [--model small|gpt2] [--threads N] [--batch 8]
        [--seq 256] [--steps 10] [--warmup 3] [--rounds 1] [--policy auto|KEY=VALUE,...]
        [--only protrain|pytorch]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The models, as Hugging Face writes them; `benches/host_step.rs` builds the small one.
SMALL = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 8192,
    "n_positions": 256,
    "n_embd": 256,
    "n_layer": 4,
    "n_head": 4,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-05,
    "tie_word_embeddings": True,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}

# GPT-2 124M: Hugging Face's `gpt2` config.json without dropout.
GPT2 = dict(
    SMALL,
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
)

MODELS = {"small": SMALL, "gpt2": GPT2}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="small",
        help="small: GPT-2 4x256, vocabulary 8192 (default); gpt2: GPT-2 124M",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="threads for both: torch.set_num_threads and RAYON_NUM_THREADS "
        "(default: every core, %(default)s here)",
    )
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument(
        "--rounds", type=int, default=1, help="alternate protrain and PyTorch this many times"
    )
    p.add_argument(
        "--policy",
        default="auto",
        help="protrain's placement policy, passed to `protrain train --policy` (default auto)",
    )
    p.add_argument(
        "--only",
        choices=["protrain", "pytorch"],
        help="time one side only (no ratio)",
    )
    return p.parse_args()


def time_pytorch(args):
    """Seconds of each timed PyTorch CPU eager step."""
    config_fields = MODELS[args.model]
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fields = {k: v for k, v in config_fields.items() if k not in ("model_type", "architectures")}
    # GPT-2's special token ids (50256) may lie outside the vocabulary; no step uses them.
    fields.update(bos_token_id=None, eos_token_id=None)
    config = GPT2Config(**fields)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = config_fields["vocab_size"]
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, vocab, (args.batch * args.seq + 1,), generator=g)
    inputs = stream[:-1].view(args.batch, args.seq)
    targets = stream[1:].view(args.batch, args.seq)

    def step():
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.view(-1, vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return seconds


def build_protrain():
    """Builds the release binary first, so compiling is not timed."""
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "--bin", "protrain"], cwd=REPO, check=True
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return (REPO / target) / "release" / "protrain"


def time_protrain(args, binary, config_dir):
    """Seconds of each timed `protrain train` step (from its tokens_per_s lines)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [
            str(binary),
            "train",
            str(config_dir),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--steps",
            str(args.warmup + args.steps),
            "--policy",
            args.policy,
            "--log-json",
        ],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rates = [json.loads(line)["tokens_per_s"] for line in out.splitlines() if line.startswith("{")]
    if len(rates) != args.warmup + args.steps:
        sys.exit(f"protrain printed {len(rates)} steps, expected {args.warmup + args.steps}:\n{out}")
    # Each line's rate is B*T over that step's seconds.
    return [args.batch * args.seq / r for r in rates[args.warmup :]]


def rate(args, seconds):
    """(median, mean) tokens/s of a list of step times."""
    tokens = args.batch * args.seq
    return tokens / statistics.median(seconds), tokens * len(seconds) / sum(seconds)


def main():
    args = parse_args()
    config = MODELS[args.model]
    if args.seq > config["n_positions"]:
        sys.exit(f"--seq {args.seq} is longer than the model's {config['n_positions']} positions")
    print(
        f"GPT-2 {config['n_layer']}x{config['n_embd']} ({config['n_head']} heads, "
        f"vocab {config['vocab_size']}), batch {args.batch} x seq {args.seq}, f32, "
        f"{args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} round(s)"
    )
    binary = None if args.only == "pytorch" else build_protrain()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        for r in range(args.rounds):
            ours = rate(args, time_protrain(args, binary, tmp)) if binary else None
            theirs = rate(args, time_pytorch(args)) if args.only != "protrain" else None
            line = [f"round {r + 1}:"]
            if ours is not None:
                line.append(f"protrain {ours[0]:6.0f} tokens/s (mean {ours[1]:.0f})")
                ours = ours[0]
            if theirs is not None:
                line.append(f"pytorch {theirs[0]:6.0f} tokens/s (mean {theirs[1]:.0f})")
                theirs = theirs[0]
            if ours is not None and theirs is not None:
                ratios.append(ours / theirs)
                line.append(f"protrain/pytorch {ours / theirs:.2f}x")
            print("  ".join(line), flush=True)
    if len(ratios) > 1:
        print(f"median protrain/pytorch {statistics.median(ratios):.2f}x over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
