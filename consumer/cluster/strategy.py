"""The cluster a trainer worker belongs to: ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``.

``make_cluster()`` must be the first TensorFlow call of the process: the strategy configures
the eager context's collective ops and starts this worker's gRPC server, which TensorFlow
refuses once any op has run (``RuntimeError: Collective ops must be configured at program
startup``, turned here into a ``ConfigError`` that says so). It returns a ``Cluster``: the
strategy and this worker's place in it (index, count, chief).

Collectives: ``implementation="auto"`` (NCCL where every replica is a GPU, RING otherwise, so
RING on CPU), ``"ring"`` or ``"nccl"``. ``timeout_s`` bounds each collective op
(``CommunicationOptions(timeout_seconds=...)``): a collective that waits longer fails with
``DeadlineExceededError`` instead of hanging. It counts every wait, a slow producer's
included (a worker waiting for its next batch holds the others in the step's first
collective), so it must exceed the longest wait for data; None (the default) waits for ever
and leaves a dead peer to the coordination service's heartbeat (docs/scaling.md has what was
measured). ``heartbeat_s`` sets that heartbeat's timeout (TensorFlow's default: 10 s) through
TensorFlow's private ``context.configure_coordination_service``, configured as the strategy
itself would (standalone service, led by the chief or worker 0): shorter finds a dead worker
sooner, but a worker whose heartbeat thread is starved of CPU for that long is declared dead.

Signals: the strategy's coordination service installs TensorFlow's own SIGTERM handler (its
preemption notifier, which only records the signal), below Python's; ``make_cluster`` puts
Python's back (``common.lifecycle.reclaim_stop_signals``), so SIGTERM stops a worker as it
stops one trainer.

TF_CONFIG: TensorFlow's ``TFConfigClusterResolver`` reads it. The few facts needed before
TensorFlow loads (in a cluster or not, the worker index and count, chief or not) are the
``ClusterPlace`` the trainer's maker resolved once (``stagefeed.common.tf_config.place``, which
checks it with TensorFlow's rules) and hands in; nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from stagefeed.common.errors import BrokenError, ConfigError
from stagefeed.common.lifecycle import reclaim_stop_signals
from stagefeed.common.tf_config import ENV as TF_CONFIG_ENV
from stagefeed.common.tf_config import ClusterPlace

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "ring", "nccl")
JOIN_S = 120.0  # TrainerOptions.cluster_join_s


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This worker's strategy and place. ``index`` counts the chief first (0..count-1), as the
    strategy numbers its workers; ``replicas`` is every worker's devices together."""

    strategy: Any  # tf.distribute.MultiWorkerMirroredStrategy
    task_type: str
    task_index: int
    index: int
    count: int
    chief: bool
    replicas: int

    def __str__(self) -> str:
        role = " (chief)" if self.chief else ""
        return f"worker {self.index}/{self.count}{role}, {self.replicas} replicas"


def refuse_in_cluster(what: str, place: ClusterPlace) -> None:
    """``ConfigError`` in one line if ``place`` is in a cluster: for what runs on one worker
    only (graph mode)."""
    if place.in_cluster:
        raise ConfigError(
            f"{what} trains on one worker, and TF_CONFIG names a cluster of {place.count}: "
            "several trainers need a Keras --model build(schema), or unset TF_CONFIG"
        )


def make_cluster(
    place: ClusterPlace,
    *,
    timeout_s: float | None = None,
    implementation: str = "auto",
    heartbeat_s: float | None = None,
    join_s: float = JOIN_S,
) -> Cluster:
    """The strategy for this process's ``TF_CONFIG``, which ``place`` was resolved from (the
    trainer's maker read it: ``tf_config.place``); call before any other TensorFlow op."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"collective implementation must be one of {IMPLEMENTATIONS}, "
                          f"got {implementation!r:.40}")  # fmt: skip
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"collective timeout must be > 0 seconds, got {timeout_s!r:.40}")
    if heartbeat_s is not None and not heartbeat_s > 0:
        raise ConfigError(f"heartbeat timeout must be > 0 seconds, got {heartbeat_s!r:.40}")
    if not join_s > 0:
        raise ConfigError(f"cluster join timeout must be > 0 seconds, got {join_s!r:.40}")
    if not place.named:
        raise ConfigError("several trainers need TF_CONFIG (cluster and task); it is not set")
    import tensorflow as tf

    _configure_coordination(heartbeat_s, join_s)

    kind = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation={"auto": kind.AUTO, "ring": kind.RING, "nccl": kind.NCCL}[implementation],
        timeout_seconds=timeout_s,
    )
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except tf.errors.DeadlineExceededError:
        raise BrokenError(
            f"the cluster did not form within {join_s:g} s (--cluster-join-timeout-s): not "
            f"every worker of TF_CONFIG joined worker {place.index}; one that refused to start (a "
            "--save holding a finished run, a bad flag) says why in its own log"
        ) from None
    except tf.errors.UnknownError as exc:
        if "Could not start gRPC server" not in exc.message:
            raise
        # The address TF_CONFIG gives this task cannot be bound: a start-time error, like --bind.
        raise ConfigError(
            f"{TF_CONFIG_ENV}: worker {place.index} cannot start its gRPC server at the address "
            "the cluster gives its task (the port is in use, or the host is not this machine)"
        ) from None
    except RuntimeError as exc:
        if "at program startup" not in str(exc):
            raise
        raise ConfigError(
            "the cluster strategy must be made before any other TensorFlow op in the process "
            f"({exc})"
        ) from None
    # TensorFlow's preemption notifier has just taken SIGTERM below Python: give it back.
    log.debug("cluster: %s handled by Python again", ", ".join(reclaim_stop_signals()))
    resolver = strategy.cluster_resolver
    cluster = Cluster(
        strategy=strategy,
        task_type=resolver.task_type,
        task_index=int(resolver.task_id),
        index=place.index,
        count=place.count,
        chief=place.chief,
        replicas=strategy.num_replicas_in_sync,
    )
    log.info("cluster: %s, collectives %s, timeout %s, heartbeat %s", cluster, implementation,
             f"{timeout_s:g} s" if timeout_s else "none",
             f"{heartbeat_s:g} s" if heartbeat_s else "10 s")  # fmt: skip
    return cluster


def _configure_coordination(heartbeat_s: float | None, join_s: float) -> None:
    """The coordination service as ``MultiWorkerMirroredStrategy`` configures it (TF 2.21,
    ``collective_all_reduce_strategy.py``; it keeps a configured one), with ``heartbeat_s``
    (None: TensorFlow's 10 s) and ``join_s``: how long a worker waits for every other to
    join, instead of TensorFlow's hour (a chief that refused to start, a finished ``--save``
    for one, would otherwise leave the others waiting)."""
    try:
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
        from tensorflow.python.distribute import multi_worker_util
        from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver
        from tensorflow.python.eager import context
    except ImportError as exc:
        raise ConfigError(
            f"a cluster needs TensorFlow's coordination service: {exc}"
        ) from None
    spec = TFConfigClusterResolver().cluster_spec()
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        heartbeat_timeout_in_ms=int(heartbeat_s * 1000) if heartbeat_s else 0,
        cluster_register_timeout_in_ms=int(join_s * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
            for job in ("chief", "worker")
            if job in spec.jobs
        ],
    )
