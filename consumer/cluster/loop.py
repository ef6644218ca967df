"""The cluster's training loop: fetch, vote, step (``collective_stop``), until the vote ends it.

    cluster = make_cluster()                       # first TensorFlow call of the process
    with cluster.strategy.scope():
        model = build(schema)                      # compiled
    dataset = distribute(cluster.strategy, lambda context: feed_dataset)
    end = train(cluster.strategy, model, iter(dataset), steps=N,
                local=lambda: vote_for(run_end.poll()), after_step=book)

``local()`` is this worker's vote, asked once per step after its batch arrived (a stop
requested while it waited for data is voted at that step). ``steps`` is this worker's budget
(0: none); reaching it is a ``STOP`` vote, so workers given different budgets still stop
together, at the smallest. ``after_step(step, figures)`` gets the step's figures as floats
(the same on every worker); an exception from it (``NonFiniteLoss`` from the loss policy)
ends the loop on every worker at the same step as long as the policy is the same everywhere,
because the loss it looks at is the same everywhere. Any other exception leaves the other
workers waiting in their next collective: let it end the process (docs/scaling.md).

A worker that dies (or a collective that outlives ``make_cluster``'s ``timeout_s``) fails the
collective the others are in or enter next: TensorFlow aborts every collective of the
process (``UnavailableError``, ``DeadlineExceededError``) and the cluster cannot go on;
``train`` raises ``BrokenError`` naming the step and the cause in one line. Measured on
loopback (docs/scaling.md): a worker killed with SIGKILL is noticed within about 2 s when
it was the collectives' leader (worker 0) and after one or two of the coordination
service's heartbeat timeouts (10 s by default) otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from stagefeed.common.errors import BrokenError
from stagefeed.consumer.cluster.collective_stop import ClusterVerdict, CollectiveStop
from stagefeed.consumer.cluster.distributed_step import DistributedStep
from stagefeed.consumer.run_end import Ending

log = logging.getLogger(__name__)

# What a collective raises once the cluster is broken (a peer gone, a timeout): after one, the
# process's collectives stay aborted.
CLUSTER_BROKEN = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)


@dataclasses.dataclass(frozen=True)
class LoopEnd:
    """How the loop ended: steps trained (the same on every worker) and the cluster's verdict."""

    steps: int
    verdict: ClusterVerdict


def train(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    iterator: Any,
    *,
    steps: int = 0,
    local: Callable[[], Ending] = lambda: Ending.RUNNING,
    after_step: Callable[[int, dict[str, float]], None] | None = None,
    first_step: int = 1,
) -> LoopEnd:
    """Train until the cluster's vote is not ``RUNNING``; see the module docstring. Steps are
    numbered from ``first_step`` (a resumed run goes on from its checkpoint's step) in
    ``after_step`` and the log; ``LoopEnd.steps`` counts this call's."""
    stop = CollectiveStop(strategy)
    step = DistributedStep(strategy, model)
    done = 0
    while True:
        broken = None
        try:
            batch = stop.fetch(iterator)
            vote = Ending.STOP if steps and done >= steps else local()
            verdict = stop.vote(vote, batch)
            if verdict.go:
                figures = DistributedStep.figures(step(batch, verdict.global_batch))
        except CLUSTER_BROKEN as exc:
            broken = (f"cluster broken after step {first_step - 1 + done}: {broken_cause(exc)}; "
                      "restart every worker")  # fmt: skip
        if broken is not None:
            # Raised outside the handler, and after a collection: an eager all-reduce that
            # failed leaves TensorFlow's ThreadPool (cross_device_ops) unclosed, held by the
            # failed frames. Collected now, its __del__ finds its pipes open; at interpreter
            # exit it would print a traceback (OSError: Bad file descriptor).
            gc.collect()
            raise BrokenError(broken)
        if not verdict.go:
            log.info("cluster: %s after step %d (this worker voted %s)",
                     verdict.reason, first_step - 1 + done, vote.name)  # fmt: skip
            return LoopEnd(done, verdict)
        done += 1
        if after_step is not None:
            after_step(first_step - 1 + done, figures)


def broken_cause(exc: tf.errors.OpError) -> str:
    """The cause in one short line: what aborted the collectives, without TensorFlow's
    "Graph execution error" header, its op traceback and its advice."""
    kept: list[str] = []
    in_traceback = False
    for line in exc.message.splitlines():
        text = line.strip()
        if text.startswith("Detected at node"):
            in_traceback = True
            continue
        if in_traceback and (not text or line[0].isspace()):
            continue
        in_traceback = False
        if text.startswith(("The tasks have crashed", "The error could be", "Additional GRPC",
                            "[[")):  # fmt: skip
            break
        if text and not text.startswith("Graph execution error"):
            kept.append(text)
    cause = " ".join(kept)
    if "aborted by:" in cause:
        cause = cause.split("aborted by:", 1)[1].strip()
    return f"{type(exc).__name__}: {cause}"[:300]
