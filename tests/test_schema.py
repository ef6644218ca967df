"""Schemas: written once (Python, JSON, TOML, module:NAME), validated, errors naming the value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import (
    DEFAULT_SCHEMA,
    ArraySpec,
    Schema,
    SchemaMismatch,
    check_arrays,
    image_schema,
    load_schema,
    schema_difference,
)

THREE = Schema(
    (
        ArraySpec("features", "float32", (32,)),
        ArraySpec("ids", "int64", (20,), bounds=(0, 1000)),
        ArraySpec("targets", "float32"),
    ),
    batch_size=8,
)


def test_default_is_the_seeds_alexnet_input():
    assert DEFAULT_SCHEMA.names == ("images", "labels")
    assert DEFAULT_SCHEMA.batch_shape(DEFAULT_SCHEMA["images"]) == (256, 227, 227, 3)
    assert DEFAULT_SCHEMA.batch_bytes == 256 * 227 * 227 * 3 * 4 + 256 * 4
    assert DEFAULT_SCHEMA["labels"].bounds == (0, 1000)
    uint8 = image_schema(dtype="uint8")
    assert uint8["images"].cast == "float32" and uint8.wire_dtype == "uint8"


def test_three_array_schema_round_trips_through_its_dict_form():
    assert Schema.from_dict(THREE.to_dict()) == THREE
    assert THREE.describe().startswith("features float32[8,32], ids int64[8,20] in [0,1000)")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"name": "bad name"}, "bad name"),
        ({"name": "x" * 65}, "at most 64"),
        ({"dtype": "object"}, "object"),
        ({"dtype": "complex64"}, "complex64"),
        ({"shape": (0,)}, "shape"),
        ({"shape": (1,) * 9}, "shape"),
        ({"dtype": "float32", "bounds": (0, 10)}, "integer dtype"),
        ({"dtype": "uint8", "bounds": (0, 300)}, "do not fit"),
        ({"dtype": "int32", "bounds": (5, 5)}, "low < high"),
        ({"cast": "int8"}, "cast"),
        ({"dtype": "int32", "scale": 0.5}, "float dtype or a cast"),
    ],
)
def test_bad_array_spec_names_the_value(kwargs, named):
    fields = {"name": "x", "dtype": "uint8"} | kwargs
    with pytest.raises(ConfigError, match=named):
        ArraySpec(**fields)


def test_duplicate_names_and_empty_schemas_are_refused():
    with pytest.raises(ConfigError, match="x repeated"):
        Schema((ArraySpec("x", "uint8"), ArraySpec("x", "int8")), 2)
    with pytest.raises(ConfigError, match="1 to 16"):
        Schema((), 2)
    with pytest.raises(ConfigError, match="batch_size"):
        Schema((ArraySpec("x", "uint8"),), 0)


def test_json_and_toml_files_and_module_refs(tmp_path, monkeypatch):
    (tmp_path / "s.json").write_text(json.dumps(THREE.to_dict()))
    (tmp_path / "s.toml").write_text(
        'batch_size = 8\n'
        '[[arrays]]\nname = "features"\ndtype = "float32"\nshape = [32]\n'
        '[[arrays]]\nname = "ids"\ndtype = "int64"\nshape = [20]\nbounds = [0, 1000]\n'
        '[[arrays]]\nname = "targets"\ndtype = "float32"\n'
    )
    (tmp_path / "myschemas.py").write_text(
        "from stagefeed.common.schema import ArraySpec, Schema\n"
        "S = Schema((ArraySpec('x', 'uint8', (2,)),), 4)\n"
    )
    assert load_schema(str(tmp_path / "s.json")) == THREE
    assert load_schema(str(tmp_path / "s.toml")) == THREE
    monkeypatch.chdir(tmp_path)
    assert load_schema("myschemas:S").names == ("x",)


@pytest.mark.parametrize(
    ("ref", "named"),
    [
        ("/nonexistent/s.json", "No such file"),
        ("nomodule_here:S", "cannot be imported"),
        ("json:nothing", "has no 'nothing'"),
        ("json:__name__", "is a str, not a Schema"),
        ("json:dumps", "raised TypeError"),
        ("neither", "neither"),
    ],
)
def test_bad_schema_refs_fail_in_one_line(ref, named):
    with pytest.raises(ConfigError, match=named) as info:
        load_schema(ref)
    assert "\n" not in str(info.value)


def test_untrusted_dicts_fail_with_bounded_messages():
    deep: list = []
    for _ in range(900):
        deep = [deep]
    for bad in ({"batch_size": 2, "arrays": deep}, {"arrays": [{"name": deep}], "batch_size": 2},
                {"batch_size": 2, "arrays": [], "extra": 1}, [1, 2]):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            Schema.from_dict(bad)
        assert len(str(info.value)) < 400


def test_check_arrays_names_the_array_expected_and_actual():
    good = {
        "features": np.zeros((8, 32), np.float32),
        "ids": np.zeros((8, 20), np.int64),
        "targets": np.zeros(8, np.float32),
    }
    check_arrays(THREE, good, "batch 0")
    with pytest.raises(SchemaMismatch, match=r"ids is int32\[8, 20\], expected int64\[8, 20\]"):
        check_arrays(THREE, good | {"ids": np.zeros((8, 20), np.int32)}, "batch 0")
    with pytest.raises(SchemaMismatch, match="missing targets"):
        check_arrays(THREE, {k: v for k, v in good.items() if k != "targets"}, "batch 0")
    with pytest.raises(SchemaMismatch, match=r"ids values span \[1000, 1000\]"):
        check_arrays(THREE, good | {"ids": np.full((8, 20), 1000, np.int64)}, "batch 0")


def test_schema_difference_names_the_first_differing_array():
    trainer, producer = image_schema(batch_size=2, dtype="uint8"), image_schema(batch_size=2)
    assert schema_difference(trainer, producer) == (
        "images: the trainer expects uint8[2,227,227,3] cast to float32, "
        "the producer declared float32[2,227,227,3]"
    )
