"""``bench input``: a decode-bound pipeline fed by stagefeed and by its peers, in one run.

A folder of JPEGs is written to a temporary directory; then, one after the other on the same
cores, each mode decodes it (decode, random crop, flip) and, but for the ideal, trains the tiny
model of ``bench.input_keras`` on it:

- ``ideal``: this process decoding alone, training nothing, before the other modes and again
  after them (its rate is their mean; both are reported): N processes would decode N times
  as fast, the ideal of N producers;
- ``stagefeed``: ``stagefeed run`` with N producers per transport (``bench.input_stagefeed``);
- ``tf.data``, ``from_generator``, ``pydataset``: Keras ``fit`` in a process of its own
  (``bench.input_keras``).

Each mode's figure is images/s over its timed steps after a warm-up, with the CPU its process
tree used in that window per image. No TensorFlow is imported here.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import tempfile
import threading
import time
from typing import Any

from stagefeed.bench.cpu import process_cpu_s
from stagefeed.bench.input_config import (
    FROM_GENERATOR,
    IDEAL,
    PYDATASET,
    STAGEFEED,
    TF_DATA,
    InputConfig,
)
from stagefeed.bench.input_data import PythonDecode, make_images, write_transform
from stagefeed.bench.input_keras import input_worker
from stagefeed.bench.input_stagefeed import measure_run
from stagefeed.bench.report import machine, rounded
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.lifecycle import on_stop_signals, stop_processes

log = logging.getLogger(__name__)

MODE_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.2
# The targets of issue 30 (docs/benchmarks.md): stagefeed's ratio to the ideal by producers.
TARGET_RATIO = {1: 0.95, 2: 0.8}


def measure_ideal(config: InputConfig, folder: str) -> dict[str, Any]:
    """This process decoding alone: ``warmup_steps`` batches' images untimed, then
    ``steps`` batches' timed, in the order and with the crops the other Python modes use."""
    decode = PythonDecode(folder, config.crop, config.seed)
    samples = decode.samples()
    for _ in range(config.warmup_steps * config.batch_size):
        next(samples)
    images = config.steps * config.batch_size
    cpu_before, started = process_cpu_s(), time.perf_counter()
    for _ in range(images):
        next(samples)
    seconds, cpu_after = time.perf_counter() - started, process_cpu_s()
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {"seconds": seconds, "images": images, "cpu_s": cpu, "decoder": decode.decoder}


