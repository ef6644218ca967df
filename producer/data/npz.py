"""Records from an ``.npz`` file, each member memory-mapped.

numpy cannot map an ``.npz`` (``np.load(mmap_mode="r")`` reads it whole), but ``np.savez``
*stores* its members uncompressed: each is a ``.npy`` at an offset of the zip file. Here the
zip's local header gives that offset, the ``.npy`` header there gives dtype, shape and order,
and ``np.memmap`` maps the data that follows. A compressed member (``np.savez_compressed``)
has no such bytes to map: it is refused at start in one line saying to save with
``np.savez`` or as ``.npy`` files.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Literal

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.producer.data.arrays import ArrayRecords

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip's local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


def open_npz(path: str) -> ArrayRecords:
    """The members of the ``.npz`` at ``path`` as records (``x.npy`` is the field ``x``)."""
    if not os.path.isfile(path):
        raise ConfigError(f"npz:{path}: no such file")
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if m.filename.endswith(".npy")]
    except (OSError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"npz:{path}: not an .npz file: {exc}") from None
    if not members:
        raise ConfigError(f"npz:{path}: no arrays in it")
    arrays = {m.filename[: -len(".npy")]: _map_member(path, m) for m in members}
    return ArrayRecords(arrays, f"npz:{path}")


def _map_member(path: str, member: zipfile.ZipInfo) -> np.memmap:
    name = member.filename
    if member.compress_type != zipfile.ZIP_STORED:
        raise ConfigError(
            f"npz:{path}: member {name} is compressed (np.savez_compressed) and cannot be "
            "memory-mapped: save it with np.savez (uncompressed) or as .npy files (npy:PATH)"
        )
    with open(path, "rb") as f:
        f.seek(member.header_offset)
        fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        if fields[0] != _LOCAL_MAGIC:
            raise ConfigError(f"npz:{path}: member {name}: no local zip header at its offset")
        name_len, extra_len = fields[-2], fields[-1]
        f.seek(member.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as exc:
            raise ConfigError(f"npz:{path}: member {name} is not a .npy array: {exc}") from None
        offset = f.tell()
    if dtype.hasobject:
        raise ConfigError(f"npz:{path}: member {name} holds Python objects: not mapped")
    order: Literal["F", "C"] = "F" if fortran else "C"
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
