"""Shared-memory faults with real processes: a producer killed with -9 in the middle of writing
a slot, and a trainer killed with -9 and restarted under running producers.

The trainer is the canary trainer (``tests.helpers.shm_canary``): its model checks every trained
batch's content, so "never trained a torn slot" is measured, not assumed. Producer ids carry
the worker's pid, which is how a test finds the counters of the process it started.
"""

from __future__ import annotations

import mmap
import os
import signal

import numpy as np
import pytest

from stagefeed.common.shm.layout import WRITING, SlotLayout, header_words
from tests.conftest import cli_env, wait_for
from tests.helpers import procs, shm_procs
from tests.helpers.shm_canary import SCHEMA

pytestmark = pytest.mark.slow  # TensorFlow in a subprocess

LAYOUT = SlotLayout.of(SCHEMA.wire())
SLOW_FILL = {"CANARY_CHUNKS": "16", "CANARY_FILL_DELAY_S": "0.01"}  # ~160 ms a batch


def dev_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-")}


def _states(memory: mmap.mmap) -> list[int]:
    slots = len(memory) // LAYOUT.stride
    return [int(s) for s in header_words(memory, slots, LAYOUT)[:, 2]]


def _pixels(memory: mmap.mmap, slot: int) -> np.ndarray:
    """One pixel in 4096 of the slot's first array (four per chunk of the canary's fill)."""
    return np.frombuffer(memory, np.uint8, LAYOUT.arrays[0].nbytes,
                         slot * LAYOUT.stride + LAYOUT.offsets[0])[::4096]  # fmt: skip


def _torn_early(memory: mmap.mmap) -> bool:
    """A slot being written holds two batches' values, the new one (the canary writes its
    chunks in order, so it is the first pixel's) in at most half of it: more than half of
    the fill, 80 ms of it at least, is still to come."""
    for slot, state in enumerate(_states(memory)):
        if state != WRITING:
            continue
        pixels = _pixels(memory, slot)
        new, samples = int(np.count_nonzero(pixels == pixels[0])), len(pixels)
        del pixels  # no view may outlive the mapping
        if new < samples and new <= samples // 2:
            return True
    return False


def test_producer_killed_mid_write_its_torn_slot_is_never_trained(spawn):
    before = dev_shm()
    # The victim's pool is unmapped once its connection is forgotten: after 3 s of silence.
    trainer = shm_procs.CanaryTrainer(spawn, "--producer-timeout-s", "3")
    survivor = shm_procs.produce(spawn, trainer.endpoint, "--rate", "40", name="survivor")
    victim = shm_procs.produce(spawn, trainer.endpoint, name="victim", env=cli_env(**SLOW_FILL))
    (survivor_worker,) = procs.workers_of(survivor, 1)
    (victim_worker,) = procs.workers_of(victim, 1)
    trainer.trained_of(victim_worker.pid, 4)
    trainer.trained_of(survivor_worker.pid, 4)
    links = shm_procs.memfd_links(victim_worker.pid)  # the pool, and mmap's dup of its fd
    assert len(set(links.values())) == 1, links
    link = min(links)
    (pool_name,) = shm_procs.memfds(victim_worker.pid)["maps"]
    assert pool_name in shm_procs.memfds(trainer.pid)["maps"]  # the trainer maps it
    fd = os.open(link, os.O_RDONLY)  # a witness: read the victim's slots after its death
    try:
        memory = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        assert wait_for(lambda: _torn_early(memory), 30, interval=0.001), (
            f"no slot seen in its first half of a fill within 30 s: states {_states(memory)}"
        )
        victim_worker.send_signal(signal.SIGKILL)  # in the middle of a fill (160 ms each)
        assert victim.wait(30) == 3 and "exit -9" in procs.log_text(victim)
        # Only the victim writes its slots' states: they are final once it is dead.
        torn = [i for i, state in enumerate(_states(memory)) if state == WRITING]
        assert torn, _states(memory)  # a slot half written when the producer died
        pixels = _pixels(memory, torn[0])
        assert len(set(pixels.tolist())) == 2  # really torn: two batches' values
        del pixels
        memory.close()
    finally:
        os.close(fd)
    # The others keep training; the victim's pool is unmapped once TF is done with it.
    trainer.trained_of(survivor_worker.pid, trainer.trained_of(survivor_worker.pid, 0) + 10)
    assert wait_for(lambda: pool_name not in shm_procs.memfds(trainer.pid)["maps"], 30), (
        f"the trainer still maps the dead victim's pool {pool_name} after 30 s"
    )
    assert dev_shm() <= before
    summary = trainer.stop()
    assert summary["loss_last"] == 0, "a corrupted batch was trained"  # the canary's count
    # The torn slot was never even described.
    assert summary["batches"]["dropped"] == 0, summary["dropped_by_reason"]
    books = summary["producers"]
    (victim_books,) = [b for n, b in books.items() if f"-{victim_worker.pid}-" in n]
    assert victim_books["trained"] >= 4 and victim_books["seq_missing"] == 0
    assert not os.path.lexists(trainer.socket)
    assert dev_shm() <= before


