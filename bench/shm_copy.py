"""Micro-benchmark: what a batch costs on the shared-memory path, as ratios to one memcpy.

Rows (one f32 AlexNet batch, 256 x 227 x 227 x 3 = 158.3 MB, single core):

- ``memcpy``: ``np.copyto`` into a preallocated, pre-faulted array: the peer of every ratio.
- ``copy into slot``: acquire a slot, ``np.copyto`` the batch into it, commit.
- ``fill in place``: acquire, ``rng.random(out=slot view)``, commit (a source that takes an
  output buffer skips the producer's copy).
- ``generate, then copy``: the same random batch made in a scratch array, then copied in.
- ``validate + map``: the trainer's side per batch: check the descriptor, build the read-only
  views, drop them (the finalizer releases the slot back to the pool).

Each row is timed ``reps`` times in each of ``windows`` interleaved windows; the figure is the
median of the window medians. Run: ``python -m stagefeed.bench.shm_copy [--batch-size N]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stagefeed.common.shm.layout import SlotLayout
from stagefeed.common.shm.mapped import Descriptor, MappedPool
from stagefeed.common.shm.slots import SlotPool


def _timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(batch_size: int = 256, windows: int = 3, reps: int = 5) -> dict[str, Any]:
    """Measure every row; returns ``{"rows": {name: seconds}, "batch_bytes": n, ...}``."""
    shape = (batch_size, 227, 227, 3)
    rng = np.random.default_rng(0)
    src = rng.random(shape, dtype=np.float32)
    dst = np.ones_like(src)  # written once: pre-faulted
    scratch = np.ones_like(src)
    pool = SlotPool(SlotLayout.of([("images", np.float32, shape)]), 2)
    mapped = MappedPool(os.dup(pool.fd), pool.announcement, lambda _p, s, g: pool.release(s, g))
    seq = 0

    def produce(write: Callable[[np.ndarray], Any]) -> dict[str, Any]:
        nonlocal seq
        slot = pool.acquire(timeout=5)
        write(pool.arrays(slot)["images"])
        seq += 1
        return pool.commit(slot, seq)

    def consume(desc: dict[str, Any]) -> None:
        views = mapped.view(Descriptor.parse(desc))
        del views  # last reference: the finalizer releases the slot

    def produce_consume(write: Callable[[np.ndarray], Any]) -> Callable[[], None]:
        return lambda: consume(produce(write))

    def validate_map() -> float:
        desc = produce(lambda _a: None)
        t0 = time.perf_counter()
        consume(desc)
        return time.perf_counter() - t0

    for _ in range(2):  # fault in both slots before timing
        consume(produce(lambda a: np.copyto(a, src)))
    cases: dict[str, Callable[[], Any]] = {
        "memcpy (np.copyto, preallocated)": lambda: np.copyto(dst, src),
        "copy into slot": produce_consume(lambda a: np.copyto(a, src)),
        "fill in place (rng.random(out=slot))": produce_consume(
            lambda a: rng.random(out=a, dtype=np.float32)
        ),
        "generate, then copy into slot": produce_consume(
            lambda a: np.copyto(a, rng.random(out=scratch, dtype=np.float32))
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    samples["validate + map + release (trainer)"] = []
    try:
        for _ in range(windows):
            for name, fn in cases.items():
                samples[name].append(_timed(fn, reps))
            samples["validate + map + release (trainer)"].append(
                statistics.median(validate_map() for _ in range(reps * 20))
            )
    finally:
        mapped.close()
        pool.close()
    return {
        "rows": {name: statistics.median(values) for name, values in samples.items()},
        "batch_bytes": src.nbytes,
        "shape": shape,
        "windows": windows,
        "reps": reps,
    }


def table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    peer = rows["memcpy (np.copyto, preallocated)"]
    gb = report["batch_bytes"] / 1e9
    lines = [
        f"shm_copy: float32 batch {report['shape']} = {report['batch_bytes'] / 1e6:.1f} MB, "
        f"single core, median of {report['windows']} interleaved windows; {os.cpu_count()} "
        f"CPUs, numpy {np.__version__}, {datetime.date.today()}",
        "",
        "| row | ms/batch | GB/s | x memcpy |",
        "|---|---|---|---|",
    ]
    for name, seconds in rows.items():
        rate = f"{gb / seconds:.1f}" if "trainer" not in name else "-"
        ratio = seconds / peer
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {rate} | {ratio:.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    print(table(run(args.batch_size, args.windows, args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
