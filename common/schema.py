"""What a batch is: a schema of named arrays, the contract between producers and the trainer.

A ``Schema`` is a batch size and an ordered tuple of ``ArraySpec``: a name, a dtype from the
wire allow-list, a per-example shape (the batch dimension is added in front), and optionally
integer ``bounds`` (values in ``[low, high)``) and a device-side ``cast`` / ``scale`` (uint8 on
the wire, float32 in the model). Everything downstream derives from it: placeholders, queue
components and byte budget, staging, decode checks, the books.

Written once: in Python, in a JSON or TOML file (``--schema FILE``), or as ``module:NAME``. The
same ``to_dict`` form travels in the trainer's welcome message, so a producer started without
batch flags uses the trainer's schema. ``from_dict`` treats its input as untrusted: every field
is type-checked, and errors never ``repr`` the input whole.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.refs import import_ref

# Dtypes an array may have, by name. Object, void, structured and string dtypes are absent on
# purpose: decoding them could execute or allocate arbitrarily. Little-endian on the wire.
DTYPES: dict[str, str] = {
    "bool": "|b1",
    "uint8": "|u1",
    "int8": "|i1",
    "uint16": "<u2",
    "int16": "<i2",
    "uint32": "<u4",
    "int32": "<i4",
    "uint64": "<u8",
    "int64": "<i8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
}
ALLOWED_DTYPES: frozenset[str] = frozenset(DTYPES.values())
CASTS = ("float16", "float32", "float64")
MAX_ARRAYS = 16
MAX_NDIM = 8  # per example; the batch dimension comes on top
MAX_DIM = 2**31 - 1
MAX_NAME_LEN = 64
MAX_BATCH_SIZE = 2**20
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One named array of a batch. ``shape`` is per example: the batch's shape is (B, *shape).

    ``bounds=(low, high)`` (integer dtypes only): every value must lie in ``[low, high)``;
    a batch outside is dropped as ``value_range``. ``cast`` (a float dtype) and ``scale``: the
    trainer casts on the training device, then multiplies (``uint8`` images with
    ``cast="float32", scale=1/255`` move a quarter of the bytes of float32 ones).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    bounds: tuple[int, int] | None = None
    cast: str | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"array name {excerpt(self.name)} must match {_NAME.pattern} "
                f"(at most {MAX_NAME_LEN} characters)"
            )
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(
                f"array {self.name!r}: dtype {excerpt(self.dtype)} is not one of "
                f"{', '.join(DTYPES)}"
            )
        shape = self.shape
        if isinstance(shape, list):
            object.__setattr__(self, "shape", tuple(shape))
            shape = self.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) > MAX_NDIM
            or not all(_is_int(d) and 0 < d <= MAX_DIM for d in shape)
        ):
            raise ConfigError(
                f"array {self.name!r}: shape {excerpt(shape)} must be a list of at most "
                f"{MAX_NDIM} positive integers (per example, without the batch dimension)"
            )
        if self.bounds is not None:
            self._check_bounds()
        if self.cast is not None and self.cast not in CASTS:
            raise ConfigError(
                f"array {self.name!r}: cast {excerpt(self.cast)} must be one of {', '.join(CASTS)}"
            )
        if self.scale is not None:
            ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
            if not ok or not math.isfinite(self.scale):
                raise ConfigError(f"array {self.name!r}: scale {excerpt(self.scale)} is not finite")
            if self.cast is None and self.dtype not in CASTS:
                raise ConfigError(f"array {self.name!r}: scale needs a float dtype or a cast")

    def _check_bounds(self) -> None:
        bounds = self.bounds
        if isinstance(bounds, list):
            object.__setattr__(self, "bounds", tuple(bounds))
            bounds = self.bounds
        if np.dtype(self.dtype).kind not in "iu":
            raise ConfigError(
                f"array {self.name!r}: bounds need an integer dtype, not {self.dtype}"
            )
        if not (
            isinstance(bounds, tuple) and len(bounds) == 2 and all(_is_int(b) for b in bounds)
        ) or not bounds[0] < bounds[1]:
            raise ConfigError(
                f"array {self.name!r}: bounds {excerpt(bounds)} must be [low, high) with low < high"
            )
        info = np.iinfo(np.dtype(self.dtype))
        # msgpack carries integers in [-2**63, 2**64): a schema must travel in a welcome.
        if bounds[0] < info.min or bounds[1] - 1 > info.max or bounds[1] >= 2**64:
            raise ConfigError(
                f"array {self.name!r}: bounds {list(bounds)} do not fit {self.dtype}"
            )

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.bounds is not None:
            out["bounds"] = list(self.bounds)
        if self.cast is not None:
            out["cast"] = self.cast
        if self.scale is not None:
            out["scale"] = self.scale
        return out


@dataclasses.dataclass(frozen=True)
class Schema:
    """A batch: ``batch_size`` examples of each array in ``arrays`` (wire order)."""

    arrays: tuple[ArraySpec, ...]
    batch_size: int

    def __post_init__(self) -> None:
        if isinstance(self.arrays, list):
            object.__setattr__(self, "arrays", tuple(self.arrays))
        if not _is_int(self.batch_size) or not 0 < self.batch_size <= MAX_BATCH_SIZE:
            raise ConfigError(
                f"batch_size must be an integer in [1, {MAX_BATCH_SIZE}], "
                f"got {excerpt(self.batch_size)}"
            )
        if not isinstance(self.arrays, tuple) or not 0 < len(self.arrays) <= MAX_ARRAYS:
            raise ConfigError(f"a schema has 1 to {MAX_ARRAYS} arrays, got {excerpt(self.arrays)}")
        if not all(isinstance(a, ArraySpec) for a in self.arrays):
            raise ConfigError("schema arrays must be ArraySpec instances")
        names = [a.name for a in self.arrays]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"array names must be unique, {', '.join(twice)} repeated")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arrays)

    def __getitem__(self, name: str) -> ArraySpec:
        for spec in self.arrays:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def batch_shape(self, spec: ArraySpec) -> tuple[int, ...]:
        return (self.batch_size, *spec.shape)

    def wire(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        """(name, numpy dtype, full batch shape) of each array, in wire order."""
        return [(a.name, a.np_dtype, self.batch_shape(a)) for a in self.arrays]

    def array_bytes(self, spec: ArraySpec) -> int:
        return spec.np_dtype.itemsize * math.prod(self.batch_shape(spec))

    @property
    def batch_bytes(self) -> int:
        """Payload bytes of one batch (all arrays), headers excluded."""
        return sum(self.array_bytes(a) for a in self.arrays)

    @property
    def largest_array_bytes(self) -> int:
        """Bytes of the batch's largest array: the largest block one batch needs."""
        return max(self.array_bytes(a) for a in self.arrays)

    @property
    def wire_dtype(self) -> str:
        """The dtype of the array that takes most bytes on the wire (what advice talks about)."""
        return max(self.arrays, key=self.array_bytes).dtype

    def describe(self) -> str:
        """One line: ``images uint8[256,227,227,3], labels int32[256] in [0,1000)``."""
        parts = []
        for a in self.arrays:
            text = f"{a.name} {a.dtype}{list(self.batch_shape(a))}".replace(" ", "")
            text = text.replace(a.name, a.name + " ", 1)
            if a.bounds is not None:
                text += f" in [{a.bounds[0]},{a.bounds[1]})"
            parts.append(text)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "arrays": [a.to_dict() for a in self.arrays]}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "schema") -> Schema:
        """Build from the ``to_dict`` form (a file, a welcome message): ``ConfigError`` if bad."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a table/map, got {excerpt(data)}")
        unknown = set(data) - {"batch_size", "arrays"}
        if unknown:
            raise ConfigError(f"{source}: unknown keys {sorted(map(excerpt, unknown))}")
        arrays = data.get("arrays")
        if not isinstance(arrays, list) or not 0 < len(arrays) <= MAX_ARRAYS:
            raise ConfigError(f"{source}: 'arrays' must list 1 to {MAX_ARRAYS} arrays")
        specs = []
        fields = {f.name for f in dataclasses.fields(ArraySpec)}
        for entry in arrays:
            if not isinstance(entry, Mapping) or not {"name", "dtype"} <= set(entry) <= fields:
                raise ConfigError(
                    f"{source}: each array is a table with keys among {sorted(fields)}, "
                    f"got {excerpt(entry)}"
                )
            try:
                specs.append(ArraySpec(**entry))
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None
        batch_size: Any = data.get("batch_size")  # as read: the constructor checks it
        try:
            return cls(tuple(specs), batch_size)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def with_batch_size(self, batch_size: int) -> Schema:
        return dataclasses.replace(self, batch_size=batch_size)


def schema_difference(expected: Schema, actual: Schema) -> str:
    """One line naming the first difference: what the trainer expects and what was declared."""
    if expected.names != actual.names:
        return f"arrays {list(actual.names)}, the trainer expects {list(expected.names)}"
    for want, got in zip(expected.arrays, actual.arrays, strict=True):
        if want != got or expected.batch_size != actual.batch_size:
            return (
                f"{want.name}: the trainer expects {_one(expected, want)}, "
                f"the producer declared {_one(actual, got)}"
            )
    return "schemas differ"


def _one(schema: Schema, spec: ArraySpec) -> str:
    text = f"{spec.dtype}{list(schema.batch_shape(spec))}".replace(" ", "")
    if spec.bounds is not None:
        text += f" in [{spec.bounds[0]}, {spec.bounds[1]})"
    if spec.cast is not None:
        text += f" cast to {spec.cast}"
    return text


class SchemaMismatch(ConfigError):
    """Arrays that do not match a schema; the message names the array, expected and actual."""


def check_arrays(schema: Schema, arrays: Mapping[str, Any], what: str) -> None:
    """Raise ``SchemaMismatch`` unless ``arrays`` has exactly the schema's names, dtypes, shapes
    and values within bounds. ``what`` names the batch in the message (``source 'x' batch 0``).
    """
    if not isinstance(arrays, Mapping):
        raise SchemaMismatch(f"{what}: expected a dict of arrays, got {type(arrays).__name__}")
    if set(arrays) != set(schema.names):
        missing = [n for n in schema.names if n not in arrays]
        extra = sorted(str(n) for n in arrays if n not in schema.names)
        raise SchemaMismatch(
            f"{what}: arrays {sorted(map(str, arrays))}, expected {list(schema.names)}"
            + (f" (missing {', '.join(missing)})" if missing else "")
            + (f" (unexpected {', '.join(extra)})" if extra else "")
        )
    for spec in schema.arrays:
        array = arrays[spec.name]
        if not isinstance(array, np.ndarray):
            raise SchemaMismatch(f"{what}: {spec.name} is a {type(array).__name__}, not an ndarray")
        expected = schema.batch_shape(spec)
        if array.dtype != spec.np_dtype or array.shape != expected:
            raise SchemaMismatch(
                f"{what}: {spec.name} is {array.dtype}{list(array.shape)}, "
                f"expected {spec.dtype}{list(expected)}"
            )
        problem = bounds_problem(spec, array)
        if problem:
            raise SchemaMismatch(f"{what}: {problem}")


def bounds_problem(spec: ArraySpec, array: np.ndarray) -> str | None:
    """None if ``array``'s values respect ``spec.bounds``; else a line saying how not."""
    if spec.bounds is None or array.size == 0:
        return None
    low, high = int(array.min()), int(array.max())
    if low < spec.bounds[0] or high >= spec.bounds[1]:
        return (
            f"{spec.name} values span [{low}, {high}], allowed [{spec.bounds[0]}, {spec.bounds[1]})"
        )
    return None


