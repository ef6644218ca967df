"""Small statistics helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan
