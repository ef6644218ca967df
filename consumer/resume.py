"""Resume from ``--save DIR``: the newest complete checkpoint, checked against this run.

A run whose ``DIR`` holds a checkpoint resumes from the newest complete one: the state file
with the highest step (``DIR/state.json`` wins a tie: it was written last) whose model files
all exist. The state file is written last and atomically (``consumer.checkpoints``), so a
checkpoint whose writer was killed has no state file and is never chosen.

Refused at start (``ConfigError``, one line, exit 2), never resumed silently:

- ``DIR`` holds a run's files but no complete checkpoint (nothing to resume, and this run
  would overwrite them);
- the checkpoint is of another ``--model`` or another schema;
- the run it holds finished (its data ended, its planned steps are done, or every pass
  ``--epochs`` plans of a source with passes is trained: the position's pass ends say so,
  whatever its ``finished``);
- a state file without an input position (``"input": null``: one written before positions
  were booked): resuming it could not be exact.

``--fresh`` starts over: the previous run's files move to ``DIR/previous-<time>/`` (nothing is
deleted). The number of shards is checked when producers say hello (``common.shard_books``),
a source that cannot seek is announced there. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import tempfile
import time
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition
from stagefeed.common.schema import Schema
from stagefeed.consumer.intake.passes import passes_trained

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE = "state.json"
# What marks a directory as holding a run (besides state files).
RUN_FILES = (STATE, CHECKPOINTS, "model.keras", "model.ckpt.index", "checkpoint")
_STATE_NAME = re.compile(r"state-(\d{6,})\.json")


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from."""

    path: str  # its state file
    step: int
    epoch: int | None
    model_path: str  # what the trainer's format restores (a file, or a Saver's prefix)
    position: InputPosition

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
    if os.path.isfile(final):
        found.append((_read(final).get("step", -1), 1, final))
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
    found = states(save_dir)
    for step, _, path in reversed(found):
        state = _read(path)
        model_path = os.path.join(os.path.dirname(path), str(state.get("model_path", "")))
        missing = [f for f in state.get("model_files", [])
                   if not os.path.exists(os.path.join(os.path.dirname(path), f))]  # fmt: skip
        if "model_path" not in state or missing:
            log.warning("checkpoint %s is incomplete (%s): skipped", path,
                        f"{missing[0]} missing" if missing else "no model_path")  # fmt: skip
            continue
        return _checked(path, state, step, model_path, options)
    raise ConfigError(
        f"--save {save_dir!r} already holds a run's {held} but no complete checkpoint to "
        "resume from; pass --fresh to start over (its files move to previous-<time>/)"
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
    passes = passes_trained(position)
    if passes is not None and passes >= options.epochs:  # a state written without the rule
        raise ConfigError(f"--save {options.save_dir!r} holds a finished run ({path}: step "
                          f"{step}, {passes} passes trained of --epochs {options.epochs}): "
                          f"nothing to resume; {again}")  # fmt: skip
    epoch = state.get("epoch")
    return Resume(path, step, epoch if isinstance(epoch, int) else None, model_path, position)


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


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read checkpoint state {path}: {exc}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint state {path} is not a JSON object")
    return state
