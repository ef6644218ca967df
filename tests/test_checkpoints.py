"""``consumer/checkpoints.py``: the layout, the state file written after the model (atomically),
who writes, and a directory that already holds a run refused at start. The model formats
themselves are exercised by the real runs of ``test_run_length.py`` and ``test_keras_cli.py``.
"""

from __future__ import annotations

import json
import os

import pytest
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.checkpoints import Checkpoints, ModelFormat, check_save_dir, is_chief

from tests.conftest import run_cli
from tests.regression_models import SCHEMA


class FileModel:
    """A model format that writes one file per save and records what existed before it."""

    def __init__(self) -> None:
        self.saved: list[str] = []
        self.seen_before: list[list[str]] = []

    def save(self, path: str) -> list[str]:
        folder = os.path.dirname(path)
        self.seen_before.append(sorted(os.listdir(folder)))
        with open(path, "w") as f:
            f.write("weights")
        self.saved.append(path)
        return [os.path.basename(path)]

    def format(self) -> ModelFormat:
        return ModelFormat(final="model.bin", at_step=lambda s: f"model-{s}.bin", save=self.save)


def options(tmp_path, every: int = 2, per_epoch: int = 0) -> TrainerOptions:
    return TrainerOptions(
        schema=SCHEMA, save_dir=str(tmp_path), checkpoint_every=every,
        steps_per_epoch=per_epoch, epochs=2 if per_epoch else 1,
    )  # fmt: skip


def test_every_nth_step_and_the_end_write_the_model_then_its_state(tmp_path):
    model = FileModel()
    checkpoints = Checkpoints(options(tmp_path, every=2, per_epoch=3), model.format(), chief=True)
    written = [checkpoints.after_step(step) for step in range(1, 6)]
    final = checkpoints.final(5)
    assert written == [None, str(tmp_path / "checkpoints" / "state-000002.json"), None,
                       str(tmp_path / "checkpoints" / "state-000004.json"), None]  # fmt: skip
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "model-2.bin", "model-4.bin", "state-000002.json", "state-000004.json",
    ]  # fmt: skip
    assert final == str(tmp_path / "state.json")
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "model.bin", "state.json"]
    # The state file comes after its model, never before: a checkpoint is complete or absent.
    assert "state-000002.json" not in model.seen_before[0]
    with open(tmp_path / "checkpoints" / "state-000004.json") as f:
        state = json.load(f)
    assert (state["step"], state["epoch"], state["steps_per_epoch"]) == (4, 1, 3)
    assert state["model_files"] == ["model-4.bin"] and state["input"] is None
    assert state["schema"] == SCHEMA.to_dict()


def test_a_failed_model_save_leaves_no_state_for_that_step(tmp_path):
    def broken(path: str) -> list[str]:
        raise OSError("disk full")

    checkpoints = Checkpoints(
        options(tmp_path), ModelFormat("model.bin", str, broken), chief=True
    )
    with pytest.raises(OSError, match="disk full"):
        checkpoints.after_step(2)
    assert os.listdir(tmp_path / "checkpoints") == []


def test_another_worker_saves_to_a_scratch_directory_and_writes_nothing_here(tmp_path):
    model = FileModel()
    checkpoints = Checkpoints(options(tmp_path), model.format(), chief=False)
    assert checkpoints.after_step(2) is None and checkpoints.final(3) is None
    assert len(model.saved) == 2 and not any(p.startswith(str(tmp_path)) for p in model.saved)
    assert not any(os.path.exists(p) for p in model.saved)  # the scratch folders are gone
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("tf_config", "chief"),
    [
        (None, True),
        ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}', True),
        ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}', False),
        ('{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", '
         '"index": 0}}', False),
        ('{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", '
         '"index": 0}}', True),
    ],
)  # fmt: skip
def test_the_chief_is_told_from_tf_config(monkeypatch, tf_config, chief):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert is_chief(tf_config or "") is chief


def test_a_malformed_tf_config_is_a_config_error():
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        is_chief('{"task": "worker"')


@pytest.mark.parametrize(
    "existing", ["state.json", "model.keras", "model.ckpt.index", "checkpoints"]
)
def test_a_directory_holding_a_run_is_refused(tmp_path, existing):
    (tmp_path / existing).mkdir() if existing == "checkpoints" else (tmp_path / existing).touch()
    with pytest.raises(ConfigError, match=f"already holds a run's {existing}"):
        check_save_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="already holds"):
        Checkpoints(options(tmp_path), FileModel().format(), chief=True)


def test_the_command_line_refuses_it_before_anything_starts(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-000020.keras").touch()
    done = run_cli(["run", "--save", str(tmp_path), "--steps", "2"], timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"stagefeed: error: --save {str(tmp_path)!r} already holds a run's checkpoints: this "
        "run would overwrite it (stagefeed cannot resume from it yet); choose another "
        "directory or remove it"
    ]
    assert "TensorFlow" not in done.stderr
