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
    """``step 40/100  98 ms/step  20 examples/s  stall 31%  queue 3/434 (3.5 MiB) ...``.

    ``steps_planned`` 0 means "until stopped" (shown as ``-``).
    """
    line = (
        f"step {f.last_step}/{steps_planned or '-'}  "
        f"{_num(f.ms_per_step)} ms/step  {_num(f.examples_per_s)} examples/s  "
        f"stall {_num(f.stall_pct)}%  "
        f"queue {f.queue_batches}/{f.queue_capacity} ({size_text(f.queue_mb)})  "
        f"{size_text(f.received_mb_per_s)}/s in  "
        f"producers {f.producers_active}/{f.producers_seen}"
    )
    if f.dropped_total:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(f.dropped.items()))
        line += f"  dropped {f.dropped_total} ({reasons})"
    return line


def size_text(mib: float) -> str:
    """A size given in MiB, in units that keep its digits: ``158 MiB``, ``3.5 MiB``, ``12 KiB``
    (small batches of tokens must not all read ``0.0 MiB``)."""
    if math.isnan(mib):
        return "- MiB"
    if mib >= 100:
        return f"{mib:.0f} MiB"
    if mib >= 1:
        return f"{mib:.1f} MiB"
    if mib * 1024 >= 1:
        return f"{mib * 1024:.0f} KiB"
    return f"{mib * 2**20:.0f} B"


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
