"""``stagefeed bench input`` (bench/input*.py): every mode runs for real at tiny sizes through the
CLI and its figures and ratios add up; a bad flag stops it at start in one line, exit 2.

No speed is asserted: only that each figure exists, is positive and finite, and that every
ratio is computed from the figures beside it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import pytest

from stagefeed.bench.input_config import INPUT_MODES, InputConfig
from stagefeed.bench.input_stagefeed import window_cpu
from stagefeed.common.errors import ConfigError
from tests.conftest import cli_env, run_cli

TINY = ["--images", "32", "--image-size", "64", "--crop", "48", "--batch-size", "8",
        "--producers", "1", "--steps", "40", "--warmup-steps", "2"]  # fmt: skip


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_every_mode_of_a_tiny_run_has_its_figures_and_ratios_from_them(tmp_path):
    """One run of every mode (32 JPEGs of 64x64, crop 48, batch 8, one producer): a row per
    measurement with images/s, its ideal (N x the ideal's mean of its two runs; tf.data: the
    host's cores), the ratio of the two, CPU per image; stagefeed's lead over each peer and
    the targets from those figures; the table printed; the temporary folder removed."""
    path = tmp_path / "input.json"
    # Its own TMPDIR, to see what is left there; short, since run's sockets go in it too (a
    # Unix socket's path has at most 107 bytes, which tmp_path under xdist nearly fills).
    scratch = tempfile.mkdtemp(prefix="sf-bi-")
    try:
        env = cli_env(TMPDIR=scratch)
        done = run_cli(["bench", "input", *TINY, "--json", str(path)], timeout=240, env=env)
        # TensorFlow's autograph leaves its generated modules there: only ours are checked.
        left = [name for name in os.listdir(scratch) if name.startswith("stagefeed-")]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr
    assert left == [], left
    report = json.loads(path.read_text())
    assert report["settings"]["modes"] == list(INPUT_MODES)
    cores = report["machine"]["cpus"]

    ideal = report["ideal"]
    assert len(ideal["runs_images_per_s"]) == 2  # before and after the other modes
    assert all(_positive(r) for r in ideal["runs_images_per_s"])
    # Both the mean and its parts are rounded to 0.1: they may differ by that much.
    assert ideal["images_per_s"] == pytest.approx(sum(ideal["runs_images_per_s"]) / 2, abs=0.11)
    assert _positive(ideal["core_ms_per_image"])
    assert ideal["decoder"] in ("simplejpeg", "Pillow")

    rows = {(r["mode"], r["transport"], r["workers"]): r for r in report["rows"]}
    assert list(rows) == [
        ("stagefeed", "shm", 1),
        ("stagefeed", "tcp", 1),
        ("tf.data", "", 0),
        ("from_generator", "", 1),
        ("pydataset", "", 1),
    ]
    for key, row in rows.items():
        assert _positive(row["images_per_s"]), key
        # stagefeed's CPU is read at its progress lines: None when they came in one burst
        # (bench/input_stagefeed.py ``window_cpu``), never 0.
        unmeasured = key[0] == "stagefeed" and row["core_ms_per_image"] is None
        assert unmeasured or _positive(row["core_ms_per_image"]), key
        n = row["workers"] or cores
        assert row["ideal_images_per_s"] == pytest.approx(n * ideal["images_per_s"], rel=1e-3)
        ratio = row["images_per_s"] / row["ideal_images_per_s"]
        assert row["ratio"] == pytest.approx(ratio, abs=2e-3), key
        assert f"| {key[0]} {key[1]}".strip() + " |" in done.stdout, key

    shm, tcp = rows["stagefeed", "shm", 1], rows["stagefeed", "tcp", 1]
    assert shm["run_transport"].startswith("shm") and tcp["run_transport"] == "tcp"
    assert shm["command"].startswith("stagefeed run --source images:")
    assert "--producers 1 --transport shm" in shm["command"]
    assert "--producers 1 --transport zmq" in tcp["command"]
    assert 0 <= shm["stall_pct"] <= 100
    assert rows["pydataset", "", 1]["start_method"] in ("fork", "spawn", "forkserver")
    peers = {"tf.data": ("tf.data", "", 0), "from_generator": ("from_generator", "", 1),
             "pydataset": ("pydataset", "", 1)}  # fmt: skip
    for row in (shm, tcp):
        for peer, key in peers.items():
            lead = row["images_per_s"] / rows[key]["images_per_s"]
            assert row["vs"][peer] == pytest.approx(lead, abs=0.01), peer
    targets = {t["target"]: t for t in report["targets"]}
    assert len(targets) == 6  # per transport: the ratio, ahead of from_generator, of PyDataset
    for name, row in (("stagefeed shm x1", shm), ("stagefeed tcp x1", tcp)):
        target = targets[f"{name}: ratio to the ideal >= 0.95"]
        assert target["measured"] == row["ratio"]
        assert target["met"] == (row["ratio"] >= 0.95)
        for peer in ("from_generator", "pydataset"):
            target = targets[f"{name}: ahead of {peer}"]
            assert (target["measured"], target["met"]) == (row["vs"][peer], row["vs"][peer] > 1)
    assert "targets (issue 30):" in done.stdout


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"producers": (0,)}, "producers"),
        ({"producers": (1, 1)}, "producers lists a value twice"),
        ({"modes": ("ideal", "dali")}, "'dali'"),
        ({"transports": ("ipc",)}, "'ipc'"),
        ({"crop": 300}, "crop=300 does not fit in image_size=256"),
        ({"images": 16}, "images=16 make no batch of 32"),
        ({"steps": 1}, "steps"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"batch_size": True}, "batch_size"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(settings, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        InputConfig(**settings)


def test_runs_are_the_modes_times_their_producers_and_transports():
    config = InputConfig(producers=(1, 3), transports=("tcp",), modes=("pydataset", "stagefeed"))
    assert config.runs() == [
        ("stagefeed", "tcp", 1),
        ("stagefeed", "tcp", 3),
        ("pydataset", "", 1),
        ("pydataset", "", 3),
    ]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--crop", "300"], "crop=300 does not fit in image_size=256"),
        (["--producers", "1,0"], "producers must be integers in [1, 16]"),
        (["--modes", "stagefeed,dali"], "modes: 'dali' is not one of"),
    ],
)
def test_a_bad_flag_stops_the_command_at_start_in_one_line(tmp_path, flags, named):
    """Exit 2, one line naming the value, no traceback, nothing written (no JPEG folder)."""
    env = cli_env(TMPDIR=str(tmp_path))
    done = run_cli(["bench", "input", *flags, "--json", str(tmp_path / "x.json")], env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagefeed: error: "), done.stderr
    assert named in lines[0]
    assert os.listdir(tmp_path) == []


def _figures() -> list[dict]:
    return [
        {"mode": "stagefeed", "transport": "shm", "workers": 2, "images_per_s": 1600.0,
         "images": 3200, "cpu_s": 3.2, "cpu_images": 3200, "stall_pct": 5.0},
        {"mode": "tf.data", "transport": "", "workers": 0, "seconds": 1.6, "images": 3200,
         "cpu_s": 1.6},
        {"mode": "from_generator", "transport": "", "workers": 1, "seconds": 6.4,
         "images": 3200, "cpu_s": 6.4},
        {"mode": "pydataset", "transport": "", "workers": 2, "seconds": 4.0, "images": 3200,
         "cpu_s": None},
    ]  # fmt: skip


def test_the_report_makes_every_ratio_from_its_figures_and_none_without_the_ideal():
    """``summarize``: N x the ideal's mean (tf.data: the host's cores), the ratio, CPU per
    image, stagefeed's lead over each peer, the targets; without the ideal no ratio is made up
    and the table says n/a."""
    from stagefeed.bench.input import summarize
    from stagefeed.bench.input_table import input_table

    config = InputConfig(producers=(2,), transports=("shm",))
    machine = {"cpus": 2, "cpu": "test", "load_avg_1m": 1.0, "date": "today", "wall_s": 1.0}
    ideals = [{"seconds": 2.0, "images": 2000, "cpu_s": 1.0, "decoder": "simplejpeg"},
              {"seconds": 1.0, "images": 1000, "cpu_s": 0.5, "decoder": "simplejpeg"}]  # fmt: skip
    report = summarize(config, machine, ideals, _figures())
    assert report["ideal"]["images_per_s"] == 1000.0
    assert report["ideal"]["core_ms_per_image"] == 0.5
    rows = {row["mode"]: row for row in report["rows"]}
    expected = {"stagefeed": (2000, 0.8, 1.0), "tf.data": (2000, 1.0, 0.5),
                "from_generator": (1000, 0.5, 2.0), "pydataset": (2000, 0.4, None)}  # fmt: skip
    for mode, (ideal, ratio, cpu_ms) in expected.items():
        row = rows[mode]
        assert (row["ideal_images_per_s"], row["ratio"], row["core_ms_per_image"]) == (
            ideal, ratio, cpu_ms
        ), mode
    assert rows["stagefeed"]["vs"] == {"tf.data": 0.8, "from_generator": 3.2, "pydataset": 2.0}
    assert [(t["target"], t["measured"], t["met"]) for t in report["targets"]] == [
        ("stagefeed shm x2: ratio to the ideal >= 0.8", 0.8, True),
        ("stagefeed shm x2: ahead of from_generator", 3.2, True),
        ("stagefeed shm x2: ahead of pydataset", 2.0, True),
    ]
    assert "| pydataset | 2 | 800.0 | 2000.0 | 0.4 | n/a |" in input_table(report)

    alone = summarize(config, machine, [], _figures())
    assert all(row["ratio"] is None and row["ideal_images_per_s"] is None
               for row in alone["rows"])  # fmt: skip
    assert [t["target"] for t in alone["targets"]] == [
        "stagefeed shm x2: ahead of from_generator",
        "stagefeed shm x2: ahead of pydataset",
    ]
    assert "| stagefeed shm | 2 | 1600.0 | n/a | n/a | 1.0 |" in input_table(alone)


def test_a_window_of_progress_lines_read_in_one_burst_has_no_cpu_figure():
    """Lines read as they come: the CPU between the first timed line and the last, over the
    images between them. Read in one go (the reader starved), every line samples the same
    CPU: no figure, rather than a window of 0 core-ms."""
    # 10 steps of 8 images at 80 images/s take 1 s between steps 2 and 12.
    steady = [(1, 0.0, 1.0), (2, 0.1, 1.1), (7, 0.6, 1.6), (12, 1.1, 2.1)]
    assert window_cpu(steady, 2, 8, 80.0) == (pytest.approx(1.0), 80)
    burst = [(1, 0.0, 1.0), (2, 1.0, 1.7), (7, 1.0, 1.7), (12, 1.01, 1.7)]
    assert window_cpu(burst, 2, 8, 80.0) == (None, 0)
    assert window_cpu(steady[:2], 2, 8, 80.0) == (None, 0)  # one timed line
    assert window_cpu(steady, 2, 8, 0.0) == (None, 0)
