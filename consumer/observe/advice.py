"""Advice from figures: which side limits the step, and what to change. Pure functions.

Rules, in order (thresholds are the constants below; docs/observability.md explains them):

1. Fewer than ``MIN_STEPS`` steps in the window: ``unknown``.
2. Stall >= ``INPUT_BOUND_STALL_PCT``: the step waits for data.
   - ``wire-bound`` if the received rate is near the link (>= ``WIRE_NEAR`` x ``wire_mb_s``) or
     the step would need more than the link carries; float32 images: "switch --dtype uint8".
   - otherwise ``input-bound``: producers needed = ceil(consumed / delivered per producer).
     Where the host's core use in the window is known (``Figures.host_busy_pct``), the advice
     says where they fit, a producer keeping about one core busy: on other hosts when its
     cores are ``HOST_SATURATED_PCT`` % busy, else as many here as its idle cores allow.
3. Queue full in >= ``COMPUTE_BOUND_FULL_PCT`` % of the steps, or still filling (producers
   deliver >= ``GROWING`` x what the steps take): ``compute-bound``; producers can be reduced to
   ceil(``HEADROOM`` x consumed / one producer's unthrottled rate) when that rate was observed.
4. Otherwise ``balanced``.

Dropped messages and sequence gaps in the window are appended to any advice.
"""

from __future__ import annotations

import dataclasses
import math

from stagefeed.common.options import DEFAULT_WIRE_MB_S
from stagefeed.consumer.observe.figures import Figures

MIN_STEPS = 2
INPUT_BOUND_STALL_PCT = 10.0
COMPUTE_BOUND_FULL_PCT = 50.0
GROWING = 1.1
HEADROOM = 1.25
WIRE_NEAR = 0.8
HOST_SATURATED_PCT = 90.0

INPUT_BOUND = "input-bound"
WIRE_BOUND = "wire-bound"
COMPUTE_BOUND = "compute-bound"
BALANCED = "balanced"
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Advice:
    kind: str  # one of the constants above
    text: str  # one line, starting with ``kind``


def advise(f: Figures, wire_mb_s: float = DEFAULT_WIRE_MB_S) -> Advice:
    """The advice for one window of figures (see the module docstring for the rules)."""
    if f.steps < MIN_STEPS or math.isnan(f.stall_pct):
        kind, text = UNKNOWN, f"{UNKNOWN}: {f.steps} steps in {f.seconds:.0f} s, too few to judge"
    elif f.stall_pct >= INPUT_BOUND_STALL_PCT:
        kind, text = _starved(f, wire_mb_s)
    elif f.queue_full_pct >= COMPUTE_BOUND_FULL_PCT or _queue_growing(f):
        kind, text = COMPUTE_BOUND, _compute_bound(f)
    else:
        kind = BALANCED
        text = (
            f"{BALANCED}: {f.stall_pct:.1f}% of step time waiting for data, queue "
            f"{f.queue_mean_batches:.0f} of {f.queue_capacity} batches on average; "
            "input keeps up with the step"
        )
    return Advice(kind, text + _losses(f))


def producers_needed(consume_per_s: float, per_producer_per_s: float) -> int:
    """Producers delivering ``per_producer_per_s`` each that keep up with ``consume_per_s``."""
    if not per_producer_per_s > 0 or not consume_per_s > 0:
        raise ValueError("rates must be positive")
    return max(1, math.ceil(consume_per_s / per_producer_per_s - 1e-9))


