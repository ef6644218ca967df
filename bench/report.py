"""What every bench report carries: the machine, the date, figures rounded, JSON on disk."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from stagefeed.common.stats import percentile


def machine() -> dict[str, Any]:
    """The conditions of a run; ``load_avg`` says how busy the machine was when it started."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        model = platform.processor()
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "cpu": model,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
    }


def rounded(value: float | None, digits: int = 2) -> float | None:
    """JSON-safe: ``None`` for missing or non-finite figures."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def step_figures(step_s: Sequence[float], batch_size: int) -> dict[str, Any]:
    """Median/p10/p90 ms per step and images/s (total images over total step time)."""
    ms = [s * 1000 for s in step_s]
    total = sum(step_s)
    return {
        "steps": len(ms),
        "median_ms": rounded(percentile(ms, 50)),
        "p10_ms": rounded(percentile(ms, 10)),
        "p90_ms": rounded(percentile(ms, 90)),
        "images_per_s": rounded(len(ms) * batch_size / total if total > 0 else math.nan),
    }


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
