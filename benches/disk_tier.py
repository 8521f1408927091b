#!/usr/bin/env python3
"""The disk tier on this machine: schedule-driven disk throughput against a plain sequential
read and write of the same directory, measured in the same run, and the step-time cost of a
tiny model's optimizer state on disk against host memory.

It builds the release binary, compiles gpt2-tiny (f32, batch 8 x seq 128, every chunk streamed:
n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1) twice, once with everything in host memory and
once with --host-memory small enough that every chunk's optimizer state moves to disk, trains
each for --steps steps on the host backend (`protrain train`, whose report has the measured step
time and each stream's measured busy time), and reads:

- the disk schedule's throughput: the disk region's bytes read plus written per step over the
  disk_io stream's measured busy time;
- a plain sequential throughput of --dir: --bytes written in 1 MiB blocks and fsync'd, then
  read back, by this script (through the page cache, as the runtime reads);
- the step time of both schedules and its ratio.

Both disk figures go through the page cache: at this size the "disk" is mostly memory, which
is what the runtime sees too. Use a larger model or --bytes beyond RAM to measure the device.

Usage (from anywhere in the repository):
    python3 benches/disk_tier.py [--dir /tmp] [--steps 30] [--bytes 256MiB]
"""

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1"
SHAPE = ["--batch", "8", "--seq", "128"]


def binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run(["cargo", "build", "--release", "-p", "protrain"], cwd=ROOT, check=True)
    return target / "release" / "protrain"


def size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def train(exe: Path, steps: int, extra: list) -> dict:
    out = subprocess.run(
        [str(exe), "train", "gpt2-tiny", "--steps", str(steps), "--policy", POLICY]
        + SHAPE
        + extra,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    step = re.search(r"step time .* measured ([0-9.]+) s", out)
    busy = dict(re.findall(r"^  (\w+)\s+[0-9.]+ s\s+([0-9.]+) s", out, re.M))
    return {"step": float(step.group(1)), "busy": {k: float(v) for k, v in busy.items()}}


def host_region(exe: Path, tmp: Path) -> tuple:
    """The tight policy's host region and its optimizer state, from the planned dump."""
    sched = tmp / "host.ptsched"
    subprocess.run(
        [str(exe), "compile", "gpt2-tiny", "--policy", POLICY, "-o", str(sched)] + SHAPE,
        capture_output=True,
        check=True,
    )
    dump = subprocess.run(
        [str(exe), "dump", str(sched), "--stage", "planned"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    region = re.search(r"^; host: region ([0-9.]+ \w+)", dump, re.M).group(1).replace(" ", "")
    states = [
        size(m.replace(" ", ""))
        for m in re.findall(r"^\s+buf\d+\s+host\s+0x[0-9a-f]+\s+([0-9.]+ \w+)\s+state", dump, re.M)
    ]
    return size(region), states


def sequential(directory: Path, nbytes: int) -> tuple:
    block = b"\x5a" * (1 << 20)
    path = directory / f"protrain-bench-{os.getpid()}.bin"
    try:
        started = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - started)
        started = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(len(block)):
                pass
        read = nbytes / (time.perf_counter() - started)
    finally:
        path.unlink(missing_ok=True)
    return read, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bytes", default="256MiB")
    args = parser.parse_args()
    exe = binary()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        region, states = host_region(exe, tmp)
        # Two staging buffers of the largest state replace all of them.
        budget = region - sum(states) + 2 * max(states) + 4096
        host = train(exe, args.steps, [])
        disk = train(
            exe,
            args.steps,
            ["--host-memory", str(budget), "--disk-memory", "1GiB", "--disk-dir", str(tmp)],
        )
        read, write = sequential(Path(args.dir), size(args.bytes))
    moved = 2 * sum(states)
    io = disk["busy"].get("disk_io", 0.0)
    print(f"directory          {args.dir}")
    print(f"sequential         {read / 1e9:.2f} GB/s read, {write / 1e9:.2f} GB/s write (fsync'd)")
    if io > 0:
        print(
            f"schedule           {moved / io / 1e9:.2f} GB/s ({moved / 1e6:.2f} MB read + written "
            f"per step in {io * 1e3:.3f} ms of disk_io busy time)"
        )
    print(
        f"step time          host {host['step'] * 1e3:.2f} ms, disk {disk['step'] * 1e3:.2f} ms "
        f"({disk['step'] / host['step']:.2f}x)"
    )


if __name__ == "__main__":
    main()
