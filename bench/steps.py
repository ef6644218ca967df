"""``bench steps``: every input mode in its own process, timed in interleaved blocks.

All mode processes are started and set up first (graphs built, queues filled, producers
connected), then each runs its warm-up steps, then ``rounds`` blocks of timed steps in turn:
forward order, reversed, forward... so slow drift of a shared machine (other load, thermal)
falls on every mode alike. Only one mode steps at a time; after its block a mode settles
(its queue refilled) before the next mode is timed, so no mode's background work lands in
another's figures. No TensorFlow is imported here: the workers import it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from typing import Any

from stagefeed.bench.config import REFERENCES, StepsConfig, family
from stagefeed.bench.report import machine, rounded, step_figures
from stagefeed.bench.worker import mode_worker
from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.common.lifecycle import on_stop_signals, stop_processes
from stagefeed.common.stats import percentile

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 600.0
BLOCK_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.2


class _Worker:
    """A mode process and its end of the pipe."""

    def __init__(self, ctx: Any, name: str, config: StepsConfig, log_level: int) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=mode_worker,
            args=(name, config, child, log_level),
            name=f"bench-{name}",
            daemon=False,  # the stagefeed mode starts producer processes of its own
        )
        self.process.start()
        child.close()

    def receive(self, stop: threading.Event, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(POLL_S):
            if stop.is_set():
                raise ClosedError("stop requested")
            if not self.process.is_alive():
                raise BrokenError(f"mode {self.name}: process exited ({self.process.exitcode})")
            if time.monotonic() > deadline:
                raise BrokenError(f"mode {self.name}: no answer within {timeout_s:.0f} s")
        kind, payload = self.conn.recv()
        if kind == "config":
            raise ConfigError(payload.splitlines()[0])
        if kind == "error":
            raise BrokenError(f"mode {payload}")
        return kind, payload

    def run_steps(self, count: int, stop: threading.Event) -> dict[str, Any]:
        self.conn.send(("steps", count))
        return self.receive(stop, BLOCK_TIMEOUT_S)[1]

    def close(self) -> None:
        try:
            self.conn.send(("close", 0))
        except (BrokenPipeError, OSError):
            pass


def run_steps(config: StepsConfig, log_level: int = logging.INFO) -> dict[str, Any]:
    """Run the benchmark; return every figure (see ``summarize``). Ctrl-C stops it cleanly."""
    conditions = machine()
    ctx = multiprocessing.get_context("spawn")
    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    workers: dict[str, _Worker] = {}
    info: dict[str, Any] = {}
    keys = ("step_s", "wait_s", "process_cpu_s", "feed_cpu_s")
    timed: dict[str, dict[str, list]] = {m: {k: [] for k in keys} for m in config.modes}
    settles: dict[str, list] = {m: [] for m in config.modes}
    order: list[list[str]] = []
    started = time.monotonic()
    try:
        for name in config.modes:
            workers[name] = _Worker(ctx, name, config, log_level)
        for name, worker in workers.items():
            info[name] = worker.receive(stop, SETUP_TIMEOUT_S)[1]
            log.info("mode %s ready", name)
        for name in config.modes:
            if config.warmup_steps:
                settles[name].append(workers[name].run_steps(config.warmup_steps, stop)["settle"])
        for round_index, block in enumerate(config.blocks()):
            names = list(config.modes if round_index % 2 == 0 else reversed(config.modes))
            order.append(names)
            for name in names:
                result = workers[name].run_steps(block, stop)
                timed[name]["step_s"] += result["step_s"]
                timed[name]["wait_s"] += result["wait_s"]
                timed[name]["process_cpu_s"].append(result["process_cpu_s"])
                timed[name]["feed_cpu_s"].append(result["feed_cpu_s"])
                settles[name].append(result["settle"])
            log.info("round %d/%d done", round_index + 1, config.round_count)
    finally:
        for worker in workers.values():
            worker.close()
        stop_processes([w.process for w in workers.values()], STOP_TIMEOUT_S)
        restore()
    conditions["load_avg_1m_end"] = machine()["load_avg_1m"]
    conditions["wall_s"] = round(time.monotonic() - started, 1)
    return summarize(config, conditions, info, timed, settles, order)


def paired_ratio(step_ms: list[float], reference_ms: list[float] | None) -> float | None:
    """Median of ``step / reference step`` over the steps both timed in the same turns."""
    if not reference_ms or len(reference_ms) != len(step_ms):
        return None
    ratios = [s / r for s, r in zip(step_ms, reference_ms, strict=True) if r > 0]
    return rounded(percentile(ratios, 50), 3) if ratios else None


def summarize(
    config: StepsConfig,
    conditions: dict[str, Any],
    info: dict[str, Any],
    timed: dict[str, dict[str, list]],
    settles: dict[str, list],
    order: list[list[str]],
) -> dict[str, Any]:
    """The report: settings, machine, and per mode every step time plus derived figures.

    ``ratio`` is the median step over its family's reference's median in this run
    (``bench.config.REFERENCES``: synthetic-device for the graph modes, keras-synthetic for
    the Keras ones; ``family`` and ``reference`` say which). ``paired_ratio`` is the median
    over timed steps of the step over the reference's step of the same round and position,
    timed seconds apart: load that comes and goes on a shared machine for longer than a step
    (here the step time jumped between ~1.5 and ~3 s for tens of seconds at a time) moves the
    medians of two modes apart by chance, and the pairs much less. ``stall_pct``
    is the share of step time spent waiting for input before ``session.run`` started; it
    exists only for a mode that waits outside the run (stagefeed), else ``None``.
    ``process_cpu_ms_per_step``: core-ms the mode's process used per timed step (TF compute
    and any in-process feeding); ``feed_cpu_ms_per_step``: core-ms of the feed path alone,
    producer processes included, for the modes that can tell (seed-staging, stagefeed).
    """
    schema = config.schema
    modes: dict[str, Any] = {}
    for name in config.modes:
        step_s, wait_s = timed[name]["step_s"], timed[name]["wait_s"]
        figures = step_figures(step_s, schema.batch_size)
        waits = [w for w in wait_s if w is not None]
        measured = len(waits) == len(step_s) and step_s
        figures["stall_pct"] = rounded(100 * sum(waits) / sum(step_s)) if measured else None
        figures["step_ms"] = [round(s * 1000, 3) for s in step_s]
        figures["wait_ms"] = [round(w * 1000, 3) for w in waits] if measured else None
        for key, figure in (
            ("process_cpu_s", "process_cpu_ms_per_step"),
            ("feed_cpu_s", "feed_cpu_ms_per_step"),
        ):
            cpu = timed[name][key]
            known = step_s and all(c is not None for c in cpu)
            figures[figure] = rounded(1000 * sum(cpu) / len(step_s), 1) if known else None
        figures["settle"] = settles[name]
        figures["info"] = info.get(name, {})
        modes[name] = figures
    for name, figures in modes.items():
        figures["family"] = family(name)
        figures["reference"] = REFERENCES[figures["family"]]
        reference = modes.get(figures["reference"], {}).get("median_ms")
        median = figures["median_ms"]
        figures["ratio"] = rounded(median / reference, 3) if reference and median else None
        figures["paired_ratio"] = paired_ratio(
            figures["step_ms"], modes.get(figures["reference"], {}).get("step_ms")
        )
    settings = dataclasses.asdict(config)
    settings["schema"] = schema.to_dict()  # the form of --schema files and the welcome
    settings["batch_mb"] = round(schema.batch_bytes / 1e6, 2)
    settings["queue_capacity"] = config.queue_capacity
    settings["rounds"] = config.round_count
    device = next((i.get("device") for i in info.values() if i.get("device")), "")
    return {
        "benchmark": "steps",
        "settings": settings,
        "machine": conditions,
        "device": device,
        "tensorflow": next((i.get("tensorflow") for i in info.values()), ""),
        "order": order,
        "modes": modes,
    }
