"""The built-in data sources from the command line, with real processes: ``stagefeed run`` on
``.npy`` files over two epochs with every record trained exactly once per epoch; ``stagefeed
produce`` on an image folder and on a Parquet file against a stand-in trainer, a corrupt
JPEG and a bad Parquet row skipped and counted (named in the producer's last line) or
ending the run in one line; a missing path, an empty folder or a column not in the file
refused at start in one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stagefeed.common.schema import ArraySpec, Schema
from tests.conftest import run_cli
from tests.helpers.resume_models import EPOCHS, ROWS, counts_in, miscounted
from tests.helpers.standin_trainer import StandInTrainer
from tests.test_data_sources import make_images, write_parquet

IMAGES = Schema(
    (
        ArraySpec("images", "uint8", (12, 16, 3), cast="float32", scale=1 / 255),
        ArraySpec("labels", "int32", (), bounds=(0, 2)),
    ),
    batch_size=2,
)
ROWS_XY = Schema((ArraySpec("x", "float32", (3,)), ArraySpec("y", "int64")), batch_size=2)


def one_line(done, code: int = 2) -> str:
    """The command's last line, after checking it ended with ``code`` and no traceback."""
    said = done.stdout + done.stderr[-4000:]
    assert done.returncode == code, said
    assert "Traceback" not in done.stderr, said
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_run_trains_every_record_of_npy_files_exactly_once_per_epoch(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(ROWS, dtype=np.int32))
    np.save(tmp_path / "x.npy", np.ones(ROWS, np.float32))
    save = tmp_path / "out"
    done = run_cli([
        "run", "--producers", "2", "--batch-size", "4", "--seed", "9",
        "--source", f"npy:{tmp_path / 'ids.npy'},{tmp_path / 'x.npy'}",
        "--model", "tests.helpers.resume_models:row_counter", "--epochs", str(EPOCHS), "--steps",
            "0",
        "--warmup-steps", "0", "--progress-s", "100", "--save", str(save),
        "--json", str(tmp_path / "run.json"),
    ], timeout=300)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert miscounted(counts_in(str(save / "model.ckpt"))) == {}, out[-4000:]
    assert "batch ids int32[4], x float32[4]" in out  # the schema derived from the files
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["batches"]["trained"] == EPOCHS * ROWS // 4, summary


def produce(endpoint: str, source: str, *flags: str):
    return run_cli(["produce", "--connect", endpoint, "--source", source, *flags], timeout=120)


def test_produce_skips_a_corrupt_jpeg_counts_it_and_names_it_in_its_last_line(tmp_path):
    make_images(tmp_path, per_class=4, bad="broken.jpg")  # 9 images: 4 batches and 1 over
    with StandInTrainer(IMAGES, regrant=True) as trainer:
        done = produce(trainer.endpoint, f"images:{tmp_path}", "--on-bad-record", "skip",
                       "--short-batch", "drop")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(trainer.received) == 4
    finished = [line for line in done.stderr.splitlines() if " finished: " in line]
    assert len(finished) == 1, done.stderr[-4000:]
    assert "1 bad records skipped (--on-bad-record skip), the first: " in finished[0]
    assert f"{tmp_path}/dog/broken.jpg (record 8): not a decodable JPEG" in finished[0]
    # The trainer is told too, in the ``end`` (common/protocol.py): the count, the first named.
    [end] = trainer.byes
    assert end["bad"] == 1, end
    assert end["bad_first"].startswith(f"{tmp_path}/dog/broken.jpg (record 8): not a decodable")


def run_pets(tmp_path, *flags: str):
    """``run`` on 13 images (3 batches of 4), one of them a corrupt JPEG, a tiny model."""
    make_images(tmp_path / "pets", per_class=6, bad="broken.jpg")
    return run_cli([
        "run", "--source", f"images:{tmp_path / 'pets'}", *flags,
        "--model", "tests.helpers.image_models:tiny", "--batch-size", "4", "--short-batch", "drop",
        "--warmup-steps", "0", "--progress-s", "100", "--json", str(tmp_path / "run.json"),
    ], timeout=180)  # fmt: skip


@pytest.mark.slow
def test_run_skipping_a_corrupt_jpeg_counts_and_names_it_in_the_trainers_summary(tmp_path):
    done = run_pets(tmp_path, "--producers", "1", "--on-bad-record", "skip")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    bad = json.loads((tmp_path / "run.json").read_text())["bad_records"]
    assert bad["skipped"] == 1, bad
    [first] = bad["first"]  # "<producer>: <file> (record N): why"
    assert f"{tmp_path}/pets/dog/broken.jpg (record " in first, first
    assert "not a decodable JPEG" in first, first
    assert "  bad records skipped by the producers: 1 (--on-bad-record skip), the first: " \
        in done.stdout, done.stdout  # fmt: skip


