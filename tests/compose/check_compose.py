"""docker/compose.yaml under a real Docker engine: images built, `up --scale producer=3`, trained.

Run only by `make test-compose` (tests/compose/run.sh), which names this file (pytest does not
collect it otherwise): it prepares the engine, the base image, the wheels and the pip.conf the
CI override (docker/compose.ci.yaml) reads, and skips where it cannot. Run by hand without
them, this module skips.

Each deployment runs `up -d --scale producer=3` with batches of 2 and a fixed STAGEFEED_STEPS,
waits for the trainer to exit, reads its JSON summary from the `summaries` volume (`compose
cp`), then `down --volumes` and checks that no container, volume or network of the project is
left. The report (`docker compose ps` during a run, the trainer's summary lines) goes to
$STAGEFEED_COMPOSE_REPORT/report.txt, which run.sh prints.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO, free_tcp_port, wait_for

PREPARED_BY_RUN_SH = (
    "STAGEFEED_CI_BASE_IMAGE",
    "STAGEFEED_CI_PIP_CONF",
    "STAGEFEED_COMPOSE_REPORT",
)
if not all(os.environ.get(name) for name in PREPARED_BY_RUN_SH):
    pytest.skip(
        "needs the engine and images run.sh prepares: `make test-compose`", allow_module_level=True
    )

PROJECT = "stagefeed-ci"
COMPOSE = [
    "docker", "compose", "--project-name", PROJECT,
    "-f", "docker/compose.yaml", "-f", "docker/compose.ci.yaml",
]  # fmt: skip
IMAGES = ("stagefeed-trainer:cpu", "stagefeed-producer:local")
REPORT = Path(os.environ.get("STAGEFEED_COMPOSE_REPORT", "out/compose-test"))
PRODUCERS = 3
# A queue of 3 batches (4 MiB of 1.2 MiB batches): steps take batches of all three producers,
# not the first one's backlog.
RUN_VARIABLES = {
    "STAGEFEED_BATCH_SIZE": "2",
    "STAGEFEED_QUEUE_MB": "4",
    "STAGEFEED_INFLIGHT_MB": "8",
    "STAGEFEED_SHM_PRODUCERS": str(PRODUCERS),
    "STAGEFEED_PROGRESS_S": "2",
}


def report(title: str, text: str) -> None:
    REPORT.mkdir(parents=True, exist_ok=True)
    with open(REPORT / "report.txt", "a", encoding="utf-8") as f:
        f.write(f"== {title}\n{text.rstrip()}\n\n")


def docker(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``docker ARGS`` in the repository root; its stdout, or a failure naming it."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"docker {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def compose(*args: str, env: dict[str, str], timeout: float = 180) -> str:
    return docker(*COMPOSE[1:], *args, env=env, timeout=timeout)


class Deployment:
    """One `up --scale producer=3` of the project, with its variables and its trainer's metrics."""

    def __init__(self, transport: str, steps: int) -> None:
        self.metrics_port = free_tcp_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFEED_")}
        self.env = {
            **base,
            **{k: os.environ[k] for k in os.environ if k.startswith("STAGEFEED_CI_")},
            **RUN_VARIABLES,
            "STAGEFEED_PORT": str(free_tcp_port()),
            "STAGEFEED_METRICS_PORT": str(self.metrics_port),
            "STAGEFEED_TRANSPORT": transport,
            "STAGEFEED_STEPS": str(steps),
        }
        self.trainer = ""
        self.timings: dict[str, float] = {}  # seconds, for the report
        self._clock = time.monotonic()

    def lap(self, what: str) -> None:
        now = time.monotonic()
        self.timings[what] = round(now - self._clock, 1)
        self._clock = now

    def up(self) -> None:
        compose("up", "--detach", "--no-build", "--scale", f"producer={PRODUCERS}", env=self.env)
        self.lap("up (trainer healthy, producers started)")
        self.trainer = compose("ps", "--all", "--quiet", "trainer", env=self.env).strip()
        assert self.trainer, "no trainer container after up"

    def ps(self) -> list[dict]:
        out = compose("ps", "--all", "--format", "json", env=self.env)
        # compose v2 prints one JSON object per line (older releases: one array).
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [r for row in rows for r in (row if isinstance(row, list) else [row])]

    def producers(self) -> list[str]:
        return sorted(r["Name"] for r in self.ps() if r["Service"] == "producer")

    def metric(self, name: str) -> float | None:
        """A sample of the trainer's Prometheus endpoint (host network: 127.0.0.1), or None."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as answer:
                text = answer.read().decode()
        except OSError:
            return None
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        return float(found[1]) if found else None

    def wait_until_training_with_all(self, steps: int) -> None:
        def ready() -> bool:
            seen, done = (
                self.metric("stagefeed_producers_seen"),
                self.metric("stagefeed_steps_total"),
            )
            return seen == PRODUCERS and (done or 0) >= steps

        assert wait_for(ready, timeout=180, interval=0.5), (
            f"waited 180 s for {PRODUCERS} producers and {steps} steps; "
            f"seen {self.metric('stagefeed_producers_seen')}, "
            f"steps {self.metric('stagefeed_steps_total')}\n{self.logs('trainer')[-3000:]}"
        )

    def state(self, container: str) -> dict:
        return json.loads(docker("inspect", "--format", "{{json .}}", container))

    def wait_trainer_exit(self) -> int:
        exited = wait_for(
            lambda: self.state(self.trainer)["State"]["Status"] == "exited", timeout=240, interval=1
        )
        assert exited, f"waited 240 s for the trainer to exit\n{self.logs('trainer')[-3000:]}"
        self.lap("then until the trainer exited")
        return self.state(self.trainer)["State"]["ExitCode"]

    def logs(self, service: str) -> str:
        return compose("logs", "--no-log-prefix", service, env=self.env)

    @staticmethod
    def container_logs(container: str) -> str:
        # `docker logs` replays the container's stderr (where stagefeed logs) on its own stderr.
        done = subprocess.run(
            ["docker", "logs", container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout

    def summary(self, tmp_path: Path) -> dict:
        local = tmp_path / "summary.json"
        compose("cp", "trainer:/var/lib/stagefeed/summary.json", str(local), env=self.env)
        return json.loads(local.read_text())

    def summary_lines(self) -> str:
        """The summary the trainer printed: from its title to the advice line."""
        text = self.logs("trainer")
        start = text.rindex("stagefeed summary")
        end = text.index("\n", text.index("advice:", start))
        return text[start:end]

    def down(self) -> None:
        compose("down", "--volumes", "--remove-orphans", "--timeout", "10", env=self.env)
        self.lap("down")

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            kind: docker(*command, "--quiet", "--filter", label).split()
            for kind, command in {
                "containers": ("ps", "--all"),
                "volumes": ("volume", "ls"),
                "networks": ("network", "ls"),
            }.items()
        }


@contextmanager
def deployment(transport: str, steps: int) -> Iterator[Deployment]:
    """Up with three producers; always down, and nothing of the project may remain after."""
    run = Deployment(transport, steps)
    try:
        run.up()
        yield run
    finally:
        run.down()
    report(f"timings, {transport} run of {steps} steps (s)", json.dumps(run.timings))
    assert run.leftovers() == {"containers": [], "volumes": [], "networks": []}


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    """Both images, built once (compose runs the two builds side by side)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFEED_") or "_CI_" in k}
    started = time.monotonic()
    done = subprocess.run(
        [*COMPOSE, "--progress", "plain", "build"], capture_output=True, text=True, cwd=REPO,
        env=env, timeout=900, check=False,
    )  # fmt: skip
    REPORT.mkdir(parents=True, exist_ok=True)
    (REPORT / "build.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"compose build failed:\n{(done.stdout + done.stderr)[-4000:]}"
    report("build", f"both images built in {time.monotonic() - started:.0f} s")


def assert_all_delivered_and_trained(summary: dict, steps: int) -> None:
    assert (summary["steps"], summary["interrupted"]) == (steps, False)
    batches = summary["batches"]
    assert batches["dropped"] == 0 and summary["dropped_by_reason"] == {}, batches
    assert batches["seq_missing"] == 0 and summary["refused_producers"] == {}, summary
    assert batches["trained"] == steps + summary["warmup_steps"]
    producers = summary["producers"]
    assert len(producers) == PRODUCERS, list(producers)
    for name, books in producers.items():
        assert books["received"] > 0 and books["trained"] > 0, (name, books)
        assert books["dropped"] == {} and books["trained_duplicates"] == 0, (name, books)


def test_the_images_hold_no_build_secret():
    """The CA bundle and pip.conf reached pip as BuildKit secrets: no layer, no history line."""
    pip_conf = Path(os.environ["STAGEFEED_CI_PIP_CONF"]).read_text()
    wheel_url = re.search(r"http://127\.0\.0\.1:\d+", pip_conf)
    for image in IMAGES:
        history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image)
        assert "BEGIN CERTIFICATE" not in history
        assert wheel_url is None or wheel_url[0] not in history, image
        files = docker(
            "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c",
            "find /run/secrets /etc/pip.conf -type f 2>/dev/null; id -u; command -v stagefeed",
        ).split()  # fmt: skip
        assert files == ["10001", "/opt/venv/bin/stagefeed"], (image, files)


