"""SIGTERM to ``stagefeed train`` workers of a TF_CONFIG cluster (real processes on loopback),
and the waiting line of a worker that has no data (consumer/cluster/trainer.py,
consumer/cluster/peer_stop.py, common/lifecycle.reclaim_stop_signals, consumer/wait_line.py).

TensorFlow's coordination service takes SIGTERM below Python once the strategy exists; the
trainer takes it back. SIGTERM goes to one worker's process or to both, as Kubernetes stops a
pod: every worker then stops after the same step within the single trainer's bound
(tests/test_signals.py), prints its summary, exits 0, and
the chief writes its final checkpoint (``--save``). A worker waiting for data (no producer,
or producers it refused) follows another's stop too, and says every ``--wait-log-s`` (2 s
here; the default 10 s: tests/test_wait_line.py) what it waits for.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import cli_env, free_tcp_port, wait_for
from tests.test_cluster_cli import KERAS, cluster_config, distinct_ports
from tests.test_signals import STEP_MS, STOP_WITHIN_S

pytestmark = pytest.mark.slow

START_S = 240  # two TensorFlow workers and their producers on two shared cores
WAIT_LOG_S = "2"  # --wait-log-s: the waiting line 2 s into the wait, not the default 10
WAITING = (
    r"waiting for data for (\d+) s \((\d+) producers seen, listening on tcp://127\.0\.0\.1:\d+\)"
)
PROGRESS = re.compile(r"step (\d+)/-")


class Workers:
    """Two ``stagefeed train`` workers of one cluster (``--steps 0``: until stopped, ``--save``
    each), optionally ``producers`` feeding both (``--connect`` twice)."""

    def __init__(
        self, start_cli, tmp_path, producers: int = 0, model: list[str] = KERAS,
        produce: list[str] = ("--schema", "tests.helpers.regression_models:SCHEMA"),
    ) -> None:  # fmt: skip
        self.tmp_path = tmp_path
        tf_ports = distinct_ports(2)
        feeds = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
        self.trainers = [
            start_cli(
                ["train", *model, "--bind", feeds[i], "--steps", "0", "--wait-log-s", WAIT_LOG_S,
                 "--json", str(tmp_path / f"worker-{i}.json"),
                 "--save", str(tmp_path / f"save-{i}")],
                name=f"worker-{i}", env=cli_env(TF_CONFIG=cluster_config(i, tf_ports)),
            )  # fmt: skip
            for i in range(2)
        ]
        self.producers = [
            start_cli(["produce", "--connect", feeds[0], "--connect", feeds[1], "--rate", "20",
                       *produce, "--seed", str(k)], name=f"producer-{k}")  # fmt: skip
            for k in range(producers)
        ]

    def log(self, index: int) -> str:
        return self.trainers[index].output()

    def summary(self, index: int) -> dict:
        return json.loads((self.tmp_path / f"worker-{index}.json").read_text())

    def steps(self, index: int) -> int:
        found = PROGRESS.findall(self.log(index))
        return int(found[-1]) if found else 0

    def wait_waiting_lines(self) -> None:
        """Both say what they wait for, ``--wait-log-s`` into the wait."""
        for i in range(2):
            assert wait_for(lambda i=i: re.search(WAITING, self.log(i)), START_S), (
                self.log(i)[-3000:])  # fmt: skip
            assert re.search(WAITING, self.log(i)).group(1) == WAIT_LOG_S, self.log(i)[-3000:]

    def stop(self, which: list[int]) -> float:
        """SIGTERM to the workers ``which``; every worker must end: the seconds it took, over
        the single trainer's bound (5 s plus the slowest step either logged)."""
        sent = time.monotonic()
        for i in which:
            self.trainers[i].signal()
        codes = [t.wait(120) for t in self.trainers]
        took = time.monotonic() - sent
        logs = [self.log(i) for i in range(2)]
        assert codes == [0, 0], [log[-4000:] for log in logs]
        step_s = max((int(ms) for log in logs for ms in STEP_MS.findall(log)), default=0) / 1000
        bound = STOP_WITHIN_S + step_s + 0.5
        assert took <= bound, (f"{took:.1f} s > {bound:.1f} s", [log[-3000:] for log in logs])
        for i, log in enumerate(logs):
            assert "stagefeed summary" in log and "Traceback" not in log, log[-4000:]
            assert ("SIGTERM received: stopping" in log) == (i in which), log[-4000:]
        summaries = [self.summary(i) for i in range(2)]
        assert [s["interrupted"] for s in summaries] == [i in which for i in range(2)]
        for producer in self.producers:
            producer.signal()
        return took


@pytest.mark.parametrize("signalled", [[0], [0, 1]], ids=["chief-only", "both"])
def test_sigterm_stops_two_workers_waiting_for_their_first_batch(start_cli, tmp_path, signalled):
    workers = Workers(start_cli, tmp_path)
    workers.wait_waiting_lines()
    for i in range(2):
        assert re.search(WAITING, workers.log(i)).group(2) == "0"  # no producer seen
    workers.stop(signalled)
    for i in range(2):
        log = workers.log(i)
        assert f"cluster: worker {signalled[-1]} stops after step 0" in log or (
            "cluster: worker 0, 1 stops after step 0" in log), log[-3000:]
        assert workers.summary(i)["steps"] == 0
    if signalled == [0]:  # worker 1 heard it through the coordination service
        assert "cluster: worker 0: stop requested; this worker takes no more" in workers.log(1)


@pytest.mark.parametrize("signalled", [[1], [0, 1]], ids=["worker-1-only", "both"])
def test_sigterm_stops_two_training_workers_after_the_same_step(start_cli, tmp_path, signalled):
    workers = Workers(start_cli, tmp_path, producers=2)
    assert wait_for(lambda: min(workers.steps(0), workers.steps(1)) >= 3, START_S), (
        workers.log(0)[-3000:], workers.log(1)[-3000:])  # fmt: skip
    workers.stop(signalled)
    summaries = [workers.summary(i) for i in range(2)]
    steps = summaries[0]["cluster"]["books"]["steps"]
    assert steps >= 3 and summaries[1]["cluster"]["books"]["steps"] == steps
    # The chief's final checkpoint, at the step both stopped after: resumable (not finished)
    state = json.loads((tmp_path / "save-0" / "state.json").read_text())
    assert state["step"] == steps and not state["finished"], state
    assert (tmp_path / "save-0" / "model.keras").exists()
    assert not (tmp_path / "save-1" / "state.json").exists()  # only the chief keeps one


def test_workers_whose_passes_producers_were_refused_say_they_wait_and_stop(start_cli, tmp_path):
    schema = ["--schema", "tests.helpers.passes_models:SCHEMA"]
    workers = Workers(
        start_cli, tmp_path, producers=1,
        model=[*schema, "--model", "tests.helpers.passes_models:keras_linear", "--enqueue-threads",
            "1"],
        produce=[*schema, "--source", "tests.helpers.passes_models:rows"],
    )  # fmt: skip
    for producer in workers.producers:  # refused by both workers: it exits saying why
        assert producer.wait(START_S) != 0
        assert "a source with passes feeds one trainer" in producer.output()
    workers.wait_waiting_lines()
    workers.stop([1])
