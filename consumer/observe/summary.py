"""The end-of-run summary: as a dict (for ``--json``) and as text.

What the run did is its trainer's ``RunReport`` (``consumer.run_report``), built once
at its end: the summary reads that, never a trainer. The step figures (percentiles,
examples/s, received MiB/s, stall) and the advice are the monitor's ``FinalFigures``, taken
as they are: nothing here computes them again.
"""

from __future__ import annotations

import json
import math
import resource
import time
from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import EXIT_SHORT_RUN
from stagefeed.common.options import MIB
from stagefeed.consumer.memory import heap
from stagefeed.consumer.observe.progress import size_text

if TYPE_CHECKING:
    from stagefeed.consumer.observe.monitor import FinalFigures
    from stagefeed.consumer.run_report import RunReport


def summarize(
    report: RunReport,
    final: FinalFigures | None,
    wall_s: float,
    interrupted: bool,
    transport_choice: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every figure of a run; ``final`` is None when the monitor never started (no step
    figures then, and no advice). ``transport_choice``: ``run``'s ``--transport`` as asked,
    chosen and why (``stagefeed.loopback``); None for ``train``."""
    options, spec = report.options, report.options.schema
    totals = report.totals
    base = report.resumed_from or 0
    nan = math.nan
    window = final.window if final is not None else None
    summary: dict[str, Any] = {
        "device": report.device,
        "endpoint": report.endpoint,
        "transport": report.transport,
        "transport_choice": transport_choice,
        "shm": None if report.shm is None else dict(report.shm),
        "batch_size": spec.batch_size,
        "schema": spec.describe(),
        "wire_dtype": spec.wire_dtype,
        "batch_mb": round(spec.batch_bytes / MIB, 3),
        "enqueue_threads": options.enqueue_threads,
        "queue_capacity": options.queue_capacity,
        "stage_depth": options.stage_depth,
        # This run's steps (a resumed run's step numbers go on from its checkpoint's).
        "warmup_steps": max(0, min(report.steps_done, options.warmup_steps) - base),
        "steps": max(0, report.steps_done - max(options.warmup_steps, base)),
        "resumed_from": report.resumed_from,
        "interrupted": interrupted,
        "median_ms": _round(final.median_ms if final else nan),
        "p10_ms": _round(final.p10_ms if final else nan),
        "p90_ms": _round(final.p90_ms if final else nan),
        "examples_per_s": _round(window.examples_per_s if window else nan),
        # six digits: a small batch's rate (KiB/s) must not round to nothing
        "received_mb_per_s": _round(final.received_mb_per_s if final else nan, 6),
        "stall_pct": _round(window.stall_pct if window else nan),
        "loss_first": _round(_or_nan(report.loss_first), 4),
        "loss_last": _round(_or_nan(report.loss_last), 4),
        "loss_finite": report.loss_finite if report.loss_last is not None else False,
        "metrics": {name: _round(value, 4) for name, value in report.metrics.items()},
        "wall_s": round(wall_s, 3),
        "batches": {
            "received": totals.received,
            "trained": totals.trained,
            "queued_at_stop": totals.queued,
            "abandoned": totals.abandoned,
            "not_enqueued": totals.not_enqueued,
            "dropped": totals.dropped,
            "seq_missing": totals.seq_missing,
        },
        "dropped_by_reason": dict(report.drops_by_reason),
        "refused_producers": {name: dict(why) for name, why in report.refusals.items()},
        "producers_ended": dict(report.producers_ended),
        "producers_left": [dict(left) for left in report.producers_left],
        "bad_records": {"skipped": report.bad_records[0], "first": list(report.bad_records[1])},
        "data_ended": report.data_ended,
        "run_length": run_length(report, interrupted),
        "connections": dict(report.connections),
        "producers": {name: dict(figures) for name, figures in report.producers.items()},
        "memory": _memory(report),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    cluster = report.cluster
    if cluster is not None:  # one worker of a MultiWorkerMirroredStrategy cluster
        summary["cluster"] = {
            "worker": cluster.worker, "workers": cluster.workers, "chief": cluster.chief,
            "books": None if cluster.books is None else dict(cluster.books),
        }  # fmt: skip
    if final is not None:
        summary["advice"] = final.advice.text
        summary["bottleneck"] = final.advice.kind
    return summary


def run_length(report: RunReport, interrupted: bool) -> dict[str, Any]:
    """Planned against done. Epochs are of ``--steps-per-epoch`` steps, or the passes of a
    source with passes. ``complete``: every planned step and every planned pass trained (None
    for a run with no planned length, ``--steps 0`` without passes); ``short_because``: why a
    run that was not interrupted ended before its plan (its data or its producers ended, or
    ``--steps`` before its passes), else None."""
    options = report.options
    planned, done = report.steps_planned, report.steps_done
    per_epoch, passes = options.steps_per_epoch, report.passes_trained
    checks = ([done >= planned] if planned else []) + (
        [passes >= options.epochs] if passes is not None else []
    )
    complete = all(checks) if checks else None
    why = report.drained_because
    if why is None and passes is not None and passes < options.epochs and planned <= done:
        why = f"its {planned} planned steps ended it in pass {passes + 1} (--steps)"
    short = complete is False and not interrupted
    return {
        "planned_steps": planned or None,
        "steps_done": done,
        "planned_epochs": options.epochs if per_epoch or passes is not None else None,
        "epochs_done": done // per_epoch if per_epoch else passes,
        "complete": complete,
        "short_because": (why or "the run ended early") if short else None,
    }


def _step_lines(s: dict[str, Any]) -> list[str]:
    """Step times, throughput and loss; one line when no step was trained (nothing to time)."""
    if s["steps"] == 0 and s["warmup_steps"] == 0:
        return ["  no step trained: no step time, stall or loss"]
    return [
        f"  ms/step median {_figure(s['median_ms'])}  p10 {_figure(s['p10_ms'])}  "
        f"p90 {_figure(s['p90_ms'])}",
        f"  examples/s {_figure(s['examples_per_s'])}  received "
        f"{_per_s(s['received_mb_per_s'])}  stall {_figure(s['stall_pct'], '%')}",
        f"  loss {s['loss_first']} -> {s['loss_last']} (finite: {s['loss_finite']})"
        + (
            "; metrics " + ", ".join(f"{k} {v}" for k, v in s["metrics"].items())
            if s.get("metrics") else ""
        ),
    ]


def _figure(value: float | None, unit: str = "") -> str:
    """A figure, or ``-`` where there is none (too few timed steps)."""
    return "-" if value is None else f"{value}{unit}"


def _cluster_lines(s: dict[str, Any]) -> list[str]:
    c = s.get("cluster")
    if not c:
        return []
    role = " (chief)" if c["chief"] else ""
    line = f"  cluster: worker {c['worker']}/{c['workers']}{role}"
    b = c.get("books")
    if b:
        line += (
            f"; all workers: {b['steps']} steps, batches received {b['received']}, trained "
            f"{b['trained']}, queued at stop {b['queued']}, abandoned {b['abandoned']}, "
            f"in the intake {b['not_enqueued']}, dropped {b['dropped']}, missing {b['seq_missing']}"
        )
    return [line]


def _run_length_line(s: dict[str, Any]) -> str | None:
    r = s.get("run_length") or {}
    if not r.get("short_because"):
        return None
    epochs = (
        f", {r['epochs_done']} of {r['planned_epochs']} epochs"
        if r.get("planned_epochs") is not None else ""
    )  # fmt: skip
    steps = (
        f"{r['steps_done']} of {r['planned_steps']} planned steps"
        if r.get("planned_steps") is not None else f"{r['steps_done']} steps"
    )  # fmt: skip
    return (
        f"  WARNING: ended after {steps}{epochs}: {r['short_because']} "
        f"(--require-full-run makes this exit {EXIT_SHORT_RUN})"
    )


def _memory(report: RunReport) -> dict[str, Any]:
    """The process's peak RSS against the bound on batch bytes held, and what malloc holds in
    use and keeps freed (``consumer.memory.heap`` says how far the freed figure is resident)."""
    # Every producer the trainer saw counts, as if all were still connected.
    producers = report.producer_count
    held = heap.read()
    return {
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "held_bound_mb": round(report.options.held_bytes_bound(producers) / MIB, 1),
        "bound_producers": producers,
        "heap_in_use_mb": round(held.in_use / MIB, 1) if held else None,
        "heap_free_mb": round(held.free / MIB, 1) if held else None,
    }


def _memory_line(s: dict[str, Any]) -> str:
    m = s["memory"]
    line = (
        f"  memory: peak RSS {m['peak_rss_mb']} MiB; batch bytes held at most "
        f"{m['held_bound_mb']} MiB ({m['bound_producers']} producers)"
    )
    if m["heap_free_mb"] is None:
        return line
    return f"{line}; malloc {m['heap_in_use_mb']} MiB in use, {m['heap_free_mb']} MiB kept freed"


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _transport_line(s: dict[str, Any]) -> str:
    shm = s.get("shm")
    line = f"  transport {s.get('transport', '?')}, endpoint {s['endpoint']}"
    if shm:
        by_zmq = s["batches"]["received"] - shm["batches"]
        line += (
            f"; shared-memory pools offered at {shm['socket']}: {shm['slots_per_pool']} "
            f"slots of {shm['slot_mb']} MiB = {shm['pool_mb']} MiB per producer (sized for "
            f"{shm['sized_for_producers']}), {shm['pools_accepted']} pools mapped; batches by "
            f"shared memory {shm['batches']}, by ZeroMQ {by_zmq}"
        )
    choice = s.get("transport_choice")
    if choice and choice["asked"] == "auto":  # run's default: what it chose here, and why
        line += f"\n  --transport auto chose {choice['chosen']}: {choice['reason']}"
    return line


def _per_s(mib: float | None) -> str:
    return "- MiB/s" if mib is None else f"{size_text(mib)}/s"


def _round(value: float, digits: int = 2) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def write_json(summary: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
        f.write("\n")


def format_text(summary: dict[str, Any]) -> str:
    """A human-readable block for the end of ``stagefeed run`` / ``train``."""
    s, b = summary, summary["batches"]
    lines = [
        "stagefeed summary",
        f"  device {s['device']}, batch {s['schema']} ({size_text(s['batch_mb'])}), "
        f"{s['enqueue_threads']} enqueue threads, "
        f"queue {s['queue_capacity']} batches, staging depth {s['stage_depth']}",
        _transport_line(s),
        f"  steps {s['steps']} timed (+{s['warmup_steps']} warm-up)"
        + (f" - resumed from step {s['resumed_from']}" if s.get("resumed_from") is not None
           else "")
        + (" - interrupted" if s["interrupted"] else "")
        + (" - every producer's data ended" if s.get("data_ended") else ""),
        *_step_lines(s),
        f"  batches received {b['received']}, trained {b['trained']}, "
        f"queued at stop {b['queued_at_stop']}, abandoned {b['abandoned']}, in the intake at stop "
        f"{b['not_enqueued']}, dropped {b['dropped']}, "
        f"missing (sequence gaps) {b['seq_missing']}",
    ]
    lines += _cluster_lines(s)
    short = _run_length_line(s)
    if short:
        lines.append(short)
    lines.append(_memory_line(s))
    if s["dropped_by_reason"]:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped_by_reason"].items()))
        lines.append(f"  dropped by reason: {reasons}")
    for name, reasons in sorted(s.get("refused_producers", {}).items()):
        why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
        lines.append(f"  refused producer {name}: {why}")
    if s.get("producers_ended"):
        ends = ", ".join(f"{k} {v}" for k, v in sorted(s["producers_ended"].items()))
        lines.append(f"  producers ended: {ends}")
    bad = s.get("bad_records", {})
    if bad.get("skipped"):
        lines.append(
            f"  bad records skipped by the producers: {bad['skipped']} (--on-bad-record skip), "
            f"the first: {'; '.join(bad['first'])}"
        )
    for left in s.get("producers_left", []):
        lines.append(
            f"  producer {left['producer']} left after {left['ended_after']} batches: "
            f"{left['reason']}: {left['detail']}"
        )
    if s.get("connections"):
        events = ", ".join(f"{k} {v}" for k, v in sorted(s["connections"].items()))
        lines.append(f"  connections: {events}")
    lines.append("  per producer:")
    for name, p in s["producers"].items():
        dropped = sum(p.get("dropped", {}).values())
        lines.append(
            f"    {name}: received {p.get('received', 0)}, trained {p.get('trained', 0)}, "
            f"queued at stop {p.get('queued_at_stop', 0)}, abandoned {p.get('abandoned', 0)}, "
            f"in the intake {p.get('not_enqueued', 0)}, dropped {dropped}"
            + (f" {p['dropped']}" if dropped else "")
            + (f", missing {p['seq_missing']}" if p.get("seq_missing") else "")
            + (f", ended {p['end_reason']}" if p.get("end_reason") else "")
        )
    if s.get("advice"):
        lines.append(f"  advice: {s['advice']}")
    return "\n".join(lines)