def test_three_producers_over_tcp(tmp_path):
    steps = 30
    with deployment("zmq", steps) as run:
        run.wait_until_training_with_all(steps=2)
        table = compose("ps", "--all", env=run.env)
        states = {r["Name"]: (r["State"], r.get("Health", "")) for r in run.ps()}
        report("docker compose ps (tcp run, 3 producers training)", table)
        assert states[f"{PROJECT}-trainer-1"] == ("running", "healthy"), states
        assert [states[p][0] for p in run.producers()] == ["running"] * PRODUCERS, states
        assert run.wait_trainer_exit() == 0, run.logs("trainer")[-3000:]
        summary = run.summary(tmp_path)
        report("trainer summary (tcp run)", run.summary_lines())
    assert (summary["transport"], summary["shm"]) == ("tcp", None)
    assert_all_delivered_and_trained(summary, steps)


def test_three_producers_over_shared_memory(tmp_path):
    """STAGEFEED_TRANSPORT=shm makes shared memory mandatory: each producer container passes
    its memfd pool over the shm-sock volume's socket, or exits 2 saying why."""
    steps = 30
    with deployment("shm", steps) as run:
        assert run.wait_trainer_exit() == 0, run.logs("trainer")[-3000:]
        summary = run.summary(tmp_path)
        report("trainer summary (shared-memory run)", run.summary_lines())
    assert summary["transport"] == "shm+tcp"
    shm = summary["shm"]
    assert shm["socket"] == "/run/stagefeed/pools/pools.sock"
    assert shm["pools_accepted"] == PRODUCERS and shm["pools_live"] == 0, shm
    assert shm["batches"] == summary["batches"]["received"], (shm, summary["batches"])
    assert_all_delivered_and_trained(summary, steps)


