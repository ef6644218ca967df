"""What both trainer kinds share: the step books, the loss policy, run length.

The graph-mode ``Trainer`` (``consumer.graph.trainer``) and the Keras ``KerasTrainer``
(``consumer.keras_fit.trainer``) derive from ``TrainerBase``, so the summary, the monitor and the
exporters see the same from either. Observers are given only ``facts`` and ``reader``
(``consumer.run_facts``, with ``StepRecord`` and ``StepObserver``), which exist from
construction on; the summary, the ``RunReport`` the trainer builds at the end (``report``).

Every step goes through ``book_step`` on the training thread: the observers see the record
(none is kept here), and then the loss policy applies. A NaN or infinite loss with
``options.on_nan == "stop"`` raises ``NonFiniteLoss`` naming the step (the command line exits
4 after the summary); with ``"warn"`` the first such step is logged and training goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stagefeed.common import tf_config
from stagefeed.common.errors import NonFiniteLoss
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.run_end import finished_because
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepObserver, StepRecord
from stagefeed.consumer.run_report import ClusterReport, RunReport

if TYPE_CHECKING:
    from stagefeed.consumer.books.shard_books import ShardBooks
    from stagefeed.consumer.resume import Resume

log = logging.getLogger(__name__)


def trainer_place(place: ClusterPlace | None) -> ClusterPlace:
    """``place``, or for a trainer made from Python without one, this process's ``TF_CONFIG``
    (``tf_config.place``): resolved once, where the trainer is made; what it holds is passed
    to the intake and the checkpoints, which never read the environment."""
    return tf_config.place() if place is None else place


class TrainerBase:
    """The books of steps and losses; subclasses add the feed and the loop.

    ``ledger`` is the books of batches, shared with the intake. ``_intake`` is set by the
    subclass once it has started one (transport and shared-memory figures come from it).
    ``place``: where this trainer stands in a ``TF_CONFIG`` cluster (``trainer_place``).
    """

    # True: what the trainer holds must not be torn down in the process (the cluster worker's
    # input iterator, whose deletion waits for tf.data's autotune thread, up to 60 s): the CLI
    # ends the process once the summary is out (``lifecycle.end_process``).
    exit_without_teardown = False

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        *,
        device: str,
        place: ClusterPlace | None = None,
    ) -> None:
        self.options = options
        self.place = trainer_place(place)
        self.schema = options.schema
        self.observers = list(observers)
        self.ledger = Ledger()
        self.steps_done = 0
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        # The model's own metrics after the last step (Keras: compiled metrics, running means
        # over the epoch, as fit reports them); empty in graph mode.
        self.metrics_last: dict[str, float] = {}
        self.loss_finite = True
        self.nonfinite_steps = 0
        self.data_ended = False  # every producer signalled end of data, all of it trained
        # The step of the checkpoint this run resumed from (``--save``, docs/resume.md): step
        # numbers go on from it. None: a run that started afresh.
        self.resumed_from: int | None = None
        # Why the run drained before its planned steps (``RunEnd``'s reason), or None.
        self.drained_because: str | None = None
        self.device = device
        self.facts = RunFacts(
            device=device,
            batch_size=self.schema.batch_size,
            batch_bytes=self.schema.batch_bytes,
            wire_dtype=self.schema.wire_dtype,
            queue_capacity=options.queue_capacity,
            steps_planned=options.total_steps,
        )
        self.reader = RunReader(queue_batches=lambda: self.queue_batches, books=self.ledger.read)
        self.endpoint = ""
        self._configure_server = configure_server
        self._intake: Any = None
        self.epochs_of_passes = 0  # epochs of passes trained (docs/resume.md, "Passes")
        self._epoch_began = 0

    @property
    def transport(self) -> str:
        """How batches reach this trainer: ``tcp``/``ipc`` (ZeroMQ), or ``shm+tcp``/``shm+ipc``
        when it also maps producers' shared-memory pools (control over the ZeroMQ one)."""
        scheme = self.endpoint.split("://", 1)[0] or "tcp"
        shm = self._intake.shm if self._intake is not None else None
        return scheme if shm is None else f"shm+{scheme}"

    def shm_stats(self) -> dict[str, Any] | None:
        """The pools' socket, sizing and counts (``consumer.intake.shm_gate``); None without shm."""
        shm = self._intake.shm if self._intake is not None else None
        return None if shm is None else shm.stats()

    @property
    def queue_batches(self) -> int:
        """Batches in the FIFOQueue (lower bound; no TF call)."""
        raise NotImplementedError

    def start(self) -> TrainerBase:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> TrainerBase:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def book_step(self, record: StepRecord) -> None:
        """Show ``record`` to the observers, then apply the loss policy."""
        self.steps_done = record.step
        if self.loss_first is None:
            self.loss_first = record.loss
        self.loss_last = record.loss
        finite = math.isfinite(record.loss)
        if not finite:
            self.loss_finite = False
            self.nonfinite_steps += 1
        for observer in self.observers:
            observer.on_step(record)
        if finite:
            return
        if self.options.on_nan == "stop":
            raise NonFiniteLoss(record.step, record.loss)
        if self.nonfinite_steps == 1:
            log.warning(
                "step %d: loss is %s; training goes on (--on-nan warn)", record.step, record.loss
            )

    def resume_books(self, resumed: Resume | None, joined_only: bool = False) -> ShardBooks:
        """With ``--save``: book per-shard input positions in the ledger, from the checkpoint
        ``resumed`` (``checkpoints.resume_point``; logged in one line) when there is one, and
        step numbers go on from its step; the books, for the trainer's ``Checkpoints``. Call
        before the intake starts. ``joined_only``: ``ShardBooks``' (a cluster worker)."""
        from stagefeed.consumer.books.shard_books import ShardBooks

        books = ShardBooks(resumed.position if resumed else None, joined_only, confirms=True)
        self.ledger.shards = books
        if resumed is not None:
            self.resumed_from = resumed.step
            self.steps_done = resumed.step
            log.info("resuming from %s: %s", resumed.path, resumed.describe())
        return books

    def report(self) -> RunReport:
        """What this run did, frozen (``consumer.run_report``): build it once the
        trainer is closed, for the summary."""
        ledger = self.ledger
        return RunReport(
            options=self.options,
            device=self.device,
            endpoint=self.endpoint,
            transport=self.transport,
            shm=self.shm_stats(),
            steps_done=self.steps_done,
            steps_planned=self.steps_planned,
            passes_trained=self.passes_trained(),
            resumed_from=self.resumed_from,
            loss_first=self.loss_first,
            loss_last=self.loss_last,
            loss_finite=self.loss_finite,
            metrics=dict(self.metrics_last),
            data_ended=self.data_ended,
            drained_because=self.drained_because,
            totals=ledger.totals(),
            drops_by_reason=ledger.drops_by_reason(),
            refusals=ledger.refusals(),
            producers_ended=ledger.read().ended,
            producers_left=tuple(ledger.left()),
            connections=ledger.peer_events(),
            producers=ledger.summary(),
            producer_count=ledger.producer_count(),
            bad_records=ledger.bad_records(),
            cluster=self.cluster_report(),
        )

    def cluster_report(self) -> ClusterReport | None:
        """A cluster worker's place and every worker's books, for ``report``; None here."""
        return None

    def finished(self, step: int) -> str:
        """Why the run is done after ``step`` (``run_end.finished_because``: its planned passes
        trained, its planned steps done, its data ended), or "" if it stopped early: the final
        state's ``finished`` (a finished run is not resumed)."""
        books = self.ledger.shards
        return finished_because(
            step=step,
            planned_steps=self.steps_planned,
            planned_passes=self.options.epochs,
            position=books.position() if books is not None else None,
            data_ended=self.data_ended,
        )

    @property
    def steps_planned(self) -> int:
        """The run's length in steps (warm-up included; 0: as long as its data or passes say):
        ``options.total_steps``, or 0 once a source with passes joined a run whose length its
        passes decide (``options.length_by_passes``: ``--steps`` not given)."""
        if self.options.length_by_passes and self.passes_trained() is not None:
            return 0
        return self.options.total_steps

    def passes_trained(self) -> int | None:
        """Every shard's passes trained so far (a resumed run's included); None until a source
        with passes joined (docs/resume.md, "Passes")."""
        passes = self._intake.passes if self._intake is not None else None
        if passes is None or not passes.active:
            return None
        return passes.first_epoch + self.epochs_of_passes

    def passes_done(self) -> bool:
        """Every planned pass (``options.epochs``) of a source with passes is trained."""
        trained = self.passes_trained()
        return trained is not None and trained >= self.options.epochs

    def epoch_ended(self, step: int) -> bool:
        """True if ``step`` (1-based) ends an epoch of ``options.steps_per_epoch``; logs it."""
        per_epoch = self.options.steps_per_epoch
        if not per_epoch or step % per_epoch:
            return False
        log.info("epoch %d/%d done (%d steps)", step // per_epoch, self.options.epochs, step)
        return True

    def passes_ended(self, trained: int) -> int:
        """Log each epoch of passes (docs/resume.md, "Passes") that the first ``trained``
        batches this process trained complete: every shard's pass, and nothing of the next.
        How many ended."""
        passes = self._intake.passes if self._intake is not None else None
        if passes is None:
            return 0
        ended = 0
        for epoch, at in passes.ended_by(trained, self.epochs_of_passes):
            log.info("epoch %d/%d done: %d steps (every shard's pass %d)", epoch + 1,
                     passes.pass_count, at - self._epoch_began, epoch)  # fmt: skip
            self._epoch_began = at
            self.epochs_of_passes += 1
            ended += 1
        return ended
