"""Two real trainers (``stagefeed train``), producers connected to both (issue 22): every
batch trained by exactly one trainer, none lost, both fed; one trainer killed mid-run, the
producers report it by endpoint and keep the other training.

The trainers run the tiny regression (tests/helpers/regression_models.py) in graph mode, at a
known pace: the feed is under test, not the model.
"""

from __future__ import annotations

import json
import re

import pytest

from stagefeed.common.options import ProducerOptions
from stagefeed.producer.pool import Producers
from tests.helpers import procs

pytestmark = pytest.mark.slow

# A queue of 2 batches and a step of 0.1 s: a trainer takes batches no faster than it trains, so
# both are fed by construction (one alone would need 8 s for 80 batches; under load, a fast one
# once took all of a producer's batches before the other's welcome came).
REGRESSION = [
    "--schema", "tests.helpers.regression_models:SCHEMA", "--batch-size", "4",
    "--model", "tests.helpers.regression_models:paced_linear_fn", "--queue-batches", "2",
]  # fmt: skip
STARTUP_S = 120


def trainers(spawn, transport: str = "zmq") -> tuple[procs.Trainer, procs.Trainer]:
    flags = [*REGRESSION, "--transport", transport]
    return (
        procs.Trainer(spawn, *flags, name="trainer-a"),
        procs.Trainer(spawn, *flags, name="trainer-b"),
    )


def summary(trainer: procs.Trainer) -> dict:
    with open(trainer.json_path) as f:
        return json.load(f)


@pytest.mark.parametrize("transport", ["zmq", "auto"])
def test_two_producers_feed_two_trainers_each_batch_trained_once(spawn, transport):
    """``auto``: both trainers are on this host, so each channel hands batches over in its
    own shared-memory pool, one pool per trainer."""
    a, b = trainers(spawn, transport)
    producers = spawn(
        ["produce", "--connect", a.endpoint, "--connect", b.endpoint, "--workers", "2",
         "--source", "tests.helpers.regression_models:sums", "--max-batches", "40",
         "--transport", transport],
        name="producers",
    )  # fmt: skip
    assert producers.wait(STARTUP_S) == 0, procs.log_text(producers)
    # --steps 0: each trainer ends by itself once every producer said end to it.
    for trainer in (a, b):
        assert trainer.started.wait(STARTUP_S) == 0, procs.log_text(trainer.started)
    log = procs.log_text(producers)
    made = {p: int(n) for p, n in re.findall(r"producer (\S+) finished: (\d+) batches", log)}
    assert len(made) == 2 and set(made.values()) == {40}, log
    # What each producer says it gave each trainer ...
    given = {
        (p, endpoint): int(n)
        for p, n, endpoint in re.findall(
            r"producer (\S+): (\d+) batches to the trainer at (\S+) ", log
        )
    }
    assert len(given) == 4, log
    books = {t.endpoint: summary(t)["producers"] for t in (a, b)}
    for producer, count in made.items():
        # ... is what that trainer booked, whole (seq 0..n-1, nothing missing, dropped or
        # twice), and trained, and the two add up to what the producer made.
        for endpoint, by_producer in books.items():
            stats = by_producer[producer]
            n = given[(producer, endpoint)]
            assert n > 0, (producer, endpoint)  # both trainers fed
            assert stats["received"] == n and stats["trained"] + stats["queued_at_stop"] == n
            assert (stats["seq_first"], stats["seq_last"]) == (0, n - 1)
            assert stats["seq_missing"] == 0 and stats["seq_duplicates"] == 0
            assert stats["trained_duplicates"] == 0 and stats["dropped"] == {}
        assert sum(given[(producer, e)] for e in books) == count
    assert "end not sent" not in log
    offered = re.findall(r"pool \S+ offered to the trainer at", log)
    assert len(offered) == (4 if transport == "auto" else 0), log  # 2 producers x 2 trainers


def test_a_trainer_killed_mid_run_is_reported_and_the_other_keeps_training(spawn):
    a, b = trainers(spawn)
    options = ProducerOptions(
        connect=(a.endpoint, b.endpoint), workers=2, source="tests.helpers.regression_models:sums",
        rate=40.0,
    )  # fmt: skip
    with Producers(options) as producers:
        for trainer in (a, b):
            trainer.wait_metrics(lambda m: procs.steps_of(m) >= 10, STARTUP_S)
        a.started.kill_group()  # SIGKILL: its summary is lost with it
        steps = procs.steps_of(b.metrics())
        ahead = b.wait_metrics(lambda m: procs.steps_of(m) >= steps + 40, 60)
        assert procs.steps_of(ahead) >= steps + 40  # b alone, still training
        assert producers.alive() == 2
    books = producers.books()
    assert [book.state for book in books] == ["stopped", "stopped"], books
    for book in books:
        assert book.trainers_lost == {a.endpoint: 1}, book
        assert book.trainers[b.endpoint]["sent"] > 0 and book.trainers[a.endpoint]["sent"] > 0
    final = b.stop()
    for stats in final["producers"].values():  # nothing lost on the way to b
        assert stats["seq_first"] == 0 and stats["seq_missing"] == 0, stats
