"""The state file's format (issue 29): written with ``"version": 1``, a file without one (written
by stagefeed 0.2.0 and before) read as version 1, another version refused naming it, and the
directory fsynced after the rename that puts the state file in place (a finished producer
leaves once told ``saved``: the rename must survive a host crash). The refusal through the
real CLI is in ``tests/test_state_files.py``.

Covers consumer/checkpoint_files.py (``write_state``, ``read_state``) and its use by
consumer/checkpoints.py.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition
from stagefeed.consumer.checkpoint_files import STATE_VERSION, read_state, write_state
from stagefeed.consumer.checkpoints import Checkpoints, ModelFormat, check_save_dir
from tests.helpers.regression_models import SCHEMA


def _model_format() -> ModelFormat:
    def save(path: str) -> list[str]:
        with open(path, "w") as f:
            f.write("weights")
        return [os.path.basename(path)]

    return ModelFormat(final="model.bin", at_step=lambda s: f"model-{s}.bin", save=save,
                       restore=lambda path: None)  # fmt: skip


def _options(save_dir) -> TrainerOptions:
    return TrainerOptions(schema=SCHEMA, save_dir=str(save_dir), checkpoint_every=2)


def _two_steps(save_dir) -> str:
    """A run's checkpoint at step 2 in ``save_dir``; its state file."""
    checkpoints = Checkpoints(_options(save_dir), _model_format(), chief=True,
                              position=lambda: InputPosition(1))  # fmt: skip
    checkpoints.after_step(1)
    state = checkpoints.after_step(2)
    assert state is not None
    return state


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_every_state_file_is_written_with_its_format_version(tmp_path):
    path = _two_steps(tmp_path)
    assert _read(path)["version"] == STATE_VERSION == 1
    final = Checkpoints(_options(tmp_path / "b"), _model_format(), chief=True).final(3)
    assert final is not None and _read(final)["version"] == 1


def test_a_state_file_without_a_version_is_read_as_version_1(tmp_path):
    path = _two_steps(tmp_path)
    state = _read(path)
    del state["version"]  # as stagefeed 0.2.0 wrote it
    with open(path, "w") as f:
        json.dump(state, f)
    resumed = check_save_dir(_options(tmp_path))
    assert resumed is not None and resumed.step == 2


@pytest.mark.parametrize("version", [2, 0, "1", True, None, [1]])
def test_a_state_file_of_another_version_is_refused_naming_it(tmp_path, version):
    path = _two_steps(tmp_path)
    state = _read(path)
    state["version"] = version
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(ConfigError, match=f"{path} has format version .*reads version 1"):
        read_state(path)
    with pytest.raises(ConfigError, match="has format version"):
        check_save_dir(_options(tmp_path))


def test_the_directory_is_fsynced_after_the_rename_that_puts_the_state_in_place(
    tmp_path, monkeypatch
):
    """``write_state`` itself, run in-process with ``os.replace`` and ``os.fsync`` recorded
    (then done): the last fsync is of the state file's directory, after the rename."""
    events: list[tuple[str, object]] = []
    replace, fsync = os.replace, os.fsync

    def recorded_replace(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        events.append(("replace", str(dst)))

    def recorded_fsync(fd):
        info = os.fstat(fd)
        fsync(fd)
        events.append(("fsync", (stat.S_ISDIR(info.st_mode), info.st_ino)))

    monkeypatch.setattr(os, "replace", recorded_replace)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    path = str(tmp_path / "state.json")
    write_state(path, {"step": 3})
    folder = os.stat(tmp_path).st_ino
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"], events
    assert events[0][1][0] is False  # the temporary file's data, before the rename
    assert events[1] == ("replace", path)
    assert events[2][1] == (True, folder)  # the directory holding the new name
    assert read_state(path) == {"version": 1, "step": 3}
