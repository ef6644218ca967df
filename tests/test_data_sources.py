"""The built-in data sources' readers (producer/data/: arrays, npz, images, parquet, hf):
records, fields, bad records named by file and index, and the refusals at start."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.producer.data.arrays import ArrayRecords, open_npy
from stagefeed.producer.data.images import ImageFolder
from stagefeed.producer.data.npz import open_npz
from stagefeed.producer.data.parquet import ParquetRecords
from stagefeed.producer.data.records import BadRecord, Field

Image = pytest.importorskip("PIL.Image")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def make_images(root, per_class: int = 3, size=(12, 16), bad: str | None = None) -> None:
    """``root/cat``, ``root/dog``: JPEG and PNG files; ``bad``: a corrupt JPEG's name."""
    for label, name in enumerate(("cat", "dog")):
        os.makedirs(root / name, exist_ok=True)
        for k in range(per_class):
            pixels = np.full((*size, 3), 40 * k + label, np.uint8)
            Image.fromarray(pixels).save(root / name / f"{k}.{'png' if k % 2 else 'jpg'}")
    if bad:
        (root / "dog" / bad).write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")


def test_npy_files_are_memory_mapped_and_named_by_their_stem(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    np.save(tmp_path / "y.npy", np.arange(6, dtype=np.int32))
    records = open_npy([str(tmp_path / "x.npy"), str(tmp_path / "y.npy")])
    assert isinstance(records.arrays["x"], np.memmap)
    assert len(records) == 6
    assert records.fields() == {"x": Field("float32", (2,)), "y": Field("int32", ())}
    assert records.record(4)["x"].tolist() == [8.0, 9.0]
    assert records.take([5, 0])["y"].tolist() == [5, 0]


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"x.npy": np.zeros(3), "y.npy": np.zeros(4)}, "arrays of different lengths"),
        ({"x.npy": np.array([{"a": 1}], dtype=object)}, "not a .npy array that can be mapped"),
        ({"x.npy": np.array(["a", "b"])}, "not a dtype the feed carries"),
    ],
)
def test_npy_files_that_cannot_be_records_are_refused_in_one_line(tmp_path, files, match):
    for name, array in files.items():
        np.save(tmp_path / name, array, allow_pickle=True)
    with pytest.raises(ConfigError, match=match):
        open_npy([str(tmp_path / n) for n in files])
    with pytest.raises(ConfigError, match=r"npy:.*missing.npy: no such file"):
        open_npy([str(tmp_path / "missing.npy")])


def test_an_uncompressed_npz_is_mapped_member_by_member(tmp_path):
    x = np.arange(24, dtype=np.float64).reshape(4, 3, 2)
    np.savez(tmp_path / "d.npz", x=x, y=np.asfortranarray(np.arange(8).reshape(4, 2)))
    records = open_npz(str(tmp_path / "d.npz"))
    assert all(isinstance(a, np.memmap) for a in records.arrays.values())
    assert np.array_equal(records.arrays["x"], x)
    assert records.record(2)["y"].tolist() == [4, 5]


def test_a_compressed_npz_is_refused_saying_what_to_do(tmp_path):
    np.savez_compressed(tmp_path / "c.npz", x=np.zeros(4))
    with pytest.raises(ConfigError) as info:
        open_npz(str(tmp_path / "c.npz"))
    assert "member x.npy is compressed (np.savez_compressed) and cannot be memory-mapped" in str(
        info.value
    )
    assert "np.savez (uncompressed) or as .npy files" in str(info.value)
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    with pytest.raises(ConfigError, match="no arrays in it"):
        open_npz(str(tmp_path / "empty.npz"))


def test_in_memory_arrays_are_records():
    records = ArrayRecords({"a": np.eye(3, dtype=np.float32), "b": np.arange(3)})
    assert records.record(1)["a"].tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="different lengths"):
        ArrayRecords({"a": np.zeros(3), "b": np.zeros(2)})


def test_an_image_folder_has_classes_labels_and_decodes_to_one_size(tmp_path):
    make_images(tmp_path, size=(12, 16))
    Image.fromarray(np.zeros((30, 20, 3), np.uint8)).save(tmp_path / "cat" / "big.png")
    records = ImageFolder(str(tmp_path))
    assert records.classes == ["cat", "dog"] and len(records) == 7
    assert records.fields()["images"] == Field("uint8", (12, 16, 3), cast="float32",
                                               scale=1 / 255)  # fmt: skip
    assert records.fields()["labels"] == Field("int32", (), bounds=(0, 2))
    labels = [int(records.record(i)["labels"]) for i in range(7)]
    assert labels == [0, 0, 0, 0, 1, 1, 1]
    assert records.record(3)["images"].shape == (12, 16, 3)  # big.png resized
    assert records.decoder == "simplejpeg"  # installed with the dev extras


