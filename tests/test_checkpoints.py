"""``consumer/checkpoints.py``: the layout, the state file written after the model (atomically),
with the input position read after the model too, who writes, and a directory that already
holds a run: resumed from its newest complete checkpoint, refused, or moved aside (``--fresh``,
``consumer/resume.py``). The model formats themselves are exercised by the real runs of
``test_run_length.py``, ``test_keras_cli.py`` and ``test_resume.py``.
"""

from __future__ import annotations

import json
import os

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition, StreamPosition
from stagefeed.common.tf_config import place
from stagefeed.consumer.checkpoints import (
    Checkpoints,
    ModelFormat,
    check_save_dir,
    resume_point,
)
from tests.conftest import run_cli
from tests.helpers.regression_models import SCHEMA


class FileModel:
    """A model format that writes one file per save and records what existed before it."""

    def __init__(self) -> None:
        self.saved: list[str] = []
        self.seen_before: list[list[str]] = []
        self.restored: list[str] = []
        self.events: list[str] = []  # "save" and "position", in the order they happened

    def save(self, path: str) -> list[str]:
        folder = os.path.dirname(path)
        self.seen_before.append(sorted(os.listdir(folder)))
        with open(path, "w") as f:
            f.write("weights")
        self.saved.append(path)
        self.events.append("save")
        return [os.path.basename(path)]

    def format(self) -> ModelFormat:
        return ModelFormat(final="model.bin", at_step=lambda s: f"model-{s}.bin", save=self.save,
                           restore=self.restored.append)  # fmt: skip


