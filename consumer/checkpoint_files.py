"""Is a checkpoint's model whole? File-level checks made at start, before TensorFlow loads.

A state file names its model (``model_path``, beside it) and the files that model is made of
(``model_files``). ``problem`` says what is wrong with them, in a few words, or None:

- a name that is not a plain file name beside the state file (``..``, a folder, empty);
- ``model_path``'s own files not among ``model_files``, or a file missing or not a regular
  file;
- a file cut short: a ``.keras`` model is a zip archive, whose directory is at its end; a
  ``tf.compat.v1.train.Saver`` index (``PREFIX.index``) is a TensorFlow table, whose last 8
  bytes are its magic number.

What these checks cannot see (a data file damaged inside) fails at restore, in one line.
Reading a state file itself (``read_state``): a regular file (a FIFO or a device is refused
without blocking on it), at most ``MAX_STATE_BYTES``, a JSON object of format ``"version"``
``STATE_VERSION`` (a file without one, written by stagefeed 0.2.0 and before, is version 1;
another version is refused). Writing one (``write_state``): a temporary file, fsynced, renamed
over the state file, then its directory fsynced, so the rename survives a host crash, not only
a kill of the writer (a finished producer leaves once it is told ``saved``). No TensorFlow
here.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import zipfile
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.excerpt import excerpt

STATE_VERSION = 1  # the state file's format; a file without "version" is version 1
MAX_STATE_BYTES = 64 * 1024 * 1024
TABLE_MAGIC = 0xDB4775248B80FB57  # TensorFlow's table footer (tensorflow/core/lib/io/format.h)
KERAS_MEMBER = "config.json"  # in every .keras archive, beside the weights


def read_state(path: str) -> dict[str, Any]:
    """The JSON object in the state file ``path``; ``ConfigError`` naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint state {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"checkpoint state {path} is not a regular file "
                              f"({stat.filemode(info.st_mode)})")  # fmt: skip
        if info.st_size > MAX_STATE_BYTES:
            raise ConfigError(f"checkpoint state {path} is {info.st_size} bytes, over the "
                              f"{MAX_STATE_BYTES} a state file may be")  # fmt: skip
        try:
            data = f.read(MAX_STATE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read checkpoint state {path}: {exc.strerror}") from None
    try:
        state = json.loads(data)
    except RecursionError:
        raise ConfigError(f"checkpoint state {path} is nested too deeply to be one") from None
    except ValueError as exc:
        raise ConfigError(f"cannot read checkpoint state {path}: {exc}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint state {path} is not a JSON object")
    version = state.get("version", STATE_VERSION)  # none: written before versions (1)
    if type(version) is not int or version != STATE_VERSION:
        raise ConfigError(
            f"checkpoint state {path} has format version {excerpt(version, 40)}; this stagefeed "
            f"reads version {STATE_VERSION} (a newer stagefeed wrote it?): pass --fresh to "
            "start over, or resume it with the stagefeed that wrote it"
        )
    return state


def write_state(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` as the state file ``path``, with its format ``version``: ``path`` is
    either the old file or the whole new one, whatever kills the writer or the host."""
    folder = os.path.dirname(path) or "."
    fd, scratch = tempfile.mkstemp(prefix=".state-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": STATE_VERSION, **state}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        if os.path.exists(scratch):
            os.unlink(scratch)
        raise
    _fsync_directory(folder)


def _fsync_directory(folder: str) -> None:
    """The directory's entries on disk: a rename into it survives a host crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(folder: str, state: dict[str, Any]) -> str | None:
    """What keeps the model named by ``state`` (a state file in ``folder``) from being
    restored, or None if its files look whole (see the module docstring)."""
    model_path, files = state.get("model_path"), state.get("model_files")
    if not _plain(model_path):
        return f"model_path {str(model_path)[:80]!r} is not a file name beside the state file"
    if not isinstance(files, list) or not files or not all(_plain(f) for f in files):
        return f"model_files {str(files)[:80]} is not a list of file names beside it"
    own = [f for f in files if f == model_path or f.startswith(model_path + ".")]
    if not own:
        return f"model_files do not hold model_path {model_path!r}"
    for name in files:
        try:
            info = os.stat(os.path.join(folder, name))
        except OSError:
            return f"{name} missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
    index = model_path + ".index"
    if model_path.endswith(".keras"):
        return _keras_problem(os.path.join(folder, model_path))
    if index in files:
        return _table_problem(os.path.join(folder, index))
    return None


def _plain(name: Any) -> bool:
    return (
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
        and "\0" not in name and os.sep not in name
    )  # fmt: skip


def _keras_problem(path: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{os.path.basename(path)} is cut short or damaged ({exc})"
    if KERAS_MEMBER not in names:
        return f"{os.path.basename(path)} holds no {KERAS_MEMBER}: not a .keras model"
    return None


def _table_problem(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8))
            tail = f.read(8)
    except OSError as exc:
        return f"{os.path.basename(path)} cannot be read ({exc.strerror})"
    if len(tail) < 8 or struct.unpack("<Q", tail)[0] != TABLE_MAGIC:
        return f"{os.path.basename(path)} is cut short or damaged (no table footer)"
    return None
