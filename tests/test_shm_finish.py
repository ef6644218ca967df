"""A finite producer over shared memory: every batch it handed over is trained, none dropped,
also the last ones, whose descriptors may still be on their way when the producer closes its
pool (its fd channel's EOF reaches the trainer before ZeroMQ's last messages do)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import procs, shm_procs

pytestmark = pytest.mark.slow  # TensorFlow in a subprocess

BATCHES = 40


def test_finite_producers_over_shared_memory_lose_nothing_at_their_end(spawn):
    trainer = shm_procs.CanaryTrainer(spawn)  # ends once every producer's data ended
    producers = [
        shm_procs.produce(spawn, trainer.endpoint, "--max-batches", str(BATCHES), "--rate",
                          "20", name=f"p{i}")  # 2 s each: all connect before one ends
        for i in range(3)
    ]  # fmt: skip
    workers = [procs.workers_of(p, 1)[0] for p in producers]
    for producer in producers:
        assert producer.wait(90) == 0, procs.log_text(producer)
    assert trainer.started.wait(90) == 0, trainer.log()[-3000:]
    with open(trainer.json_path) as f:
        summary = json.load(f)
    assert summary["data_ended"], summary
    assert summary["batches"]["dropped"] == 0, summary["dropped_by_reason"]
    for worker in workers:
        (books,) = [b for n, b in summary["producers"].items() if f"-{worker.pid}-" in n]
        assert books["trained"] == BATCHES and books["seq_missing"] == 0, books
    assert summary["shm"]["batches"] == len(producers) * BATCHES  # all by shared memory
