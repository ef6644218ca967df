"""``produce()`` and ``Producers`` against the v2 trainer stand-in: final lines with true
numbers, buffer reuse safety, pings while a source blocks, failures carried to the pool."""

from __future__ import annotations

import logging
import re
import threading

import numpy as np
import pytest

from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.common.options import MIB, ProducerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer.pool import Producers
from stagefeed.producer.sources import WorkerInfo
from stagefeed.producer.worker import produce
from tests.conftest import wait_for
from tests.helpers.standin_trainer import StandInTrainer

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)
# 8 MiB a batch, a zero-copy frame then a copied one; values 0..99 fit both dtypes.
CANARY = Schema((ArraySpec("x", "float32", (2**19,)), ArraySpec("y", "uint8")), batch_size=4)


class Running:
    """``produce(options)`` in a thread of this process; ``join()`` returns or re-raises."""

    def __init__(self, options: ProducerOptions) -> None:
        self.stop = threading.Event()
        self.result: int | None = None
        self.error: BaseException | None = None
        info = WorkerInfo(0, 1, "test-producer", options.seed)
        self._thread = threading.Thread(target=self._run, args=(options, info), daemon=True)
        self._thread.start()

    def _run(self, options: ProducerOptions, info: WorkerInfo) -> None:
        try:
            self.result = produce(options, info, self.stop)
        except BaseException as exc:  # carried to join()
            self.error = exc

    def join(self, timeout: float = 30) -> int:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "produce() did not return"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def options_for(trainer: StandInTrainer, **kwargs) -> ProducerOptions:
    return ProducerOptions(connect=trainer.endpoint, **kwargs)


def lines(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if fragment in r.getMessage()]


@pytest.fixture(autouse=True)
def _info_logs(caplog):
    caplog.set_level(logging.INFO, logger="stagefeed.producer")


def test_dropped_verdicts_are_counted_by_reason_in_the_final_line(caplog):
    drop = {1: "value_range", 2: "spec_mismatch", 4: "value_range"}
    with StandInTrainer(SMALL, credit=1, regrant=True, drop=drop) as trainer:
        count = Running(options_for(trainer, schema=SMALL, max_batches=8)).join()
        assert wait_for(lambda: trainer.ends, 5)
        assert trainer.seqs() == [0, 3, 5, 6, 7] and trainer.ends[0][1] == 8
    assert count == 8
    [final] = lines(caplog, "finished:")
    assert final == (
        "producer test-producer finished: 8 batches (seq 0..7); trainer refused 3 "
        "(value_range: 2, spec_mismatch: 1); delivering the last 0 (up to 30 s)"
    )
    assert len(lines(caplog, "dropped batch")) == 2  # one line per reason per 5 s


def test_a_filling_source_never_gets_a_buffer_zeromq_still_holds():
    def canary(seq, arrays):  # every byte of batch seq must be what fill wrote for seq
        return all(bool((array == seq % 100).all()) for array in arrays.values())

    with StandInTrainer(
        CANARY, credit=2, regrant=True, rcvhwm=1, inspect=canary, read_delay_s=0.02
    ) as trainer:
        options = options_for(trainer, source="tests.helpers.user_source:counting", inflight_mb=8)
        assert options.max_unsent(CANARY) == 1  # a pool of 2: each reuse follows a release
        assert Running(options).join(60) == 24
        assert wait_for(lambda: trainer.ends, 5)
        assert trainer.seqs() == list(range(24))
        assert [r.summary for r in trainer.received] == [True] * 24


def test_pings_arrive_while_the_source_is_slow():
    with StandInTrainer(SMALL, credit=4) as trainer:
        options = options_for(trainer, schema=SMALL, source="tests.helpers.user_source:slow_second")
        assert Running(options).join() == 3  # the 2nd batch came after 5 s
        assert wait_for(lambda: trainer.ends, 5)
    first, second = trainer.received[0].at, trainer.received[1].at
    during = [at for _, at in trainer.pings if first < at < second]
    assert second - first > 4.5 and len(during) >= 2


def test_a_stop_discards_and_says_how_many_were_held(caplog):
    inflight = 3 * SMALL.batch_bytes / MIB  # max_unsent 3
    with StandInTrainer(SMALL, credit=1) as trainer:
        running = Running(options_for(trainer, schema=SMALL, inflight_mb=inflight))
        assert wait_for(lambda: trainer.seqs() == [0], 5)
        assert wait_for(lambda: lines(caplog, "at most 3 held"), 5)
        running.stop.set()
        with pytest.raises(ClosedError):
            running.join()
    [stopped] = lines(caplog, "stopped:")
    assert re.fullmatch(
        r"producer test-producer stopped: 4 batches handed over \(seq 0\.\.3\); trainer refused "
        r"0; 3 not yet delivered discarded \(3 waiting for credit, 0 held by ZeroMQ\)",
        stopped,
    )


def test_synthetic_batches_of_the_adopted_schema(caplog):
    with StandInTrainer(SMALL, credit=8) as trainer:
        assert Running(options_for(trainer, max_batches=3)).join() == 3
        assert wait_for(lambda: trainer.ends, 5)
    assert lines(caplog, "x float32[4,16], y int32[4] (0.0 MiB a batch)")


