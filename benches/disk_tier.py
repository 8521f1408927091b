#!/usr/bin/env python3
"""The disk tier on this machine: schedule-driven disk throughput against a plain sequential
read and write of the same directory, measured in the same run, and the step-time cost of a
tiny model's optimizer state on disk against host memory, with O_DIRECT and with buffered I/O.

It builds the release binary, compiles gpt2-tiny (f32, batch 8 x seq 128, every chunk streamed:
n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1) with everything in host memory and with
--host-memory small enough that every chunk's optimizer state moves to disk, trains each for
--steps steps on the host backend (`protrain train`, whose report has the measured step time and
each stream's measured busy time; the disk schedule once with PROTRAIN_DISK_IO=direct and once
with PROTRAIN_DISK_IO=buffered, since the runtime's `auto` picks buffered for a state this
small), and reads:

- the disk schedule's throughput: the disk region's bytes read plus written per step over the
  disk_io stream's measured busy time;
- a plain sequential throughput of --dir by this script, in 8 MiB blocks: --bytes written and
  fdatasync'd, then read back after dropping the file's pages from the page cache
  (posix_fadvise DONTNEED), once buffered and once with O_DIRECT;
- the step time of each schedule and its ratio to the host-memory one;
- the runtime's own file I/O (`protrain profile --disk-dir`: --bytes written in 64 MiB
  transfers, fdatasync'd, read back, with O_DIRECT) with one request in flight
  (PROTRAIN_DISK_QUEUE=1, each transfer's 8 MiB requests one after another) and with --queue
  requests in flight (the runtime's pool of I/O threads), and their ratio.

At this model size the whole state is a few MB: buffered I/O is then served by the page cache,
which is why it can look faster through the schedule than O_DIRECT. A state that needs the disk
tier is larger than host memory, so the sequential figures (--bytes of 1 GiB or more) are the
ones that say how fast it moves.

Usage (from anywhere in the repository):
    python3 benches/disk_tier.py [--dir /tmp] [--steps 30] [--bytes 1GiB] [--queue 4]
        [--exe target/debug/protrain] [--only-queue]

--exe uses a binary already built instead of building the release one (the file I/O is system
calls, so a debug build moves bytes as fast); --only-queue measures only the request depths.
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


def binary(exe) -> Path:
    if exe:
        return Path(exe).resolve()
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run(["cargo", "build", "--release", "-p", "protrain"], cwd=ROOT, check=True)
    return target / "release" / "protrain"


def size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def train(exe: Path, steps: int, extra: list, io: str = "direct") -> dict:
    out = subprocess.run(
        [str(exe), "train", "gpt2-tiny", "--steps", str(steps), "--policy", POLICY]
        + SHAPE
        + extra,
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PROTRAIN_DISK_IO=io),
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


def sequential(directory: Path, nbytes: int, direct: bool) -> tuple:
    """Read and write bandwidth of --dir, buffered or with O_DIRECT (None where refused)."""
    import mmap

    block = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    block.write(b"\x5a" * len(block))
    nbytes = max(len(block), nbytes // len(block) * len(block))
    path = directory / f"protrain-bench-{os.getpid()}.bin"
    extra = os.O_DIRECT if direct else 0
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | extra, 0o644)
        except OSError:
            return None
        started = time.perf_counter()
        try:
            for at in range(0, nbytes, len(block)):
                os.pwritev(fd, [block], at)
        except OSError:
            return None
        os.fdatasync(fd)
        write = nbytes / (time.perf_counter() - started)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | extra)
        started = time.perf_counter()
        for at in range(0, nbytes, len(block)):
            os.preadv(fd, [block], at)
        read = nbytes / (time.perf_counter() - started)
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return read, write


def queued(exe: Path, directory: Path, nbytes: str, depth: int) -> tuple:
    """The runtime's read and write bandwidth of --dir with `depth` requests in flight."""
    with tempfile.TemporaryDirectory() as tmp:
        err = subprocess.run(
            [str(exe), "profile", "gpt2-tiny", "--batch", "1", "--seq", "8", "--repeats", "1",
             "--disk-dir", str(directory), "--disk-bytes", nbytes,
             "-o", str(Path(tmp) / "profile.json")],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, PROTRAIN_DISK_QUEUE=str(depth), PROTRAIN_DISK_IO="direct"),
        ).stderr
    m = re.search(r"^disk\s+([0-9.]+) GB/s read, ([0-9.]+) GB/s write .*, (.*)$", err, re.M)
    return float(m.group(1)), float(m.group(2)), m.group(3)


def queue_depths(exe: Path, args) -> None:
    rows = {d: queued(exe, Path(args.dir), args.bytes, d) for d in (1, args.queue)}
    for depth, (read, write, io) in rows.items():
        print(
            f"runtime    depth {depth:<3} {read:.2f} GB/s read, {write:.2f} GB/s write "
            f"(fdatasync'd), {args.bytes} in 64 MiB transfers, {io}"
        )
    one, many = rows[1], rows[args.queue]
    print(
        f"runtime    depth {args.queue} / depth 1: {many[0] / one[0]:.2f}x read, "
        f"{many[1] / one[1]:.2f}x write"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bytes", default="1GiB")
    parser.add_argument("--queue", type=int, default=4)
    parser.add_argument("--exe")
    parser.add_argument("--only-queue", action="store_true")
    args = parser.parse_args()
    exe = binary(args.exe)
    print(f"directory          {args.dir}")
    queue_depths(exe, args)
    if args.only_queue:
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        region, states = host_region(exe, tmp)
        # Two staging buffers of the largest state replace all of them.
        budget = region - sum(states) + 2 * max(states) + 4096
        flags = ["--host-memory", str(budget), "--disk-memory", "1GiB", "--disk-dir", str(tmp)]
        host = train(exe, args.steps, [])
        disk = {io: train(exe, args.steps, flags, io) for io in ("direct", "buffered")}
        plain = {io: sequential(Path(args.dir), size(args.bytes), io == "direct") for io in disk}
    moved = 2 * sum(states)
    for io in ("direct", "buffered"):
        if plain[io] is None:
            print(f"sequential {io:8} refused by the file system")
            continue
        read, write = plain[io]
        print(
            f"sequential {io:8} {read / 1e9:.2f} GB/s read (uncached), {write / 1e9:.2f} GB/s "
            f"write (fdatasync'd), {size(args.bytes) >> 20} MiB in 8 MiB blocks"
        )
    for io, run in disk.items():
        busy = run["busy"].get("disk_io", 0.0)
        if busy > 0:
            print(
                f"schedule   {io:8} {moved / busy / 1e9:.2f} GB/s ({moved / 1e6:.2f} MB read + "
                f"written per step in {busy * 1e3:.3f} ms of disk_io busy time)"
            )
    print(f"step time          host {host['step'] * 1e3:.2f} ms", end="")
    for io, run in disk.items():
        print(f", disk {io} {run['step'] * 1e3:.2f} ms ({run['step'] / host['step']:.2f}x)", end="")
    print()


if __name__ == "__main__":
    main()
