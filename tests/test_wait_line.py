"""The waiting line (consumer/wait_line.py): a trainer with no data says, every
``wait_log_s`` (10 s), what it waits for and where; the Keras ``train`` (its fit watcher) as
graph mode always did. The cluster's workers: tests/test_cluster_signals.py."""

from __future__ import annotations

import logging
import re

import pytest

from stagefeed.consumer.wait_line import WaitLine
from tests.conftest import free_tcp_port, wait_for

LINE = r"waiting for data for (\d+) s \((\d+) producers seen, listening on (\S+)\)"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_comes_every_interval_of_one_wait_and_counts_from_its_start(caplog):
    clock = Clock()
    line = WaitLine(10.0, lambda: 2, "tcp://127.0.0.1:5555", clock)
    caplog.set_level(logging.INFO, "stagefeed.consumer.wait_line")
    for now, steps, queued in [(100, 0, 0), (105, 0, 0), (110, 0, 0), (115, 0, 0), (120.5, 0, 0),
                               (121, 1, 0), (130, 1, 0), (131.5, 1, 0), (132, 1, 3)]:  # fmt: skip
        clock.now = now
        line.starved(steps, queued)
    said = [re.match(LINE, r.getMessage()).groups() for r in caplog.records]
    # 10 s and 20 s into the first wait; a step ended at 121: the next wait counts from there,
    # and says nothing before 10 s of it
    assert said == [("10", "2", "tcp://127.0.0.1:5555"), ("20", "2", "tcp://127.0.0.1:5555")]


@pytest.mark.slow
def test_a_keras_train_with_no_producer_says_what_it_waits_for(start_cli):
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    trainer = start_cli(
        ["train", "--schema", "tests.helpers.regression_models:SCHEMA",
         "--model", "tests.helpers.regression_models:build", "--bind", endpoint, "--steps", "0"],
        name="keras",
    )  # fmt: skip
    # The first line, 10 s into the wait (the interval's arithmetic: the fake-clock test above).
    found = wait_for(lambda: re.search(LINE, trainer.output()), 180)
    log = trainer.output()
    assert found, log[-3000:]
    assert re.findall(LINE, log)[0] == ("10", "0", endpoint), log[-3000:]
    trainer.signal()
    assert trainer.wait(60) == 0, trainer.output()[-3000:]


@pytest.mark.slow
def test_a_served_feed_with_no_producer_says_what_it_waits_for(caplog):
    """The Python API's feed is not silent either: its watcher says the line while nothing
    arrives (before: a user's program waiting for producers logged nothing)."""
    from stagefeed import ServedFeed, TrainerOptions
    from stagefeed.common.schema import image_schema

    options = TrainerOptions(bind=f"tcp://127.0.0.1:{free_tcp_port()}",
                             schema=image_schema(batch_size=2), wait_log_s=0.5)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="stagefeed.consumer.wait_line"), \
            ServedFeed(options) as feed:  # fmt: skip
        said = wait_for(lambda: len(_lines(caplog)) >= 2, 20)
        endpoint = feed.endpoint
    assert said, caplog.text
    assert f"(0 producers seen, listening on {endpoint})" in _lines(caplog)[-1]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for data" in r.getMessage()]