def _keras_mode(
    mode: str, workers: int, config: InputConfig, folder: str, stop: threading.Event,
    log_level: int,
) -> dict[str, Any]:  # fmt: skip
    """One Keras-fed mode in a process of its own; its figures."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(
        target=input_worker,
        args=(mode, workers, config, folder, child, log_level, multiprocessing.get_start_method()),
        name=f"bench-input-{mode}", daemon=False,  # a PyDataset starts processes of its own
    )  # fmt: skip
    process.start()
    child.close()
    deadline = time.monotonic() + MODE_TIMEOUT_S
    try:
        while not conn.poll(POLL_S):
            if stop.is_set():
                raise ClosedError("stop requested")
            if not process.is_alive():
                raise BrokenError(f"mode {mode}: process exited ({process.exitcode})")
            if time.monotonic() > deadline:
                raise BrokenError(f"mode {mode}: no answer within {MODE_TIMEOUT_S:.0f} s")
        kind, payload = conn.recv()
    finally:
        conn.close()
        stop_processes([process], STOP_TIMEOUT_S)
    if kind != "done":
        raise BrokenError(f"mode {payload}")
    return payload


def run_input(config: InputConfig, log_level: int = logging.INFO) -> dict[str, Any]:
    """Run the benchmark; return every figure (``summarize``). Ctrl-C stops it cleanly."""
    conditions = machine()
    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    started = time.monotonic()
    figures: list[dict[str, Any]] = []
    ideals: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="stagefeed-bench-input-") as root:
            folder = make_images(root, config.images, config.image_size, config.seed)
            transform = write_transform(root, config.crop)
            log.info("%d JPEGs of %dx%d in %s", config.images, config.image_size,
                     config.image_size, folder)  # fmt: skip
            for mode, transport, workers in config.runs():
                if stop.is_set():
                    raise ClosedError("stop requested")
                log.info("mode %s %s %d", mode, transport, workers)
                if mode == IDEAL:
                    ideals.append(measure_ideal(config, folder))
                    continue
                if mode == STAGEFEED:
                    result = measure_run(config, root, folder, transform, workers, transport, stop)
                else:
                    result = _keras_mode(mode, workers, config, folder, stop, log_level)
                figures.append({"mode": mode, "transport": transport, "workers": workers,
                                **result})  # fmt: skip
            if ideals:  # again at the end: the load of a shared machine drifts
                ideals.append(measure_ideal(config, folder))
    finally:
        restore()
    conditions["load_avg_1m_end"] = machine()["load_avg_1m"]
    conditions["wall_s"] = round(time.monotonic() - started, 1)
    return summarize(config, conditions, ideals, figures)


def _rate(result: dict[str, Any]) -> float | None:
    if result.get("images_per_s"):
        return float(result["images_per_s"])
    seconds = result.get("seconds")
    return result["images"] / seconds if seconds else None


def _cpu_ms(result: dict[str, Any]) -> float | None:
    images = result.get("cpu_images", result["images"])
    cpu = result.get("cpu_s")
    return 1000.0 * cpu / images if cpu is not None and images else None


def summarize(
    config: InputConfig,
    conditions: dict[str, Any],
    ideals: list[dict[str, Any]],
    figures: list[dict[str, Any]],
) -> dict[str, Any]:
    """The report: settings, machine, the ideal, one row per measurement, the targets.

    ``ideal.images_per_s`` is the mean of the two ideal runs (before and after the others);
    a row's ``ideal_images_per_s`` is ``workers`` times it (tf.data's AUTOTUNE: the host's
    cores), ``ratio`` its images/s over that. ``core_ms_per_image``: user + system CPU of the
    mode's process tree over its timed window, per image. ``vs`` holds stagefeed's images/s
    over each peer's (from_generator, tf.data; PyDataset with the same N)."""
    cores = conditions.get("cpus") or 1
    ideal_rates = [r for r in (_rate(i) for i in ideals) if r]
    one = sum(ideal_rates) / len(ideal_rates) if ideal_rates else None
    ideal = {
        "images_per_s": rounded(one, 1),
        "runs_images_per_s": [rounded(r, 1) for r in ideal_rates],
        "core_ms_per_image": rounded(_cpu_ms(ideals[0]), 3) if ideals else None,
        "decoder": ideals[0]["decoder"] if ideals else None,
    }
    rows = []
    for result in figures:
        workers = result["workers"] or cores
        rate = _rate(result)
        row = {
            "mode": result["mode"], "transport": result["transport"],
            "workers": result["workers"], "images_per_s": rounded(rate, 1),
            "ideal_images_per_s": rounded(one * workers, 1) if one else None,
            "ratio": rounded(rate / (one * workers), 3) if one and rate else None,
            "core_ms_per_image": rounded(_cpu_ms(result), 3),
            "decoder": result.get("decoder", ideal["decoder"]),
        }  # fmt: skip
        for key in ("stall_pct", "run_transport", "start_method", "command"):
            if key in result:
                row[key] = result[key]
        rows.append(row)
    _compare(rows)
    settings = dataclasses.asdict(config)
    settings["runs"] = [list(run) for run in config.runs()]
    return {
        "benchmark": "input",
        "settings": settings,
        "machine": conditions,
        "ideal": ideal,
        "rows": rows,
        "targets": targets(rows),
    }


def _compare(rows: list[dict[str, Any]]) -> None:
    """Each stagefeed row's ``vs``: its images/s over each peer's (``None`` where absent)."""
    def rate(mode: str, workers: int | None = None) -> float | None:
        for row in rows:
            if row["mode"] == mode and (workers is None or row["workers"] == workers):
                return row["images_per_s"]
        return None

    for row in rows:
        if row["mode"] != STAGEFEED:
            continue
        peers = {
            TF_DATA: rate(TF_DATA),
            FROM_GENERATOR: rate(FROM_GENERATOR),
            PYDATASET: rate(PYDATASET, row["workers"]),
        }
        row["vs"] = {
            name: rounded(row["images_per_s"] / peer, 2) if peer and row["images_per_s"] else None
            for name, peer in peers.items()
        }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 30's targets, each with the figure measured and whether it was met: stagefeed's
    ratio to the ideal (>= 0.95 with one producer, >= 0.8 with two), and stagefeed ahead of
    from_generator and PyDataset with the same N. Only those this run measured."""
    out = []
    for row in rows:
        if row["mode"] != STAGEFEED:
            continue
        name = f"stagefeed {row['transport']} x{row['workers']}"
        wanted = TARGET_RATIO.get(row["workers"])
        if wanted is not None and row["ratio"] is not None:
            out.append({"target": f"{name}: ratio to the ideal >= {wanted}",
                        "measured": row["ratio"], "met": row["ratio"] >= wanted})  # fmt: skip
        for peer in (FROM_GENERATOR, PYDATASET):
            ahead = row["vs"][peer]
            if ahead is not None:
                out.append({"target": f"{name}: ahead of {peer}", "measured": ahead,
                            "met": ahead > 1.0})  # fmt: skip
    return out