def test_a_corrupt_image_is_a_bad_record_naming_the_file(tmp_path):
    make_images(tmp_path, bad="broken.jpg")
    records = ImageFolder(str(tmp_path))
    index = records.paths.index(str(tmp_path / "dog" / "broken.jpg"))
    with pytest.raises(BadRecord, match=rf"dog/broken.jpg \(record {index}\): not a decodable"):
        records.record(index)


def test_a_missing_or_empty_image_folder_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"images:.*nothere: no such folder"):
        ImageFolder(str(tmp_path / "nothere"))
    (tmp_path / "cat").mkdir()
    with pytest.raises(ConfigError, match=r"no images .* in class folders \(1 folders\)"):
        ImageFolder(str(tmp_path))


def write_parquet(path, rows: int = 10, bad_row: int | None = None, row_group_size: int = 4):
    """``x``: list<float32>[3] (row ``bad_row`` of length 2), ``y``: int64 = row, ``s``: text."""
    x = [[float(r)] * (2 if r == bad_row else 3) for r in range(rows)]
    table = pa.table({
        "x": pa.array(x, pa.list_(pa.float32())),
        "y": pa.array(range(rows), pa.int64()),
        "s": [str(r) for r in range(rows)],
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=row_group_size)


def test_parquet_rows_are_read_by_row_group_and_text_columns_left_out(tmp_path, caplog):
    write_parquet(tmp_path / "a.parquet", rows=10)
    write_parquet(tmp_path / "b.parquet", rows=5)
    with caplog.at_level("INFO"):
        records = ParquetRecords([str(tmp_path)])  # a folder: its files, sorted
    assert "columns not carried (not numbers or lists of numbers): s (string)" in caplog.text
    assert len(records) == 15
    assert records.fields() == {"x": Field("float32", (3,)), "y": Field("int64", ())}
    assert records.record(11)["y"] == 1 and records.record(11)["x"].tolist() == [1.0] * 3
    assert len(records._cache) == 1  # one row group read, not the files


def test_a_bad_parquet_row_is_a_bad_record_naming_file_row_group_and_row(tmp_path):
    write_parquet(tmp_path / "a.parquet", rows=10, bad_row=6)
    records = ParquetRecords([str(tmp_path / "a.parquet")])
    with pytest.raises(BadRecord) as info:
        records.record(6)
    assert str(info.value) == (
        f"{tmp_path / 'a.parquet'} row group 1 row 2 (record 6): column 'x': 2 values, expected 3"
    )
    assert records.record(7)["y"] == 7


def test_a_missing_parquet_path_or_column_is_refused_at_start(tmp_path):
    from stagefeed.common.schema import ArraySpec, Schema

    with pytest.raises(ConfigError, match=r"nothere.parquet: no such file or folder"):
        ParquetRecords([str(tmp_path / "nothere.parquet")])
    write_parquet(tmp_path / "a.parquet")
    records = ParquetRecords([str(tmp_path / "a.parquet")])
    with pytest.raises(ConfigError, match=r"'z' is not a column of"):
        records.fit(Schema((ArraySpec("z", "float32"),), 2))
    with pytest.raises(ConfigError, match=r"'s' is string, not numbers"):
        records.fit(Schema((ArraySpec("s", "float32"),), 2))


def test_a_hugging_face_dataset_is_records():
    from stagefeed.producer.data.hf import HFRecords
    from tests.helpers import hf_packages

    datasets = hf_packages.use()

    ds = datasets.Dataset.from_dict(
        {"x": np.arange(10, dtype=np.float32).reshape(5, 2), "y": np.arange(5), "t": list("abcde")}
    )
    records = HFRecords(ds)
    assert len(records) == 5
    assert records.fields() == {"x": Field("float32", (2,)), "y": Field("int64", ())}
    assert records.record(3)["x"].tolist() == [6.0, 7.0]
    assert records.record(3)["t"] == "d"  # a transform sees every column


def test_the_schema_derived_through_a_transform_keeps_the_readers_bounds_and_cast(tmp_path):
    from stagefeed.common.data_ref import parse_data_ref
    from stagefeed.producer.data.derive import derive_schema

    make_images(tmp_path, size=(12, 16))
    ref = parse_data_ref(f"images:{tmp_path}")
    schema = derive_schema(ref, 4, seed=1, transform="tests.helpers.data_transforms:crop")
    images, labels = schema.arrays
    assert (images.dtype, images.shape, images.cast, images.scale) == (
        "uint8", (8, 8, 3), "float32", 1 / 255
    )
    assert (labels.dtype, labels.bounds) == ("int32", (0, 2))
    assert derive_schema(ref, 4, image_size=(20, 20)).arrays[0].shape == (20, 20, 3)
