"""Resume from ``--save DIR``: the newest complete checkpoint, checked against this run.

A run whose ``DIR`` holds a checkpoint resumes from the newest complete one: the state file
with the highest step (``DIR/state.json`` wins a tie: it was written last) whose model files
are whole (``consumer.checkpoint_files``: all there, none cut short). The state file is
written last and atomically (``consumer.checkpoints``), so a checkpoint whose writer was
killed has no state file and is never chosen. Newer checkpoints whose model is not whole
(deleted, cut short) are passed over, said in one line.

Refused at start (``ConfigError``, one line, exit 2), never resumed silently:

- ``DIR`` holds a run's files but no complete checkpoint (nothing to resume, and this run
  would overwrite them);
- the checkpoint is of another ``--model`` or another schema;
- the run it holds finished (its data ended, its planned steps are done, or every pass
  ``--epochs`` plans of a source with passes is trained: the position's pass ends say so,
  whatever its ``finished``);
- a state file without an input position (``"input": null``: one written before positions
  were booked): resuming it could not be exact;
- a state file that is not a regular file, not a JSON object, or holds a number out of
  bounds (a step, epoch, seq or shard: ``common.position.MAX_SEQ``).

``--fresh`` starts over: the previous run's files move to ``DIR/previous-<time>/`` (nothing is
deleted). The number of shards is checked when producers say hello (``consumer.books.shard_books``),
a source that cannot seek is announced there. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import tempfile
import time
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import COUNTS, InputPosition, is_count, passes_trained
from stagefeed.common.schema import Schema
from stagefeed.consumer.checkpoint_files import problem, read_state

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE = "state.json"
# What marks a directory as holding a run (besides state files).
RUN_FILES = (STATE, CHECKPOINTS, "model.keras", "model.ckpt.index", "checkpoint")
_STATE_NAME = re.compile(r"state-([0-9]{6,16})\.json")


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from."""

    path: str  # its state file
    step: int
    epoch: int | None
    model_path: str  # what the trainer's format restores (a file, or a Saver's prefix)
    position: InputPosition
    passed_over: tuple[str, ...] = ()  # newer checkpoints not whole: "PATH (why)", newest first

    def passed_over_line(self) -> str | None:
        """The one line that says which newer checkpoints were passed over, or None."""
        if not self.passed_over:
            return None
        more = f" and {len(self.passed_over) - 1} newer" if len(self.passed_over) > 1 else ""
        return (f"checkpoint {self.passed_over[0]}{more} cannot be resumed: resuming from the "
                f"newest complete one before it, {self.path} (step {self.step})")  # fmt: skip

    def describe(self) -> str:
        streams = ", ".join(
            f"shard {s} at {p.next}" + (f" (+{len(p.above)} above)" if p.above else "")
            for s, p in sorted(self.position.streams.items())
        )
        epoch = "" if self.epoch is None else f", epoch {self.epoch}"
        return f"step {self.step}{epoch}, input: {streams or 'nothing trained yet'}"


def states(save_dir: str) -> list[tuple[int, int, str]]:
    """``(step, rank, path)`` of every state file in ``save_dir``, oldest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(save_dir), CHECKPOINTS, "state-*.json")):
        match = _STATE_NAME.fullmatch(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), 0, path))
    final = os.path.join(save_dir, STATE)
    if os.path.lexists(final):  # whatever it is: read_state refuses a FIFO without waiting
        found.append((_step(read_state(final), final), 1, final))
    return sorted(found)


def holds_a_run(save_dir: str) -> str | None:
    """The first of a run's files ``save_dir`` holds, or None."""
    return next((n for n in RUN_FILES if os.path.lexists(os.path.join(save_dir, n))), None)


def newest(save_dir: str, options: TrainerOptions) -> Resume | None:
    """The checkpoint to resume from (see the module docstring); None if ``save_dir`` holds
    no run; ``ConfigError`` if it holds one that this run cannot resume exactly."""
    held = holds_a_run(save_dir)
    if held is None:
        return None
    skipped: list[str] = []  # newest first: "PATH (what is wrong)"
    for step, _, path in reversed(states(save_dir)):
        state = read_state(path)
        why = problem(os.path.dirname(path), state)
        if why is not None:
            skipped.append(f"{path} ({why})")
            continue
        model_path = os.path.join(os.path.dirname(path), state["model_path"])
        found = _checked(path, state, step, model_path, options)
        return dataclasses.replace(found, passed_over=tuple(skipped))
    newest_one = f"; the newest, {skipped[0]}" if skipped else ""
    raise ConfigError(
        f"--save {save_dir!r} already holds a run's {held} but no complete checkpoint to "
        "resume from; pass --fresh to start over (its files move to previous-<time>/)"
        + newest_one
    )


def _checked(
    path: str, state: dict[str, Any], step: int, model_path: str, options: TrainerOptions
) -> Resume:
    again = "pass --fresh to start over, or choose another --save directory"
    if state.get("model") != options.model:
        raise ConfigError(f"checkpoint {path} is of --model {state.get('model')!r}, not "
                          f"{options.model!r}: {again}")  # fmt: skip
    try:
        schema = Schema.from_dict(state.get("schema"), source=path)
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {path}: {exc}; {again}") from None
    if schema != options.schema:
        raise ConfigError(f"checkpoint {path} was trained on {schema.describe()}, this run "
                          f"sends {options.schema.describe()}: {again}")  # fmt: skip
    if state.get("finished"):
        raise ConfigError(f"--save {options.save_dir!r} holds a finished run ({path}: step "
                          f"{step}, {state['finished']}): nothing to resume; {again}")  # fmt: skip
    if state.get("input") is None:
        raise ConfigError(f"checkpoint {path} holds no input position (written before "
                          "positions were booked): resuming it would train "
                          f"batches twice or never; {again}")  # fmt: skip
    position = InputPosition.from_dict(state["input"], f"checkpoint {path}")
    _step(state, path)
    passes = passes_trained(position)
    if passes is not None and passes >= options.epochs:  # a state written without the rule
        raise ConfigError(f"--save {options.save_dir!r} holds a finished run ({path}: step "
                          f"{step}, {passes} passes trained of --epochs {options.epochs}): "
                          f"nothing to resume; {again}")  # fmt: skip
    epoch = state.get("epoch")
    if epoch is not None and not is_count(epoch):
        raise ConfigError(f"checkpoint {path}: epoch must be a count in {COUNTS} or "
                          f"null, got {str(epoch)[:80]}")  # fmt: skip
    return Resume(path, step, epoch, model_path, position)


def start_over(save_dir: str) -> str | None:
    """``--fresh``: move the previous run's files into ``save_dir/previous-<time>/``; the
    folder, or None if there was nothing to move."""
    names = [n for n in os.listdir(save_dir) if not n.startswith("previous-")] \
        if holds_a_run(save_dir) else []  # fmt: skip
    if not names:
        return None
    folder = tempfile.mkdtemp(prefix=time.strftime("previous-%Y%m%dT%H%M%S-"), dir=save_dir)
    for name in names:
        os.rename(os.path.join(save_dir, name), os.path.join(folder, name))
    log.info("--fresh: the previous run's files moved to %s", folder)
    return folder


def _step(state: dict[str, Any], path: str) -> int:
    """The state's ``step``: a count, else ``ConfigError`` naming the file and the value."""
    step = state.get("step")
    if not is_count(step):
        raise ConfigError(f"checkpoint {path}: step must be a count in {COUNTS}, got "
                          f"{str(step)[:80]!r}")  # fmt: skip
    return step
