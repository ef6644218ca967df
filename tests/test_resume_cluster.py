"""A MultiWorkerMirroredStrategy cluster resumes exactly (docs/resume.md, "Several trainer
workers"): two ``stagefeed train`` workers (``TF_CONFIG`` on loopback), each fed by its own
``stagefeed produce --shard-group g/2`` (one shard each; one in shared memory, the other over
tcp), killed with SIGKILL and re-run until the data ends; and, elastic, resumed as one trainer
with one producer (docs/resume.md, "Another producer count").

The model (``tests/helpers/resume_models.py:keras_counter``) counts how often each row was trained
(its
counter adds every worker's rows, all-reduced, so every copy is the same) and fits one scalar
with Adam. Only the chief's ``--save DIR`` is read: it reaches the other worker at start (the
step, the union of the workers' books, the weights). Every row trained exactly ``EPOCHS``
times, ``optimizer.iterations`` equal to the steps, and the scalar equal to one uninterrupted
``fit`` of as many steps (the global batch's mean gradient is a single batch's here, since
every row's target is the same) show that nothing was trained twice or skipped, on either
worker, and that the weights and the optimizer went on unbroken on both.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.conftest import cli_env
from tests.helpers.procs import log_text, wait_log
from tests.helpers.resume_models import keras_reference_w, keras_state_in, miscounted, stream
from tests.test_cluster_cli import cluster_config, distinct_ports

WORKERS = 2
STEPS = len(stream(0, WORKERS))  # one shard a worker, every pass: 24 steps, a batch a worker
TIMEOUT_S = 240  # two TensorFlow workers and two producers on two shared cores
MODEL = [
    "--schema", "tests.helpers.resume_models:SCHEMA", "--model",
        "tests.helpers.resume_models:keras_counter",
    "--warmup-steps", "0", "--progress-s", "100", "--producer-timeout-s", "4",
    "--enqueue-threads", "1", "--transport", "auto",
]  # fmt: skip
# Worker 0's producer hands its batches over in shared memory, worker 1's over ZeroMQ (tcp).
TRANSPORTS = ("shm", "zmq")


class ClusterRun:
    """The cluster's processes, started with the same flags each time: ``feeds`` (the workers'
    feed ports) stay, so producers kept running reach the workers started again."""

    def __init__(self, start_cli, tmp_path) -> None:
        self.start_cli = start_cli
        self.tmp_path = tmp_path
        self.feeds = [f"tcp://127.0.0.1:{port}" for port in distinct_ports(WORKERS)]
        self.trainers: list = []
        self.producers: list = []

    def save(self, index: int):
        return self.tmp_path / f"save-{index}"

    def start_trainers(self, round_name: str) -> None:
        tf_ports = distinct_ports(WORKERS)
        self.trainers = [
            self.start_cli(
                ["train", *MODEL, "--bind", self.feeds[i], "--steps", "0",
                 "--checkpoint-every", "5", "--save", str(self.save(i)),
                 "--json", str(self.tmp_path / f"{round_name}-{i}.json")],
                name=f"{round_name}-worker-{i}",
                env=cli_env(TF_CONFIG=cluster_config(i, tf_ports)),
            )  # fmt: skip
            for i in range(WORKERS)
        ]

    def start_producers(self, round_name: str, rate: int = 4, source: str = "rows") -> None:
        self.producers = [self.start_producer(g, round_name, rate, source)
                          for g in range(WORKERS)]  # fmt: skip

    def start_producer(self, group: int, round_name: str, rate: int, source: str = "rows"):
        return self.start_cli(
            ["produce", "--connect", self.feeds[group], "--workers", "1",
             "--transport", TRANSPORTS[group], "--shard-group", f"{group}/{WORKERS}",
             "--schema", "tests.helpers.resume_models:SCHEMA",
             "--source", f"tests.helpers.resume_models:{source}", "--rate", str(rate)],
            name=f"{round_name}-producer-{group}",
        )  # fmt: skip

    def kill_at(self, pattern: str, *, producers: bool) -> str:
        """SIGKILL the workers (and the producers), once the chief's log has ``pattern``;
        the chief's log."""
        chief = self.trainers[0]
        assert wait_log(chief, pattern, TIMEOUT_S), log_text(chief)[-4000:]
        for proc in self.trainers + (self.producers if producers else []):
            proc.kill_group()
        return log_text(chief)

    def summary(self, round_name: str, index: int) -> dict:
        return json.loads((self.tmp_path / f"{round_name}-{index}.json").read_text())


def _resumed_step(text: str) -> int:
    found = re.search(r"resuming from \S+state-(\d+)\.json: step (\d+)", text)
    assert found and int(found.group(1)) == int(found.group(2)), text[-4000:]
    return int(found.group(2))


