"""``--save DIR`` and ``--checkpoint-every N`` for both trainers: what is written, when, by whom.

Layout (the model's files are its trainer's format: a ``tf.compat.v1.train.Saver`` checkpoint
in graph mode, ``.keras`` files for Keras)::

    DIR/checkpoints/<model at step N>     every N steps (all kept)
    DIR/checkpoints/state-0000N.json      the run's state at step N, written after the model
    DIR/<final model>                     at the end of training
    DIR/state.json                        the run's state at the end, written after the model

A checkpoint is its state file and the model files it names: the state file is written last,
atomically (a temporary file renamed over it, then its directory fsynced:
``checkpoint_files.write_state``), so a checkpoint is complete or has no state file, whatever
kills the writer or the host. The state holds its format ``version``, the step, the epoch, the
run's settings, ``model_path`` (what to restore, beside the state file), ``finished`` (why
the run ended, in the final state of a run that is done; false otherwise) and ``input``: the
input position, read *after* the model was saved, on the train loop's thread, so it holds
exactly the batches whose effect is in that model (``common.position``; docs/resume.md).

Test hook: ``STAGEFEED_TEST_STATE_DELAY_S`` (seconds, default 0) sleeps between the model and
its state file, so a test can kill the writer there; not for production use.

Who writes: the chief (``chief``: the trainer's ``ClusterPlace``, TF_CONFIG's rules). Another
worker of a cluster saves its model to a temporary directory that is removed at once
(TensorFlow's multi-worker pattern: saving may need every worker's part in a collective), and
writes no state; but it reads ``position()`` too, right after its save, because a cluster's
position is gathered from every worker (``consumer.cluster.positions``: a collective).

``on_saved(position, finished)`` is told each position once a checkpoint holding it is
complete (the trainer's ``ShardBooks.saved``: producers whose whole shard it holds may leave;
``finished``: the final checkpoint of a run that is done, which nothing resumes). The chief
tells it after its state file; another worker tells it one checkpoint later, when the next
gather shows that the chief got past its write (the chief writes before it trains on), or
after the cluster's barrier at the end (``confirm_written``).

A directory that already holds a run is resumed from its newest complete checkpoint, or
refused, or (``--fresh``) moved aside: ``consumer.resume``; the chief decides at start
(``resume_point``), before the trainer books positions and makes its ``Checkpoints``.

No TensorFlow here: the trainers hand in how to save their model (``ModelFormat``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition, passes_trained
from stagefeed.consumer import resume
from stagefeed.consumer.checkpoint_files import write_state

log = logging.getLogger(__name__)

CHECKPOINTS = resume.CHECKPOINTS
STATE = resume.STATE
TEST_STATE_DELAY = "STAGEFEED_TEST_STATE_DELAY_S"


@dataclasses.dataclass(frozen=True)
class ModelFormat:
    """How a trainer saves its model. ``save(path)`` writes the model at ``path`` (a file, or
    a Saver's prefix) and returns the files it wrote, relative to ``path``'s directory;
    ``restore(path)`` loads what ``save`` wrote there (resume)."""

    final: str  # the final model's name in DIR: "model.ckpt", "model.keras"
    at_step: Callable[[int], str]  # a checkpoint's name in DIR/checkpoints
    save: Callable[[str], list[str]]
    restore: Callable[[str], None] | None = None


def state_name(step: int) -> str:
    return f"state-{step:06d}.json"


def check_save_dir(options: TrainerOptions) -> resume.Resume | None:
    """Before anything starts: the checkpoint ``options.save_dir`` resumes from (None: it
    holds no run, or ``options.fresh``); ``ConfigError`` if it holds one that this run
    cannot resume (``consumer.resume``)."""
    if options.save_dir is None or options.fresh or not os.path.isdir(options.save_dir):
        return None
    return resume.newest(options.save_dir, options)


def resume_point(options: TrainerOptions, model: ModelFormat, chief: bool) -> resume.Resume | None:
    """The checkpoint this run resumes from, restored into ``model``: the chief's decision
    (``--fresh`` moves the previous run aside first; a newer checkpoint passed over is said
    in one line); None for a fresh run, and always for a worker other than the chief (the
    cluster shares the chief's: ``consumer.cluster.positions``). Call before the books."""
    if options.save_dir is None:
        raise ValueError("resume_point needs options.save_dir")
    if not chief:
        return None
    if options.fresh and os.path.isdir(options.save_dir):
        resume.start_over(options.save_dir)
        return None
    resumed = check_save_dir(options)
    if resumed is None:
        return None
    passed_over = resumed.passed_over_line()
    if passed_over is not None:
        log.warning("%s", passed_over)
    if model.restore is None:
        raise ValueError("this model format cannot restore a checkpoint")
    model.restore(resumed.model_path)
    return resumed


class Checkpoints:
    """Saves the model every ``options.checkpoint_every`` steps and at the end, each with its
    state file (see the module docstring). Call ``after_step`` after every booked step and
    ``final`` once; neither is called for a non-finite model (the loss policy stops first).

    Given at construction, never assigned after: ``chief`` (it writes), ``resumed`` (the
    checkpoint this run goes on from: ``resume_point``, or the cluster's shared one),
    ``position()`` (the input position to write, read after each model save; None: no
    position booked) and ``on_saved(position, finished)`` (see the module docstring)."""

    def __init__(
        self,
        options: TrainerOptions,
        model: ModelFormat,
        chief: bool,
        *,
        resumed: resume.Resume | None = None,
        position: Callable[[], InputPosition | None] | None = None,
        on_saved: Callable[[InputPosition, bool], None] | None = None,
    ) -> None:
        if options.save_dir is None:
            raise ValueError("Checkpoints needs options.save_dir")
        self.options = options
        self.directory = options.save_dir
        self.model = model
        self.chief = chief
        self.resumed = resumed
        self._position = position
        self._on_saved = on_saved
        self.written: list[str] = []  # state files written, oldest first
        # A worker's last position read and whether it was a finished final: the chief writes it.
        self._read_not_yet_written: tuple[InputPosition, bool] | None = None

    def after_step(self, step: int) -> str | None:
        """A checkpoint if ``step`` is a multiple of ``checkpoint_every``; its state file."""
        every = self.options.checkpoint_every
        if not every or step % every:
            return None
        folder = os.path.join(self.directory, CHECKPOINTS)
        state = self._write(folder, self.model.at_step(step), state_name(step), step)
        log.info("step %d: checkpoint %s", step, os.path.join(folder, self.model.at_step(step)))
        return state

    def final(self, step: int, finished: str = "") -> str | None:
        """The trained model as ``DIR/<final>`` and ``DIR/state.json``; the state file.
        ``finished``: why the run is done (its data ended, its steps are done), or "" if it
        was stopped early and may be resumed."""
        state = self._write(self.directory, self.model.final, STATE, step, finished)
        path = os.path.join(self.directory, self.model.final)
        log.info("saved the model after %d steps: %s", step, path)
        return state

    def _write(
        self, folder: str, name: str, state: str, step: int, finished: str = ""
    ) -> str | None:
        if not self.chief:
            scratch = tempfile.mkdtemp(prefix="stagefeed-worker-save-")
            try:
                self.model.save(os.path.join(scratch, name))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            if self._position is not None:  # every worker: a cluster's position is gathered
                position = self._position()  # (collective): the chief's previous write is done
                self.confirm_written()
                self._read_not_yet_written = (position, bool(finished))
            return None
        os.makedirs(folder, exist_ok=True)
        files = self.model.save(os.path.join(folder, name))
        delay = float(os.environ.get(TEST_STATE_DELAY) or 0)
        if delay > 0:  # the test hook (module docstring): a kill here leaves no state file
            log.info("test hook: %.1f s between the model and its state file", delay)
            time.sleep(delay)
        # The position is read now, after the model: what the model has trained, no more.
        position = self._position() if self._position is not None else None
        path = os.path.join(folder, state)
        write_state(path, self._state(step, files, name, finished, position))
        self.written.append(path)
        if self._on_saved is not None and position is not None:
            self._on_saved(position, bool(finished))
        return path

    def confirm_written(self) -> None:
        """(a worker other than the chief) The chief has written the checkpoint whose position
        this worker read last: tell ``on_saved``. Call once the cluster is past the chief's
        write (a later collective)."""
        if self._read_not_yet_written is not None and self._on_saved is not None:
            self._on_saved(*self._read_not_yet_written)
        self._read_not_yet_written = None

    def _state(
        self,
        step: int,
        files: list[str],
        name: str,
        finished: str,
        position: InputPosition | None,
    ) -> dict[str, Any]:
        options = self.options
        per_epoch = options.steps_per_epoch
        return {
            "step": step,
            # epochs of --steps-per-epoch steps, or passes of a source with passes trained
            "epoch": step // per_epoch if per_epoch else _passes(position),
            "steps_per_epoch": per_epoch or None,
            "model": options.model,
            "model_files": sorted(files),
            "model_path": name,
            "finished": finished or False,
            "schema": options.schema.to_dict(),
            "input": None if position is None else position.to_dict(),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def _passes(position: InputPosition | None) -> int | None:
    """Every shard's passes ``position`` holds all of (None: no pass ends)."""
    return None if position is None else passes_trained(position)