def image_schema(
    batch_size: int = 256,
    image_size: int = 227,
    dtype: str = "float32",
    num_classes: int = 1000,
    channels: int = 3,
) -> Schema:
    """The seed's AlexNet input, the default: ``images`` (B, H, W, C) and int32 ``labels``.

    ``dtype="uint8"`` moves a quarter of the bytes; the images are cast and scaled on device.
    """
    if dtype not in ("float32", "uint8"):
        raise ConfigError(f"image dtype must be float32 or uint8, got {dtype!r}")
    if not _is_int(num_classes) or not 0 < num_classes <= np.iinfo(np.int32).max:
        raise ConfigError(f"num_classes must be a positive int32, got {excerpt(num_classes)}")
    shape = (image_size, image_size, channels)
    if dtype == "uint8":
        images = ArraySpec("images", dtype, shape, cast="float32", scale=1.0 / 255.0)
    else:
        images = ArraySpec("images", dtype, shape)
    return Schema((images, ArraySpec("labels", "int32", (), bounds=(0, num_classes))), batch_size)


DEFAULT_SCHEMA = image_schema()


def load_schema(ref: str) -> Schema:
    """``--schema``: a ``.json`` / ``.toml`` file, or ``module:NAME`` (a ``Schema`` or a function
    returning one), imported from the current directory as ``python -m`` would.
    """
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"--schema must be a file or module:NAME, got {excerpt(ref)}")
    if ref.endswith((".json", ".toml")) or os.path.sep in ref:
        return _load_file(ref)
    if re.fullmatch(r"[\w.]+:\w+", ref):
        value = import_ref(ref, "--schema")
        if callable(value) and not isinstance(value, Schema):
            try:
                value = value()
            except Exception as exc:  # noqa: BLE001 - user code may raise anything
                raise ConfigError(
                    f"--schema {ref!r} raised {type(exc).__name__}: {str(exc)[:200]}"
                ) from None
        if not isinstance(value, Schema):
            raise ConfigError(f"--schema {ref!r} is a {type(value).__name__}, not a Schema")
        return value
    raise ConfigError(f"--schema {ref!r} is neither a .json/.toml file nor module:NAME")


def _load_file(path: str) -> Schema:
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
        data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    except OSError as exc:
        raise ConfigError(f"--schema {path!r}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        kind = path.rsplit(".", 1)[-1]
        raise ConfigError(f"--schema {path!r} is not valid {kind}: {exc}") from None
    return Schema.from_dict(data, source=f"--schema {path!r}")