def test_trainer_killed_and_restarted_producers_resume_over_shared_memory(spawn):
    before = dev_shm()
    model = ("--model", "tests.helpers.shm_canary:consistent_fn")  # batches in flight are lost
    first = shm_procs.CanaryTrainer(spawn, *model, name="first")
    producers = [
        shm_procs.produce(spawn, first.endpoint, "--rate", "30", name=f"p{i}") for i in range(2)
    ]
    workers = [procs.workers_of(p, 1)[0] for p in producers]
    for worker in workers:
        first.trained_of(worker.pid, 3)
        assert len(shm_procs.memfds(worker.pid)["fds"]) == 1
    os.killpg(first.pid, signal.SIGKILL)
    first.started.wait(30)
    for producer in producers:
        assert procs.wait_log(producer, "cannot reach the trainer", 30), procs.log_text(producer)
    assert os.path.lexists(first.socket)  # the killed trainer's socket is still there

    second = shm_procs.CanaryTrainer(
        spawn, *model, port=first.port, socket=first.socket, name="second"
    )
    for worker in workers:
        second.trained_of(worker.pid, 5)
    assert all(w.is_running() for w in workers)  # never restarted
    assert all(p.proc.poll() is None for p in producers)
    # No segment left on either side: each producer holds and maps only its new pool, and
    # the new trainer maps exactly those.
    pools = set()
    for worker in workers:
        now = shm_procs.memfds(worker.pid)
        assert len(now["fds"]) == 1 and now["maps"] == now["fds"], now
        pools |= now["fds"]
    assert wait_for(lambda: shm_procs.memfds(second.pid)["maps"] == pools, 30), (
        f"the new trainer maps {shm_procs.memfds(second.pid)['maps']}, not {pools}, after 30 s"
    )
    summary = second.stop()
    assert summary["shm"]["pools_accepted"] == 2 and summary["shm"]["batches"] >= 10
    assert summary["loss_last"] == 0
    for producer in producers:
        producer.signal(signal.SIGTERM)
        assert producer.wait(30) == 0
        log = procs.log_text(producer)
        assert "reachable again" in log and "Traceback" not in log, log
        assert log.count("offered to the trainer") == 2, log  # a new pool for the new trainer
    assert not os.path.lexists(first.socket)
    assert not os.path.exists(os.path.dirname(first.socket))
    assert dev_shm() <= before


def test_a_producer_tree_killed_whole_leaves_nothing_in_dev_shm(spawn):
    """``stagefeed produce --transport shm`` killed with SIGKILL, supervisor, workers and
    multiprocessing's resource tracker at once, so no finalizer and no tracker runs: nothing
    any of them mapped or held in /dev/shm is left (before: 7 ``sem.mp-*`` semaphores of the
    pool's Event and Queue per producer). Their pools are memfds, never in /dev/shm."""
    trainer = shm_procs.CanaryTrainer(spawn, "--producer-timeout-s", "3")
    producer = shm_procs.produce(spawn, trainer.endpoint, "--workers", "2", name="killed")
    workers = procs.workers_of(producer, 2)
    for worker in workers:
        trainer.trained_of(worker.pid, 2)  # in full swing: pools offered, batches trained
    family = procs.family(producer)
    assert len(family) >= 4, [p.cmdline() for p in family]  # supervisor, tracker, 2 workers
    held = procs.shm_paths(family)  # /dev/shm files of any of them, mapped or open
    os.killpg(producer.proc.pid, signal.SIGKILL)
    gone, _ = procs.gone_within(family, 30)
    assert gone, [p.cmdline() for p in family if procs._alive(p)]
    left = sorted(path for path in held if os.path.lexists(path))
    assert not left, left
    assert trainer.stop()["loss_last"] == 0