def _starved(f: Figures, wire_mb_s: float) -> tuple[str, str]:
    head = f"{f.stall_pct:.0f}% of step time waiting for data"
    need_mb_s = f.consume_per_s * f.batch_mb
    if f.received_mb_per_s >= WIRE_NEAR * wire_mb_s or need_mb_s > wire_mb_s:
        fix = (
            "send the largest array as uint8 with a cast in the schema (--dtype uint8 for "
            "images) to move 4x fewer bytes"
            if f.wire_dtype == "float32"
            else "only fewer bytes per batch or a faster link will help"
        )
        return WIRE_BOUND, (
            f"{WIRE_BOUND}: {head} while receiving {f.received_mb_per_s:.0f} MiB/s of a "
            f"~{wire_mb_s:.0f} MiB/s link (the step needs {need_mb_s:.0f}); {fix}"
        )
    if f.producers_active == 0 or f.deliver_per_s <= 0:
        return INPUT_BOUND, (
            f"{INPUT_BOUND}: {head}; no producer delivered a batch in the last {f.seconds:.0f} s"
        )
    if not f.consume_per_s > 0:  # no step timed in the window (a run that ended early)
        return INPUT_BOUND, (
            f"{INPUT_BOUND}: {head}; producers deliver {f.deliver_per_s:.1f} batches/s"
        )
    per_producer = f.deliver_per_s / f.producers_active
    more = max(1, producers_needed(f.consume_per_s, per_producer) - f.producers_active)
    return INPUT_BOUND, (
        f"{INPUT_BOUND}: {head}; producers deliver {f.deliver_per_s:.1f} batches/s, the step "
        f"consumes {f.consume_per_s:.1f}: about {more} more {_plural(more, 'producer')} needed"
        + _where_they_fit(f, more)
    )


def _where_they_fit(f: Figures, more: int) -> str:
    """Where ``more`` producers can run, by the host's cores (nothing when unknown)."""
    if f.host_cores < 1 or math.isnan(f.host_busy_pct):
        return ""
    cores = f"{f.host_cores} {_plural(f.host_cores, 'core')} {'is' if f.host_cores == 1 else 'are'}"
    busy = f"this host's {cores} {f.host_busy_pct:.0f}% busy"
    if f.host_busy_pct >= HOST_SATURATED_PCT:
        return f", on other hosts: {busy}, so producers here would only slow the others"
    room = int(f.host_cores * (100.0 - f.host_busy_pct) / 100.0)  # idle cores, whole
    if room < more:
        here = f"about {room} here" if room else "none here"
        return f"; {busy}: {here}, the rest on other hosts"
    return ""


def _queue_growing(f: Figures) -> bool:
    return f.queue_batches > 0 and f.deliver_per_s >= GROWING * f.step_per_s


def _compute_bound(f: Figures) -> str:
    if f.queue_full_pct >= COMPUTE_BOUND_FULL_PCT:
        head = f"{COMPUTE_BOUND}: queue full {f.queue_full_pct:.0f}% of the time"
    else:
        state = "full" if f.queue_batches >= f.queue_capacity else "filling"
        head = (
            f"{COMPUTE_BOUND}: queue {state} ({f.queue_batches} of {f.queue_capacity} batches), "
            f"producers deliver {f.deliver_per_s:.1f} batches/s, the step consumes "
            f"{f.consume_per_s:.1f}"
        )
    active = max(f.producers_active, 1)
    capacity = f.producer_capacity_per_s
    if capacity > 0 and f.consume_per_s > 0:
        enough = producers_needed(HEADROOM * f.consume_per_s, capacity)
        if enough < active:
            return f"{head}; producers can be reduced to {enough}"
        if enough == active:
            verb = "is" if active == 1 else "are"
            return (
                f"{head}; the train step is the limit: {active} {_plural(active, 'producer')} "
                f"{verb} just enough"
            )
    return f"{head}; the train step is the limit: more producers will not help"


def _plural(n: int, noun: str) -> str:
    return noun if n == 1 else noun + "s"


def _losses(f: Figures) -> str:
    out = ""
    if f.dropped_total:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(f.dropped.items()))
        out += f"; {f.dropped_total} messages dropped ({reasons})"
    if f.seq_missing > 0:
        out += f"; {f.seq_missing} batches missing (sequence gaps)"
    return out