@pytest.mark.slow
def test_a_cluster_killed_twice_resumes_and_trains_every_row_exactly_epochs_times(
    start_cli, tmp_path
):
    run = ClusterRun(start_cli, tmp_path)
    # 1. Everything killed mid-run (the trainers and the producers).
    run.start_trainers("first")
    run.start_producers("first")
    run.kill_at(r"step 10: checkpoint", producers=True)
    # 2. All started again; only the trainers killed, at their first checkpoint of this run:
    #    the producers keep running, and rewind when the next workers welcome them. At 2
    #    batches a second they are still sending then (14 batches left each, 5 trained).
    run.start_trainers("second")
    run.start_producers("second", rate=2)
    text = run.kill_at(r"resuming from(?s:.*)step \d+: checkpoint", producers=False)
    first_resume = _resumed_step(text)
    assert first_resume >= 10 and first_resume % 5 == 0
    # A producer that had sent its last batch and its end before the kill is still there: it
    # stays until a checkpoint holds its whole shard, so it rewinds like the others.
    assert all(p.proc.poll() is None for p in run.producers)
    # 3. The workers again, with the producers: to the end of the data.
    run.start_trainers("last")
    for index, trainer in enumerate(run.trainers):
        assert trainer.wait(TIMEOUT_S) == 0, log_text(trainer)[-4000:]
        base = _resumed_step(log_text(trainer))  # every worker resumes the chief's checkpoint
        assert base > first_resume
        summary = run.summary("last", index)
        assert (summary["steps"], summary["resumed_from"]) == (STEPS - base, base), summary
        assert summary["batches"]["trained"] == STEPS - base
        by_shm = (summary["shm"] or {}).get("batches", 0)
        assert by_shm == (summary["batches"]["received"] if TRANSPORTS[index] == "shm" else 0)
    for producer in run.producers:  # let go by the final checkpoint, on either worker
        assert producer.wait(TIMEOUT_S) == 0, log_text(producer)[-3000:]
        assert "the trainer moved shard" in log_text(producer), log_text(producer)[-3000:]
        assert "the trainer saved all 24 batches" in log_text(producer)
    chief_text = log_text(run.trainers[0])
    assert f"resumed from step {base}" in chief_text
    counts, w, iterations = keras_state_in(str(run.save(0) / "model.keras"))
    assert not miscounted(counts), miscounted(counts)
    assert iterations == STEPS
    assert np.isclose(w, keras_reference_w(STEPS), rtol=1e-5, atol=0), w
    state = json.loads((run.save(0) / "state.json").read_text())
    assert state["step"] == STEPS and state["finished"], state
    # The union of the workers' books: each worker trained its one shard, all of it.
    streams = state["input"]["streams"]
    assert state["input"]["shards"] == WORKERS
    assert {s: (p["next"], p["above"]) for s, p in streams.items()} == {
        str(g): (STEPS, []) for g in range(WORKERS)
    }
    assert not (run.save(1) / "state.json").exists()  # only the chief writes


@pytest.mark.slow
def test_two_workers_killed_resume_as_one_trainer_and_train_every_row_exactly_epochs_times(
    start_cli, tmp_path
):
    """Elastic: a cluster of two workers fed by a MapSource (its epochs as one stream), killed
    with SIGKILL, resumed as one ``stagefeed train`` with one producer: the chief's checkpoint
    of 2 shards (the union of both workers' books) is dealt out to 1, every row once an epoch."""
    run = ClusterRun(start_cli, tmp_path)
    run.start_trainers("cluster")
    run.start_producers("cluster", source="mapped")
    run.kill_at(r"step 10: checkpoint", producers=True)
    one = start_cli(["train", *MODEL, "--bind", run.feeds[0], "--steps", "0",
                     "--checkpoint-every", "5", "--save", str(run.save(0))],
                    name="one-trainer")  # fmt: skip
    producer = start_cli(
        ["produce", "--connect", run.feeds[0], "--workers", "1", "--transport", "shm",
         "--schema", "tests.helpers.resume_models:SCHEMA",
         "--source", "tests.helpers.resume_models:mapped"], name="one-producer",
    )  # fmt: skip
    assert one.wait(TIMEOUT_S) == 0, log_text(one)[-4000:]
    text = log_text(one)
    assert "position of 2 shards is dealt out to 1" in text, text[-4000:]
    base = _resumed_step(text)
    assert base >= 10, text[-4000:]
    assert producer.wait(TIMEOUT_S) == 0, log_text(producer)[-3000:]
    counts, _, _ = keras_state_in(str(run.save(0) / "model.keras"))
    assert not miscounted(counts), miscounted(counts)
    state = json.loads((run.save(0) / "state.json").read_text())
    # Both workers trained a batch a step before (2 * base batches), the one trainer one a
    # step after: the rest of the 48 (stream(0, 1): one shard carries every batch).
    assert state["step"] == base + len(stream(0, 1)) - 2 * base, state["step"]
    assert state["input"]["shards"] == 1 and state["finished"], state


