"""A producer's source that fails mid-run, through the real CLI (README "Exit codes"): a batch
the schema refuses (``SchemaMismatch``: the source breaks the data contract) is exit 2, an
exception raised by the source's own code is exit 3 (something failed while running; a rerun
may get past it), from ``stagefeed produce`` and from ``run`` (the summary first), each with
one line naming the source last on stderr and no traceback."""

from __future__ import annotations

import pytest

from stagefeed.common.errors import EXIT_BROKEN, EXIT_CONFIG
from tests.conftest import run_cli
from tests.helpers import regression_models
from tests.helpers.standin_trainer import StandInTrainer

CASES = [
    ("wrong_third", EXIT_CONFIG,
        "stagefeed: error: source 'tests.helpers.regression_models:wrong_third' "
     "batch 2 is short: 3 rows"),
    ("raises_third", EXIT_BROKEN,
        "ERROR MainProcess stagefeed: source 'tests.helpers.regression_models:"
     "raises_third' failed at batch 2: OSError: the data volume went away"),
]  # fmt: skip
IDS = ["schema_mismatch", "source_raises"]
SOURCE = ["--schema", "tests.helpers.regression_models:SCHEMA", "--max-batches", "10"]


def _ends_in_one_line(done, code: int, line: str) -> None:
    said = done.stdout + done.stderr[-3000:]
    assert done.returncode == code, said
    assert "Traceback" not in done.stderr, said
    last = done.stderr.strip().splitlines()[-1]
    assert line in last, said


@pytest.mark.parametrize(("source", "code", "line"), CASES, ids=IDS)
def test_produce_exits_with_the_code_of_its_sources_failure(source, code, line):
    with StandInTrainer(regression_models.SCHEMA, regrant=True) as trainer:
        done = run_cli(
            ["produce", "--connect", trainer.endpoint, *SOURCE,
             "--source", f"tests.helpers.regression_models:{source}"], timeout=60,
        )  # fmt: skip
    _ends_in_one_line(done, code, line)
    assert len(trainer.received) == 2  # the good batches were delivered first


@pytest.mark.parametrize(("source", "code", "line"), CASES, ids=IDS)
def test_run_exits_with_the_code_of_its_sources_failure_after_the_summary(source, code, line):
    done = run_cli(
        ["run", *SOURCE, "--source", f"tests.helpers.regression_models:{source}", "--producers",
            "1",
         "--model", "tests.helpers.regression_models:linear_fn", "--steps", "0",
             "--enqueue-threads", "1",
         "--warmup-steps", "0"], timeout=90,
    )  # fmt: skip
    _ends_in_one_line(done, code, line)
    assert "stagefeed summary" in done.stdout and "batches received 2," in done.stdout
    # Drained first in both cases (consumer/run_end.py): the launcher's pool check leaves a
    # worker that said end to the trainer's rule, and reports its failure after the summary.
    assert "received 2, trained 2," in done.stdout, done.stdout