def wrong_schema() -> Schema:
    return Schema((ArraySpec("x", "float64", (16,)), ArraySpec("y", "int32")), batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "code", "message"),
    [
        (
            {"schema": wrong_schema()},
            ConfigError,
            2,
            "trainer at {endpoint}: x: producer sends float64[4, 16], trainer expects "
            "float32[4, 16]",
        ),
        (
            {"source": "tests.helpers.user_source:wrong_shape"},
            ConfigError,
            2,
            "source 'tests.helpers.user_source:wrong_shape' batch 0: x is float32[1, 2, 3], "
            "expected float32[4, 16]",
        ),
        (
            {"source": "tests.helpers.user_source:fails"},
            BrokenError,
            3,
            "source 'tests.helpers.user_source:fails' failed at batch 1: KeyError: 'no such shard'",
        ),
    ],
    ids=["trainer-refuses-schema", "source-mismatch", "source-fails"],
)
def test_a_workers_failure_reaches_the_pool_as_one_line(kwargs, error, code, message):
    with StandInTrainer(SMALL, credit=4) as trainer:
        pool = Producers(options_for(trainer, workers=2, **kwargs), logging.WARNING).start()
        try:
            assert wait_for(lambda: pool.alive() == 0, 60)
            with pytest.raises(error) as info:
                pool.wait(0)
        finally:
            pool.close()
    assert str(info.value) == message.format(endpoint=trainer.endpoint)
    assert [p.exitcode for p in pool.processes] == [code, code]


def test_a_pool_whose_workers_finish_reports_nothing():
    with StandInTrainer(SMALL, credit=4, regrant=True) as trainer:
        pool = Producers(options_for(trainer, workers=2, max_batches=5)).start()
        try:
            assert pool.wait(60)
        finally:
            pool.close()
        assert wait_for(lambda: len(trainer.ends) == 2, 5)
    assert sorted(seq for _, seq in trainer.ends) == [5, 5]
    assert [p.exitcode for p in pool.processes] == [0, 0]
    assert np.bincount([r.seq for r in trainer.received]).tolist() == [2] * 5


def test_a_source_failing_at_batch_3_delivers_what_it_made_then_says_why(caplog):
    """Batches 0..2 reach the trainer (none discarded), then ``end`` says ``source_error``
    with the error's text, and ``produce`` raises the source's error."""
    with StandInTrainer(SMALL, credit=1, regrant=True, read_delay_s=0.05) as trainer:
        options = options_for(trainer, schema=SMALL,
            source="tests.helpers.user_source:wrong_dtype_at_3")
        with pytest.raises(ConfigError) as info:
            Running(options).join()
        assert wait_for(lambda: trainer.byes, 5)
    message = (
        "source 'tests.helpers.user_source:wrong_dtype_at_3' batch 3: x is float64[4, 16], "
        "expected float32[4, 16]"
    )
    assert str(info.value) == message
    assert trainer.seqs() == [0, 1, 2]
    [bye] = trainer.byes
    assert bye == {"v": 2, "t": "end", "seq": 3, "reason": "source_error", "detail": message}
    assert not lines(caplog, "discarded")
    [final] = lines(caplog, "source failed")
    assert final.startswith("producer test-producer source failed, ending: 3 batches (seq 0..2)")


def test_a_source_failing_at_start_still_says_why():
    with StandInTrainer(SMALL, credit=2) as trainer:
        options = options_for(trainer, schema=SMALL,
            source="tests.helpers.user_source:fails_to_start")
        with pytest.raises(BrokenError) as info:
            Running(options).join()
        assert wait_for(lambda: trainer.byes, 5)
    assert trainer.seqs() == []
    [bye] = trainer.byes
    assert (bye["seq"], bye["reason"], bye["detail"]) == (0, "source_error", str(info.value))
    assert "failed to start: OSError: no data here" in bye["detail"]


def test_a_normal_end_is_the_plain_end_every_trainer_knows():
    with StandInTrainer(SMALL, credit=8) as trainer:
        assert Running(options_for(trainer, schema=SMALL, max_batches=2)).join() == 2
        assert wait_for(lambda: trainer.byes, 5)
    assert trainer.byes == [{"v": 2, "t": "end", "seq": 2}]  # no reason: ok (common/protocol.py)


# 1 MiB a batch: eight of them fill the kernel's socket buffers of a trainer that reads slowly.
MIB_BATCH = Schema((ArraySpec("x", "float32", (2**16,)), ArraySpec("y", "int32")), batch_size=4)


def test_a_trainer_reading_slowly_gets_the_last_batches_and_the_end():
    """The producer closes only once the trainer said ``ended``. Before, it closed as soon as
    ZeroMQ had written the tail into the kernel; the trainer's later ``credit``, unread, made
    that close a TCP reset, which discarded the tail still in the kernel: here the stand-in got
    2 of 8 batches and no ``end`` while the producer logged "finished: 8 batches"."""
    with StandInTrainer(MIB_BATCH, credit=8, regrant=True, read_delay_s=0.2, rcvhwm=1) as trainer:
        assert Running(options_for(trainer, schema=MIB_BATCH, max_batches=8)).join(60) == 8
        # Running returned: the producer closed its socket; everything must still arrive.
        assert wait_for(lambda: trainer.ends, 20), trainer.seqs()
    assert trainer.seqs() == list(range(8))
    assert [seq for _, seq in trainer.ends] == [8]


def test_a_trainer_that_never_says_ended_costs_the_linger_and_a_warning(caplog, monkeypatch):
    monkeypatch.setattr("stagefeed.producer.worker.FLUSH_TIMEOUT_S", 2.0)
    with StandInTrainer(SMALL, credit=8, ack_end=False) as trainer:
        assert Running(options_for(trainer, schema=SMALL, max_batches=2)).join() == 2
        assert wait_for(lambda: trainer.ends, 5)
    assert trainer.hellos[0][1]["ack_end"] is True
    assert lines(caplog, "did not say it read our end within the linger")
