"""State files and checkpoints under bad values (issue 28), through the real CLI: a state file
out of bounds, malformed, not a regular file or of an unknown format version (issue 29) is
refused at start in one line (exit 2, no traceback, no wait); a newest checkpoint whose model
is missing or cut short is passed over for the complete one before it (said in one line), or
refused in one line when there is none; a model damaged inside fails its restore in one line.

Covers consumer/resume.py, consumer/checkpoint_files.py, common/position.py (reading),
consumer/graph/saver.py and consumer/keras_fit/resume_fit.py (restoring).
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile

import pytest

from tests.conftest import run_cli

RUN = [
    "run", "--producers", "1", "--schema", "tests.helpers.resume_models:SCHEMA",
    "--source", "tests.helpers.resume_models:rows", "--steps", "8", "--warmup-steps", "0",
    "--checkpoint-every", "2", "--progress-s", "100", "--producer-timeout-s", "4",
]  # fmt: skip
MODELS = {"graph": "tests.helpers.resume_models:row_counter",
    "keras": "tests.helpers.resume_models:keras_counter"}
NEWEST = "checkpoints/state-000006.json"
TIMEOUT_S = 180


def _args(kind: str, save) -> list[str]:
    return [*RUN, "--model", MODELS[kind], "--save", str(save)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A save directory per model kind, resumable from checkpoints at steps 2, 4 and 6 (the
    final model and state of the run that wrote them removed)."""
    made = {}
    for kind in MODELS:
        save = tmp_path_factory.mktemp(f"run-{kind}")
        done = run_cli([*_args(kind, save), "--steps", "6"], timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        for name in os.listdir(save):
            if name != "checkpoints":
                os.unlink(save / name)
        made[kind] = save
    return made


@pytest.fixture
def copy(runs, tmp_path):
    def _copy(kind: str):
        save = tmp_path / f"save-{kind}"
        shutil.copytree(runs[kind], save)
        return save

    return _copy


def _edit(path, change) -> None:
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


def _one_line_refusal(save, kind: str = "graph") -> str:
    done = run_cli(_args(kind, save), timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagefeed: error: "), done.stderr[-3000:]
    return lines[0]


def _stream(state: dict) -> dict:
    return state["input"]["streams"]["0"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: _stream(s).update(next=2**70, above=[]), str(2**70)),
        (lambda s: _stream(s).update(above=[2**64]), str(2**64)),
        (lambda s: _stream(s).update(end=2**70), str(2**70)),
        (lambda s: _stream(s).update(passes=[3, 2**66]), str(2**66)),
        (lambda s: s["input"].update(shards=2**70), str(2**70)),
        (lambda s: s["input"]["streams"].update({"²": _stream(s)}), "shard '²'"),
        (lambda s: s["input"]["streams"].update({"9" * 5000: _stream(s)}), "shard '999"),
        (lambda s: s["input"].update(approximate=[7]), "approximate shard 7"),
        (lambda s: s.update(step="abc"), "step must be a count in [0, 2**53], got 'abc'"),
        (lambda s: s.update(step=2**80), str(2**80)),
        (lambda s: s.update(epoch=-1), "epoch must be a count"),
    ],
    ids=["next", "above", "end", "passes", "shards", "superscript-key", "long-key",
         "approximate", "step-abc", "step-huge", "epoch"],  # fmt: skip
)
def test_a_state_file_out_of_bounds_is_refused_at_start_in_one_line(copy, change, named):
    save = copy("graph")
    _edit(save / NEWEST, change)
    line = _one_line_refusal(save)
    assert str(save / NEWEST) in line and named in line, line


def test_a_final_state_file_whose_step_is_not_a_number_is_refused_in_one_line(copy):
    save = copy("graph")
    state = json.loads((save / NEWEST).read_text())
    (save / "state.json").write_text(json.dumps({**state, "step": "abc"}))
    line = _one_line_refusal(save)
    assert f"{save / 'state.json'}: step must be a count" in line and "'abc'" in line, line