def test_a_killed_producer_container_does_not_stop_training(tmp_path):
    steps, kill_at = 60, 10
    with deployment("shm", steps) as run:
        run.wait_until_training_with_all(steps=kill_at)
        victim = run.producers()[1]
        victim_id = re.search(r"producer (\S+) -> tcp://", run.container_logs(victim))[1]
        docker("kill", victim)
        steps_at_kill = run.metric("stagefeed_steps_total")
        received_at_kill = run.metric("stagefeed_received_batches_total")
        assert run.wait_trainer_exit() == 0, run.logs("trainer")[-3000:]
        victim_state = run.state(victim)
        summary = run.summary(tmp_path)
        report(
            "killed producer (shared memory)",
            f"docker kill {victim} ({victim_id}) at step {steps_at_kill:.0f} of "
            f"{steps + 2}, {received_at_kill:.0f} batches received by then; the container: "
            f"{victim_state['State']['Status']}, exit {victim_state['State']['ExitCode']}, "
            f"restarts {victim_state['RestartCount']}\n{run.summary_lines()}",
        )
    # Gone for good (`docker kill` is a manual stop: restart: on-failure does not bring it back).
    assert (victim_state["State"]["ExitCode"], victim_state["RestartCount"]) == (137, 0)
    assert (summary["steps"], summary["interrupted"]) == (steps, False)
    # At the kill the trainer held at most 21 batches (queue 3; stage_depth + 2 + 4 x
    # enqueue_threads = 12 in flight; 2 per producer): training more than that after it took
    # batches that the two producers left delivered after it.
    trained_after = summary["batches"]["trained"] - steps_at_kill
    assert trained_after >= 30, (steps_at_kill, summary["batches"])
    assert summary["batches"]["received"] - received_at_kill >= 10, summary["batches"]
    killed = summary["producers"][victim_id]
    assert killed["received"] > 0 and killed["dropped"] == {}, killed
    assert summary["batches"]["dropped"] == 0, summary["batches"]
    survivors = [b for name, b in summary["producers"].items() if name != victim_id]
    assert len(survivors) == PRODUCERS - 1 and all(b["trained"] > 0 for b in survivors)