def options(tmp_path, every: int = 2, per_epoch: int = 0, **more) -> TrainerOptions:
    return TrainerOptions(
        schema=SCHEMA, save_dir=str(tmp_path), checkpoint_every=every,
        steps_per_epoch=per_epoch, epochs=2 if per_epoch else 1, **more,
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
    assert state["model_path"] == "model-4.bin" and state["finished"] is False


def test_the_position_is_read_after_the_model_was_saved_and_is_what_it_said_then(tmp_path):
    """The position must hold what the saved model trained: read before the save, a batch
    trained in between (another thread's booking) would be missing from it, or one that was
    not trained would be in it. This fails if the state is built before the model is saved."""
    model = FileModel()
    books = {"trained": 6}

    def position() -> InputPosition:
        model.events.append("position")
        return InputPosition(1, {0: StreamPosition(books["trained"], {books["trained"] + 2})})

    checkpoints = Checkpoints(options(tmp_path), model.format(), chief=True, position=position)
    checkpoints.after_step(2)
    assert model.events == ["save", "position"]
    with open(tmp_path / "checkpoints" / "state-000002.json") as f:
        state = json.load(f)
    assert state["input"]["streams"] == {"0": {"next": 6, "above": [8], "end": None}}
    assert InputPosition.from_dict(state["input"], "test").streams[0].next == 6


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


def test_a_position_is_told_saved_only_once_its_state_file_is_written(tmp_path):
    """The chief: after each state file. Another worker: at its next checkpoint (its gather
    follows the chief's write), or when told the cluster is past the last write."""
    positions = [InputPosition(1, {0: StreamPosition(n)}) for n in (2, 4, 5)]
    for chief in (True, False):
        read, told = iter(positions), []
        checkpoints = Checkpoints(
            options(tmp_path / str(chief)), FileModel().format(), chief=chief,
            position=lambda read=read: next(read),
            on_saved=lambda position, finished, told=told: told.append(
                position.of(0).next if not finished else -position.of(0).next
            ),
        )  # fmt: skip
        checkpoints.after_step(2)
        assert told == ([2] if chief else [])
        checkpoints.after_step(4)
        assert told == ([2, 4] if chief else [2])
        checkpoints.final(5, "every producer's data ended")  # a finished run: negated here
        assert told == ([2, 4, -5] if chief else [2, 4])
        checkpoints.confirm_written()  # the cluster's barrier after the final checkpoint
        assert told == [2, 4, -5]


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
def test_the_chief_is_told_from_tf_config(tf_config, chief):
    assert place({"TF_CONFIG": tf_config} if tf_config else {}).chief is chief


def test_a_malformed_tf_config_is_a_config_error():
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        place({"TF_CONFIG": '{"task": "worker"'})


@pytest.mark.parametrize(
    "existing", ["state.json", "model.keras", "model.ckpt.index", "checkpoints"]
)
def test_a_directory_holding_a_run_but_no_complete_checkpoint_is_refused(tmp_path, existing):
    if existing == "checkpoints":
        (tmp_path / existing).mkdir()
    elif existing == "state.json":
        (tmp_path / existing).write_text('{"step": 3, "model_files": ["gone.bin"], '
                                         '"model_path": "gone.bin"}')  # fmt: skip
    else:
        (tmp_path / existing).touch()
    with pytest.raises(ConfigError, match="no complete checkpoint to resume from; pass --fresh"):
        check_save_dir(options(tmp_path))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resume_point(options(tmp_path), FileModel().format(), chief=True)


def _run_to(tmp_path, steps: int, position: InputPosition | None = None, **more) -> FileModel:
    model = FileModel()
    checkpoints = Checkpoints(options(tmp_path, **more), model.format(), chief=True,
                              position=lambda: position)  # fmt: skip
    for step in range(1, steps + 1):
        checkpoints.after_step(step)
    return model


def test_a_run_resumes_from_its_newest_complete_checkpoint(tmp_path):
    position = InputPosition(2, {0: StreamPosition(3, {5}), 1: StreamPosition(4)})
    _run_to(tmp_path, 6, position)
    os.unlink(tmp_path / "checkpoints" / "model-6.bin")  # killed while writing: incomplete
    model = FileModel()
    assert resume_point(options(tmp_path), model.format(), chief=False) is None  # not its call
    assert model.restored == []
    resumed = resume_point(options(tmp_path), model.format(), chief=True)
    assert resumed is not None and resumed.step == 4
    assert model.restored == [str(tmp_path / "checkpoints" / "model-4.bin")]
    assert resumed.position.to_dict() == position.to_dict()
    assert resumed.describe() == "step 4, input: shard 0 at 3 (+1 above), shard 1 at 4"


@pytest.mark.parametrize(
    ("changed", "refused"),
    [
        ({"model": "tests.helpers.regression_models:linear_fn"}, "is of --model 'alexnet'"),
        ({"schema": SCHEMA.with_batch_size(8)}, "was trained on"),
    ],
)
def test_a_checkpoint_of_another_model_or_schema_is_refused(tmp_path, changed, refused):
    _run_to(tmp_path, 2, InputPosition(1))
    fields = {"schema": SCHEMA, "save_dir": str(tmp_path), **changed}
    with pytest.raises(ConfigError, match=refused):
        check_save_dir(TrainerOptions(**fields))


def test_a_finished_run_or_one_without_a_position_is_not_resumed(tmp_path):
    _run_to(tmp_path / "a", 2, None)
    with pytest.raises(ConfigError, match="holds no input position"):
        check_save_dir(options(tmp_path / "a"))
    os.makedirs(tmp_path / "b")
    done = Checkpoints(options(tmp_path / "b"), FileModel().format(), chief=True,
                       position=lambda: InputPosition(1))  # fmt: skip
    done.final(5, "every producer's data ended")
    with pytest.raises(ConfigError, match="holds a finished run .* nothing to resume"):
        check_save_dir(options(tmp_path / "b"))


def test_fresh_moves_the_previous_run_aside_and_starts_over(tmp_path):
    _run_to(tmp_path, 4, InputPosition(1))
    assert resume_point(options(tmp_path, fresh=True), FileModel().format(), chief=True) is None
    kept = [n for n in os.listdir(tmp_path) if n.startswith("previous-")]
    assert len(kept) == 1 and os.listdir(tmp_path) == kept
    assert sorted(os.listdir(tmp_path / kept[0] / "checkpoints"))[-1] == "state-000004.json"


def test_the_command_line_refuses_an_unresumable_directory_before_anything_starts(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-000020.keras").touch()
    done = run_cli(["run", "--save", str(tmp_path), "--steps", "2"], timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"stagefeed: error: --save {str(tmp_path)!r} already holds a run's checkpoints but no "
        "complete checkpoint to resume from; pass --fresh to start over (its files move to "
        "previous-<time>/)"
    ]
    assert "TensorFlow" not in done.stderr


def test_what_checkpoints_are_given_is_given_at_construction_never_assigned_after():
    """``position``, ``on_saved`` and ``resumed`` go to the constructor (issue 29): no module
    of the trainer assigns an attribute of a ``Checkpoints`` it holds."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "consumer"
    assigned = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            )  # fmt: skip
            for target in targets:
                if isinstance(target, ast.Attribute) and "checkpoints" in ast.unparse(
                    target.value
                ).split(".")[-1]:
                    assigned.append(f"{path.relative_to(root)}:{node.lineno}")
    assert assigned == [], assigned