@pytest.mark.parametrize("name", ["state.json", NEWEST])
def test_a_state_file_nested_100000_deep_is_refused_in_one_line(copy, name):
    save = copy("graph")
    (save / name).write_text("[" * 100_000)
    assert f"{save / name} is nested too deeply" in _one_line_refusal(save)


@pytest.mark.parametrize("name", ["state.json", NEWEST])
def test_a_state_file_that_is_a_fifo_is_refused_without_waiting_on_it(copy, name):
    save = copy("graph")
    if os.path.exists(save / name):
        os.unlink(save / name)
    os.mkfifo(save / name)
    line = _one_line_refusal(save)
    assert f"checkpoint state {save / name} is not a regular file (prw" in line, line


def _cut_keras(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "graph-index-cut": ("graph", "model.ckpt-6.index", "model.ckpt-6.index is cut short"),
    "graph-data-gone": ("graph", "model.ckpt-6.data-00000-of-00001", "missing"),
    "keras-cut": ("keras", "step-000006.keras", "step-000006.keras is cut short"),
    "keras-model-path": ("keras", None, "model_files do not hold model_path 'gone.keras'"),
}


def _damage(save, name: str | None, how: str) -> None:
    if name is None:
        _edit(save / NEWEST, lambda s: s.update(model_path="gone.keras"))
    elif how == "missing":
        os.unlink(save / "checkpoints" / name)
    else:
        _cut_keras(save / "checkpoints" / name)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_complete_one_before_it(copy, case):
    kind, name, why = DAMAGE[case]
    save = copy(kind)
    _damage(save, name, why)
    done = run_cli(_args(kind, save), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    said = [line for line in done.stderr.splitlines() if "cannot be resumed" in line]
    assert len(said) == 1, done.stderr[-4000:]
    assert f"checkpoint {save / NEWEST} (" in said[0] and why in said[0], said
    assert said[0].endswith(f"before it, {save / 'checkpoints/state-000004.json'} (step 4)")
    assert "resumed from step 4" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["graph-index-cut", "keras-cut"])
def test_a_damaged_checkpoint_with_none_complete_before_it_is_refused_in_one_line(copy, case):
    kind, name, why = DAMAGE[case]
    save = copy(kind)
    for step in (2, 4):
        os.unlink(save / f"checkpoints/state-00000{step}.json")
    _damage(save, name, why)
    line = _one_line_refusal(save, kind)
    assert "no complete checkpoint to resume from; pass --fresh" in line, line
    assert f"; the newest, {save / NEWEST} (" in line and why in line, line


def _damage_inside_keras(path) -> None:
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data[: len(data) // 2] if member.endswith(".h5") else data)


@pytest.mark.parametrize(
    ("kind", "said"),
    [("graph", "OutOfRangeError: Read less bytes than requested"), ("keras", "OSError")],
)
def test_a_model_damaged_inside_fails_its_restore_in_one_line(copy, kind, said):
    save = copy(kind)
    if kind == "graph":
        data = save / "checkpoints/model.ckpt-6.data-00000-of-00001"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        _damage_inside_keras(save / "checkpoints/step-000006.keras")
    done = run_cli(_args(kind, save), timeout=TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("stagefeed: error:")]
    assert len(errors) == 1 and errors == done.stderr.strip().splitlines()[-1:], done.stderr
    assert f"cannot restore checkpoint {save}/checkpoints/" in errors[0] and said in errors[0]


@pytest.mark.parametrize("name", ["state.json", NEWEST])
def test_a_state_file_of_an_unknown_format_version_is_refused_in_one_line(copy, name):
    save = copy("graph")
    if name == "state.json":
        shutil.copy(save / NEWEST, save / name)
    _edit(save / name, lambda s: s.update(version=2))
    line = _one_line_refusal(save)
    said = f"checkpoint state {save / name} has format version 2; this stagefeed reads version 1"
    assert said in line, line
