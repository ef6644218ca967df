"""Live progress: a rewritten line on a terminal, plain periodic log lines otherwise.

``Progress`` only formats and writes; the ``Monitor`` decides when (``interval_s``) and hands
it the figures of the window since the previous line.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import TextIO

from stagefeed.consumer.observe.figures import Figures

log = logging.getLogger("stagefeed.progress")

# On a terminal the line is rewritten in place, so it can change often.
TTY_INTERVAL_S = 0.5
CLEAR_LINE = "\r\x1b[K"


def format_line(f: Figures, steps_planned: int = 0) -> str:
    """``step 40/100  98 ms/step  20 img/s  stall 31%  queue 3/434 (3.5 MiB) ...``.

    ``steps_planned`` 0 means "until stopped" (shown as ``-``).
    """
    line = (
        f"step {f.last_step}/{steps_planned or '-'}  "
        f"{_num(f.ms_per_step)} ms/step  {_num(f.images_per_s)} img/s  "
        f"stall {_num(f.stall_pct)}%  "
        f"queue {f.queue_batches}/{f.queue_capacity} ({f.queue_mb:.1f} MiB)  "
        f"{f.received_mb_per_s:.0f} MiB/s in  "
        f"producers {f.producers_active}/{f.producers_seen}"
    )
    if f.dropped_total:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(f.dropped.items()))
        line += f"  dropped {f.dropped_total} ({reasons})"
    return line


def _num(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


class Progress:
    """Writes progress lines to ``stream`` (a terminal) or to the log (anything else).

    On a terminal the line is rewritten in place (``\\r`` + clear); ``break_line()`` ends it
    so that another message can be printed below, and ``finish()`` ends it for good.
    """

    def __init__(self, interval_s: float = 5.0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = TTY_INTERVAL_S if self.tty else interval_s
        self._line_open = False

    def show(self, figures: Figures, steps_planned: int = 0) -> None:
        line = format_line(figures, steps_planned)
        if self.tty:
            self.stream.write(CLEAR_LINE + line)
            self.stream.flush()
            self._line_open = True
        else:
            log.info("%s", line)

    def break_line(self) -> None:
        """End the rewritten line (terminal only), so the next output starts on its own."""
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False

    def finish(self) -> None:
        self.break_line()