def test_produce_ends_in_one_line_naming_a_corrupt_jpeg_under_fail(tmp_path):
    make_images(tmp_path, per_class=4, bad="broken.jpg")
    with StandInTrainer(IMAGES, regrant=True) as trainer:
        done = produce(trainer.endpoint, f"images:{tmp_path}", "--short-batch", "drop")
    line = one_line(done)
    assert f"bad record: {tmp_path}/dog/broken.jpg (record 8): not a decodable JPEG" in line
    assert "(--on-bad-record skip to leave such records out)" in line


def test_produce_skips_a_bad_parquet_row_mid_epoch_or_ends_naming_it(tmp_path):
    path = tmp_path / "rows.parquet"
    write_parquet(path, rows=12, bad_row=7)
    with StandInTrainer(ROWS_XY, regrant=True) as trainer:
        done = produce(trainer.endpoint, f"parquet:{path}", "--on-bad-record", "skip",
                       "--no-shuffle")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(trainer.received) == 6
    assert (f"1 bad records skipped (--on-bad-record skip), the first: {path} row group 1 row 3 "
            "(record 7): column 'x': 2 values, expected 3") in done.stderr  # fmt: skip
    with StandInTrainer(ROWS_XY, regrant=True) as trainer:
        done = produce(trainer.endpoint, f"parquet:{path}", "--no-shuffle")
    assert f"bad record: {path} row group 1 row 3 (record 7)" in one_line(done)
    assert len(trainer.received) == 3  # the batches before it were delivered


def test_a_missing_path_an_empty_folder_or_a_missing_column_fails_at_start(tmp_path):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    write_parquet(tmp_path / "rows.parquet")
    (tmp_path / "schema.json").write_text(json.dumps({
        "batch_size": 2, "arrays": [{"name": "z", "dtype": "float32", "shape": [3]}],
    }))  # fmt: skip
    cases = [
        (["produce", "--source", f"npy:{tmp_path}/missing.npy"],
         f"npy:{tmp_path}/missing.npy: no such file"),
        (["run", "--source", f"images:{tmp_path}/empty"],
         f"images:{tmp_path}/empty: no images"),
        (["produce", "--source", f"parquet:{tmp_path}/rows.parquet", "--schema",
          str(tmp_path / "schema.json")], "'z' is not a column of"),
        (["run", "--source", f"parquet:{tmp_path}/rows.parquet", "--batch-size", "3"],
         "10 records are 3 batches of 3 and 1 left over; pass --short-batch drop"),
        (["produce", "--transform", "tests.data_cli:nothing"],
         "--transform, --on-bad-record and --no-shuffle go with a built-in data source"),
    ]  # fmt: skip
    for args, message in cases:
        line = one_line(run_cli(args, timeout=60))
        assert line.startswith("stagefeed: error: ") and message in line, (args, line)


def test_produce_feeds_a_hugging_face_dataset_named_from_a_user_module(tmp_path):
    schema = Schema((ArraySpec("id", "int64"), ArraySpec("x", "float32", (2,))), batch_size=4)
    ids: list[int] = []
    with StandInTrainer(schema, regrant=True,
                        inspect=lambda seq, a: ids.extend(a["id"].tolist())) as trainer:
        done = produce(trainer.endpoint, "tests.helpers.data_user:train", "--workers", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(trainer.received) == 7  # 30 rows: 7 batches of 4, 2 rows left out
    assert len(ids) == len(set(ids)) == 28 and set(ids) <= set(range(30))
    assert "TensorFlow version" not in done.stderr  # datasets left TensorFlow out (USE_TF=0)


@pytest.mark.slow
def test_run_of_epochs_with_a_corrupt_jpeg_under_fail_trains_what_came_and_ends_in_one_line(
    tmp_path,
):
    """A source with passes (``--epochs 2``) whose image is corrupt under ``--on-bad-record
    fail``: the shard that fails never ends its pass, and the other producer waited for that
    pass end while the trainer waited for it (until killed). Now the failed source ends the
    run: what was delivered is trained, the summary is written, then one line naming the
    file, exit 2 (a data source's bad record under ``fail``, README's exit codes)."""
    done = run_pets(tmp_path, "--producers", "2", "--epochs", "2")
    line = one_line(done, code=2)
    assert "broken.jpg" in line and "not a decodable JPEG" in line, line
    assert "stagefeed summary" in done.stdout, done.stdout
    assert "of None" not in done.stdout, done.stdout  # a run with no planned steps says so
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["batches"]["trained"] == summary["batches"]["received"], summary["batches"]
