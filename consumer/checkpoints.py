"""``--save DIR`` and ``--checkpoint-every N`` for both trainers: what is written, when, by whom.

Layout (the model's files are its trainer's format: a ``tf.compat.v1.train.Saver`` checkpoint
in graph mode, ``.keras`` files for Keras)::

    DIR/checkpoints/<model at step N>     every N steps (all kept)
    DIR/checkpoints/state-0000N.json      the run's state at step N, written after the model
    DIR/<final model>                     at the end of training
    DIR/state.json                        the run's state at the end, written after the model

A checkpoint is its state file and the model files it names: the state file is written last,
atomically (a temporary file renamed over it), so a checkpoint is complete or has no state
file, whatever kills the writer. The state holds the step, the epoch and the run's settings;
``input`` is where the input position will go (resume, ``docs/resume.md`` once it exists).

Who writes: the chief (``is_chief``, from ``common.tf_config``: TF_CONFIG's rules). Another
worker of a cluster saves its model to a temporary directory that is removed at once
(TensorFlow's multi-worker pattern: saving may need every worker's part in a collective), and
writes no state.

A directory that already holds a run's model or checkpoints is refused at start
(``check_save_dir``, before TensorFlow loads): until a run can resume from them, nothing
overwrites another run's checkpoints without saying so.

No TensorFlow here: the trainers hand in how to save their model (``ModelFormat``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import is_chief

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE = "state.json"


@dataclasses.dataclass(frozen=True)
class ModelFormat:
    """How a trainer saves its model. ``save(path)`` writes the model at ``path`` (a file, or
    a Saver's prefix) and returns the files it wrote, relative to ``path``'s directory."""

    final: str  # the final model's name in DIR: "model.ckpt", "model.keras"
    at_step: Callable[[int], str]  # a checkpoint's name in DIR/checkpoints
    save: Callable[[str], list[str]]


def state_name(step: int) -> str:
    return f"state-{step:06d}.json"


def check_save_dir(save_dir: str) -> None:
    """``ConfigError`` if ``save_dir`` holds a run's model, state or checkpoints already."""
    found = [
        name for name in (STATE, CHECKPOINTS, "model.keras", "model.ckpt.index", "checkpoint")
        if os.path.lexists(os.path.join(save_dir, name))
    ]  # fmt: skip
    if found:
        raise ConfigError(
            f"--save {save_dir!r} already holds a run's {found[0]}: this run would overwrite "
            "it (stagefeed cannot resume from it yet); choose another directory or remove it"
        )


class Checkpoints:
    """Saves the model every ``options.checkpoint_every`` steps and at the end, each with its
    state file (see the module docstring). Call ``after_step`` after every booked step and
    ``final`` once; neither is called for a non-finite model (the loss policy stops first)."""

    def __init__(
        self, options: TrainerOptions, model: ModelFormat, chief: bool | None = None
    ) -> None:
        if options.save_dir is None:
            raise ValueError("Checkpoints needs options.save_dir")
        self.options = options
        self.directory = options.save_dir
        self.model = model
        self.chief = is_chief() if chief is None else chief
        if self.chief:
            check_save_dir(self.directory)
        self.written: list[str] = []  # state files written, oldest first

    def after_step(self, step: int) -> str | None:
        """A checkpoint if ``step`` is a multiple of ``checkpoint_every``; its state file."""
        every = self.options.checkpoint_every
        if not every or step % every:
            return None
        folder = os.path.join(self.directory, CHECKPOINTS)
        state = self._write(folder, self.model.at_step(step), state_name(step), step)
        log.info("step %d: checkpoint %s", step, os.path.join(folder, self.model.at_step(step)))
        return state

    def final(self, step: int) -> str | None:
        """The trained model as ``DIR/<final>`` and ``DIR/state.json``; the state file."""
        state = self._write(self.directory, self.model.final, STATE, step)
        path = os.path.join(self.directory, self.model.final)
        log.info("saved the model after %d steps: %s", step, path)
        return state

    def _write(self, folder: str, name: str, state: str, step: int) -> str | None:
        if not self.chief:
            scratch = tempfile.mkdtemp(prefix="stagefeed-worker-save-")
            try:
                self.model.save(os.path.join(scratch, name))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        os.makedirs(folder, exist_ok=True)
        files = self.model.save(os.path.join(folder, name))
        path = os.path.join(folder, state)
        _write_atomically(path, self._state(step, files))
        self.written.append(path)
        return path

    def _state(self, step: int, files: list[str]) -> dict[str, Any]:
        options = self.options
        per_epoch = options.steps_per_epoch
        return {
            "step": step,
            "epoch": step // per_epoch if per_epoch else None,
            "steps_per_epoch": per_epoch or None,
            "model": options.model,
            "model_files": sorted(files),
            "schema": options.schema.to_dict(),
            "input": None,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def _write_atomically(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` as JSON so that ``path`` is either the old file or the whole new one."""
    folder = os.path.dirname(path)
    fd, scratch = tempfile.mkstemp(prefix=".state-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        if os.path.exists(scratch):
            os.unlink(scratch)
        raise
