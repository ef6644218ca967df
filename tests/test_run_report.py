"""The summary reads a frozen ``RunReport`` the trainer builds at its end, never the trainer
(issue 29; docs/architecture.md: "facts and readers, never a trainer"): a cluster worker's
place is in the report, not probed on the trainer.

Covers consumer/run_report.py, consumer/observe/summary.py, TrainerBase.report.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import image_schema
from stagefeed.consumer.graph.trainer import Trainer
from stagefeed.consumer.observe import summary as summary_module
from stagefeed.consumer.observe.summary import format_text, summarize
from stagefeed.consumer.run_report import ClusterReport, RunReport

SPEC = image_schema(batch_size=2)


def test_a_trainer_reports_its_run_frozen_and_the_summary_reads_only_that():
    trainer = Trainer(TrainerOptions(bind="tcp://127.0.0.1:*", schema=SPEC, steps=3))
    report = trainer.report()
    assert isinstance(report, RunReport) and report.cluster is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.steps_done = 7  # type: ignore[misc]
    summary = summarize(report, None, wall_s=1.0, interrupted=True)
    assert summary["steps"] == 0
    assert summary["run_length"]["planned_steps"] == trainer.options.total_steps == 5
    assert summary["device"] == trainer.device and "cluster" not in summary


def test_a_cluster_workers_place_and_books_come_from_its_report():
    trainer = Trainer(TrainerOptions(bind="tcp://127.0.0.1:*", schema=SPEC, steps=3))
    books = {"workers": 2, "steps": 5, "received": 10, "trained": 10, "queued": 0,
             "abandoned": 0, "not_enqueued": 0, "dropped": 0, "seq_missing": 0}  # fmt: skip
    report = dataclasses.replace(trainer.report(), cluster=ClusterReport(1, 2, False, books))
    summary = summarize(report, None, wall_s=1.0, interrupted=False)
    assert summary["cluster"] == {"worker": 1, "workers": 2, "chief": False, "books": books}
    assert "  cluster: worker 1/2; all workers: 5 steps" in format_text(summary)


def test_the_summary_module_takes_no_trainer():
    source = pathlib.Path(summary_module.__file__).read_text()
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "trainer" not in names and "getattr" not in names
    assert "trainer_base" not in source
