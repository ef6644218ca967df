"""The promise matrix: the promises of docs/guarantees.md and docs/resume.md (rows) against
every way a user runs stagefeed (columns), and the short list of cells that do not apply.

Every cell is either checked by a scenario of ``tests/matrix/test_matrix.py`` (``SCENARIOS``
says which rows each checks, on which columns) or listed in ``NOT_APPLICABLE`` with its reason;
``tests/test_promise_grid.py`` (in ``make test``, no process) fails on a cell that is neither. A
new path is a new entry of ``PATHS``: it fails until each row has a scenario on it or a reason.
docs/guarantees.md ("The promise matrix") shows this table (``markdown()``).
"""

from __future__ import annotations

import dataclasses
import fnmatch

# Rows: id -> the promise, as the docs state it.
PROMISES: dict[str, str] = {
    "stop_sigint": "SIGINT stops it within the bound: exit 0, the summary (or the with-block "
    "closes the feed), everything it started ended",
    "stop_sigterm": "SIGTERM does the same as SIGINT",
    "liveness": "from start to stop a log line at least every LIVENESS_S: progress, or what it "
    "waits for",
    "length_follows_passes": "with a source that has passes and no --steps, the run is its "
    "passes: every planned batch trained, the epochs in the summary",
    "exactly_once": "a complete run trains every row exactly E times",
    "exactly_once_across_kill": "with --save (or a saved position), across SIGINT, SIGTERM "
    "and kill -9, every row is trained exactly E times",
    "exactly_once_elastic": "with a built-in data source or a MapSource, killed with 2 "
    "producers and resumed with 3 (a cluster: 1 a worker, then 2), every row is trained "
    "exactly E times (docs/resume.md, Another producer count)",
    "finished_refused": "a finished run, run again, trains nothing more (the CLI, and a loop's "
    "ServedFeed resumed from its final position: refused in one line, exit 2; a cluster's "
    "other workers end after --cluster-join-timeout-s in one line, exit 3)",
    "nothing_left": "after an end, a stop or a kill -9 and the next start: no process, socket "
    "file or shared-memory segment left",
    "bad_source": "a source that raises mid-run: the batches before it trained, the summary, "
    "one line naming it, exit 3 (README's exit codes)",
    "bad_model": "a model that does not fit the schema: one line naming it, exit 2, no "
    "traceback (ServedFeed: it raises before any batch)",
}

# Columns: a path, the transport and the producers' speed against the trainer.
PATHS: dict[str, str] = {
    "graph_run": "stagefeed run, a graph-mode model_fn",
    "keras_run": "stagefeed run, a Keras build",
    "train_produce": "stagefeed train + stagefeed produce (Keras)",
    "feed_fit": "ServedFeed + model.fit (Python API)",
    "feed_loop": "ServedFeed + a tf.function loop (Python API)",
    "cluster": "two stagefeed train workers (TF_CONFIG) + a produce each",
}
TRANSPORTS = ("tcp", "shm")
SPEEDS = ("fast", "slow")


@dataclasses.dataclass(frozen=True)
class Column:
    path: str
    transport: str
    speed: str

    @property
    def id(self) -> str:
        return f"{self.path}-{self.transport}-{self.speed}"


COLUMNS = tuple(Column(p, t, s) for p in PATHS for t in TRANSPORTS for s in SPEEDS)

# Scenarios: name -> the rows one run of it checks, and the column pattern it runs on
# (``path-transport-speed`` with fnmatch wildcards).
SCENARIOS: dict[str, tuple[tuple[str, ...], str]] = {
    # A run stopped by SIGINT, resumed and stopped by SIGTERM, resumed and killed, resumed to
    # its end, then run again.
    "chain": (
        ("stop_sigint", "stop_sigterm", "liveness", "length_follows_passes", "exactly_once",
         "exactly_once_across_kill", "exactly_once_elastic", "finished_refused",
         "nothing_left"),
        "*",
    ),  # fmt: skip
    "bad_source": (("bad_source",), "*-fast"),
    "bad_model": (("bad_model",), "*-tcp-fast"),
}

# (row, column pattern) -> why the row does not apply there. Short, and each with its reason.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("bad_source", "*-slow"): "the source fails at its batch 3 whatever its pace: the fast "
    "column of the same path and transport checks it",
    ("bad_model", "*-shm-*"): "a model is checked before any producer connects: the "
    "transport plays no part (the tcp column checks it)",
    ("bad_model", "*-tcp-slow"): "a model is checked before any producer connects: their "
    "speed plays no part (the fast column checks it)",
    ("stop_sigterm", "feed_*"): "ServedFeed installs no signal handler in the user's "
    "process: SIGTERM's default action ends it at once, as kill -9 does (checked by "
    "exactly_once_across_kill and nothing_left on the same column)",
    ("length_follows_passes", "cluster-*"): "a cluster refuses sources with passes "
    "(docs/resume.md, Passes): its producers send the passes as one stream, and the run ends "
    "with the data (--steps 0)",
    ("bad_model", "feed_loop-*"): "a custom loop's step is the user's own code: ServedFeed "
    "never sees a model to check",
    ("finished_refused", "feed_fit-*"): "a fit on a ServedFeed saves no position, so no run "
    "is found finished: each fit is a new run",
    ("exactly_once_across_kill", "feed_fit-*"): "a fit on a ServedFeed has no saved position "
    "(docs/resume.md: a custom loop saves feed.position()); the CLI's Keras paths resume",
    ("exactly_once_elastic", "feed_fit-*"): "a fit on a ServedFeed has no saved position to "
    "deal out (as exactly_once_across_kill)",

}


def scenarios_for(row: str, column: Column) -> list[str]:
    return [
        name
        for name, (rows, pattern) in SCENARIOS.items()
        if row in rows and fnmatch.fnmatchcase(column.id, pattern)
    ]


def reason_for(row: str, column: Column) -> str | None:
    for (na_row, pattern), reason in NOT_APPLICABLE.items():
        if na_row == row and fnmatch.fnmatchcase(column.id, pattern):
            return reason
    return None


def cell(row: str, column: Column) -> str:
    """``n/a`` (a reason says so), the names of the scenarios that check it, or ``MISSING``
    (a defect of the matrix)."""
    if reason_for(row, column) is not None:
        return "n/a"
    return ", ".join(scenarios_for(row, column)) or "MISSING"


def columns_of(scenario: str) -> list[Column]:
    """The columns a scenario runs on: its pattern, less those where all its rows are n/a."""
    rows, pattern = SCENARIOS[scenario]
    return [
        c
        for c in COLUMNS
        if fnmatch.fnmatchcase(c.id, pattern)
        and any(reason_for(r, c) is None for r in rows)
    ]


def markdown() -> str:
    """The matrix as docs/guarantees.md shows it: a row per promise, a column per path (the
    transports and speeds folded: a cell lists what differs)."""
    head = "| promise | " + " | ".join(f"`{p}`" for p in PATHS) + " |"
    lines = [head, "|---" * (len(PATHS) + 1) + "|"]
    for row in PROMISES:
        cells = []
        for path in PATHS:
            marks = {c.id.removeprefix(path + "-"): cell(row, c) for c in COLUMNS if c.path == path}
            checked = [k for k, v in marks.items() if v not in ("n/a", "MISSING")]
            if len(checked) == len(marks):
                cells.append("all 4")
            elif checked:
                cells.append(", ".join(checked))
            else:
                cells.append("n/a")
        lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