@pytest.mark.slow
def test_a_checkpoint_that_would_leave_the_workers_unequal_batches_is_refused_at_start(
    start_cli, tmp_path
):
    """One trainer fed by two producers of a MapSource (shards 0 and 1 of 2), shard 0 ten
    times as fast, killed at a checkpoint, then resumed as a cluster of two: worker 0 (shard
    0's global batches) would have far fewer batches left than worker 1, and the cluster would
    stop with some of worker 1's never trained. Both workers refuse at start in one line
    naming the checkpoint (exit 2), and nothing is trained or written."""
    run = ClusterRun(start_cli, tmp_path)
    one = start_cli(["train", *MODEL, "--bind", run.feeds[0], "--steps", "0",
                     "--checkpoint-every", "5", "--save", str(run.save(0))],
                    name="one-trainer")  # fmt: skip
    run.trainers = [one]
    run.producers = [
        start_cli(
            ["produce", "--connect", run.feeds[0], "--workers", "1", "--shard-group",
             f"{group}/2", "--schema", "tests.helpers.resume_models:SCHEMA",
             "--source", "tests.helpers.resume_models:mapped", "--rate", rate],
            name=f"one-producer-{group}",
        )  # fmt: skip
        for group, rate in ((0, "40"), (1, "4"))
    ]
    run.kill_at(r"step 10: checkpoint", producers=True)
    states = sorted((run.save(0) / "checkpoints").glob("state-*.json"))
    run.start_trainers("refused")
    for trainer in run.trainers:
        assert trainer.wait(TIMEOUT_S) == 2, log_text(trainer)[-4000:]
        errors = [s for s in log_text(trainer).splitlines() if s.startswith("stagefeed: error")]
        assert len(errors) == 1, errors
        assert "cannot resume exactly on 2 trainer workers" in errors[0], errors
        assert f"the checkpoint {states[-1]}" in errors[0], errors
        assert "Traceback" not in log_text(trainer)
    assert sorted((run.save(0) / "checkpoints").glob("state-*.json")) == states


@pytest.mark.slow
def test_a_shard_fed_to_two_workers_is_refused_at_the_first_checkpoint(start_cli, tmp_path):
    """Both producers say they are shard 0 of 2, one to each worker: each worker would train
    that shard's batches, blind to the other's. At the first checkpoint every worker stops
    with one line naming the shard and both workers (exit 2), and no state file is written."""
    run = ClusterRun(start_cli, tmp_path)
    run.start_trainers("twice")
    run.producers = [
        start_cli(
            ["produce", "--connect", run.feeds[g], "--workers", "1", "--shard-group", "0/2",
             "--schema", "tests.helpers.resume_models:SCHEMA", "--source",
                 "tests.helpers.resume_models:rows",
             "--rate", "4"],
            name=f"twice-producer-{g}",
        )  # fmt: skip
        for g in range(WORKERS)
    ]
    for trainer in run.trainers:
        assert trainer.wait(TIMEOUT_S) == 2, log_text(trainer)[-4000:]
        # (TensorFlow's heartbeat thread may log after it: the other worker had exited)
        errors = [s for s in log_text(trainer).splitlines() if s.startswith("stagefeed: error")]
        assert len(errors) == 1 and "shard 0 is fed to workers 0 and 1" in errors[0], errors
        assert "Traceback" not in log_text(trainer)
    assert not list((run.save(0) / "checkpoints").glob("state-*.json"))


def test_a_cluster_worker_refuses_a_producer_with_passes():
    """A pass ends when every shard ended it, and a cluster worker sees only its own shards:
    the hello of a source with passes is refused (reason ``shard``), saying why. The worker's
    place is handed to the intake (resolved from TF_CONFIG where the trainer is made)."""
    import zmq

    from stagefeed.common import protocol, tf_config
    from stagefeed.common.options import TrainerOptions
    from stagefeed.consumer.books.ledger import Ledger
    from stagefeed.consumer.intake.intake import Intake
    from tests.helpers.resume_models import SCHEMA

    place = tf_config.place({"TF_CONFIG": cluster_config(1, distinct_ports(WORKERS))})
    options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1)
    intake = Intake(options, SCHEMA, lambda arrays, peer, seq: True, Ledger(), place=place)
    intake.start()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(intake.endpoint)
        sock.send(protocol.encode_control(
            "hello", name="p-passes", schema=None, shard=0, shards=2, seek=True, passes=True
        ))  # fmt: skip
        assert sock.poll(10_000), "no reply from the intake"
        reply = protocol.decode_header(sock.recv(), protocol.FROM_TRAINER)
        assert reply["t"] == "refused" and reply["reason"] == "shard", reply
        assert "worker of a cluster of 2 (TF_CONFIG)" in reply["detail"], reply
    finally:
        intake.close()
        ctx.destroy(linger=0)
