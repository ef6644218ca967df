"""Output paths are checked by creating them: what fails names the flag and the path."""

from __future__ import annotations

import os

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.paths import check_writable_dir, check_writable_file


def test_a_new_file_is_created_then_removed(tmp_path):
    path = tmp_path / "summary.json"
    assert check_writable_file("--json", str(path)) == str(path)
    assert not path.exists()  # a run that ends before writing leaves nothing


def test_an_existing_file_is_left_as_it_was(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{}\n")
    before = path.stat()
    check_writable_file("--json", str(path))
    assert path.read_text() == "{}\n"
    assert path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/proc/x.json", "cannot be written"),
        ("{tmp}/missing/summary.json", "cannot be written: No such file or directory"),
        ("{tmp}", "is a directory"),
        ("{tmp}/plain/summary.json", "cannot be written: Not a directory"),
        ("  ", "must name a file"),
    ],
)
def test_an_unwritable_file_is_refused_naming_flag_and_path(tmp_path, path, why):
    (tmp_path / "plain").write_text("")
    path = path.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=why) as raised:
        check_writable_file("--json", path)
    assert str(raised.value).startswith(f"--json {path!r}") or "must name" in why


def test_a_directory_is_created_with_its_parents_and_probed(tmp_path):
    path = tmp_path / "runs" / "today" / "logs"
    assert check_writable_dir("--logdir", str(path)) == str(path)
    assert path.is_dir()
    assert os.listdir(path) == []  # the probe file is gone
    check_writable_dir("--logdir", str(path))  # an existing directory is fine


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/proc/stagefeed-logs", "is not a writable directory"),
        ("{tmp}/plain", "is not a writable directory: File exists"),
        ("{tmp}/plain/logs", "is not a writable directory: Not a directory"),
        ("", "must name a directory"),
    ],
)
def test_an_unwritable_directory_is_refused_naming_flag_and_path(tmp_path, path, why):
    (tmp_path / "plain").write_text("")
    path = path.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=why) as raised:
        check_writable_dir("--logdir", path)
    assert str(raised.value).startswith(f"--logdir {path!r}") or "must name" in why
