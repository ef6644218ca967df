"""docker/: what can be checked without a Docker engine (this machine has the client only).

- compose.yaml is valid against the compose specification (check-jsonschema's vendored
  compose-spec schema), and the validator is shown to reject broken files;
- `docker compose config` runs too where a compose plugin exists (skipped here: none);
- the profiles give exactly one service answering to "trainer", CPU by default, GPU on demand;
- every STAGEFEED_* variable a service sets is a flag of the command it runs;
- compose.ci.yaml (CI's override, `make test-compose`) is valid too, runs on loopback only,
  and builds FROM the base image CI names.

The services run on loopback: tests/test_compose_services.py; the Dockerfiles:
tests/test_dockerfiles.py; the images built and run under a real engine:
tests/compose/check_compose.py (make test-compose).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stagefeed import envflags
from stagefeed.cli import build_parser
from tests.conftest import REPO
from tests.helpers import compose_local as cl

DOCKERFILES = [cl.DOCKER_DIR / "Dockerfile.producer", cl.DOCKER_DIR / "Dockerfile.trainer"]
HADOLINT = Path(sys.executable).parent / "hadolint"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_compose_file_is_valid_against_the_compose_spec():
    result = validate(cl.COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ci_override_is_valid_against_the_compose_spec(tmp_path):
    """What the override sets of its own (its `!reset` keys, a compose merge tag the schema's
    YAML reader does not know, dropped) validates as a compose file."""
    own = tmp_path / "compose.ci.json"
    own.write_text(json.dumps(cl.without_resets(cl.load_compose(cl.COMPOSE_CI_FILE))))
    result = validate(own)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "complaint"),
    [
        ("    profiles: [cpu]\n", "    profiles: [cpu]\n    replica: 2\n", "replica"),
        ("condition: service_healthy", "condition: service_ready", "service_ready"),
    ],
)
def test_the_validator_rejects_a_broken_compose_file(tmp_path, old, new, complaint):
    text = cl.COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    result = validate(broken)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


def test_docker_compose_config_where_a_compose_plugin_exists():
    docker = shutil.which("docker")
    probe = (
        subprocess.run(
            [docker or "docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if docker
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine (docker client only)")
    ci = ["-f", str(cl.COMPOSE_FILE), "-f", str(cl.COMPOSE_CI_FILE)]
    for files in (["-f", str(cl.COMPOSE_FILE)], ci):
        for profile in ([], ["--profile", "gpu"]):
            result = subprocess.run(
                [docker, "compose", *files, *profile, "config", "--quiet"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env={**os.environ, **CI_VARIABLES},
            )
            assert result.returncode == 0, result.stderr


def enabled(services: dict, profiles: set[str]) -> dict:
    """Compose's rule: a service without profiles is always on, else one must be active."""

    def on(service: dict) -> bool:
        return not service.get("profiles") or bool(profiles & set(service["profiles"]))

    return {name: service for name, service in services.items() if on(service)}


def dotenv() -> dict[str, str]:
    lines = (cl.DOCKER_DIR / ".env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.startswith("#"))


def answers_to(name: str, service_name: str, service: dict) -> bool:
    networks = service.get("networks") or {}
    aliases = [a for net in networks.values() for a in (net or {}).get("aliases", [])]
    return service_name == name or name in aliases


@pytest.mark.parametrize("cli_profiles", [None, {"gpu"}], ids=["default", "profile-gpu"])
def test_one_trainer_answers_to_trainer_whatever_the_profile(cli_profiles):
    services = cl.load_compose()["services"]
    # `--profile` on the command line replaces COMPOSE_PROFILES (docker/.env's default).
    active = cli_profiles or set(dotenv()["COMPOSE_PROFILES"].split(","))
    on = enabled(services, active)
    trainers = [n for n, s in on.items() if answers_to("trainer", n, s)]
    expected = "trainer-gpu" if cli_profiles else "trainer"
    assert trainers == [expected]
    assert "producer" in on
    env = on[expected]["environment"]
    assert env["STAGEFEED_DEVICE"] == ("gpu" if cli_profiles else "cpu")
    connect = services["producer"]["environment"]["STAGEFEED_CONNECT"]
    assert re.fullmatch(r"tcp://trainer:\$\{STAGEFEED_PORT:-5555\}", connect)
    assert env["STAGEFEED_BIND"] == "tcp://*:${STAGEFEED_PORT:-5555}"
    for dep, condition in services["producer"]["depends_on"].items():
        assert dep in on or condition["required"] is False, dep


def test_the_gpu_trainer_is_the_cpu_trainer_plus_a_gpu():
    services = cl.load_compose()["services"]
    cpu, gpu = services["trainer"], services["trainer-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["args"]["TF_EXTRA"] == "gpu"
    assert cpu["build"]["args"]["TF_EXTRA"] == "cpu"
    assert {k: v for k, v in gpu["environment"].items() if k != "STAGEFEED_DEVICE"} == {
        k: v for k, v in cpu["environment"].items() if k != "STAGEFEED_DEVICE"
    }
    for key in ("command", "ports", "volumes", "healthcheck", "stop_grace_period", "init"):
        assert gpu[key] == cpu[key], key


def test_every_variable_a_service_sets_is_a_flag_of_its_command():
    services = cl.load_compose()["services"]
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, service in services.items():
        parser = commands[service["command"][0]]
        flags = {
            envflags.env_name(option)
            for action in parser._actions  # noqa: SLF001
            for option in action.option_strings
            if option.startswith("--") and option != "--help"
        }
        settable = {k for k in service.get("environment", {}) if k.startswith("STAGEFEED_")}
        assert settable <= flags, f"{name}: not flags of its command: {settable - flags}"
    trainer_env = services["trainer"]["environment"]
    for key in (
        "STAGEFEED_BATCH_SIZE",
        "STAGEFEED_DTYPE",
        "STAGEFEED_STEPS",
        "STAGEFEED_QUEUE_MB",
        "STAGEFEED_ENQUEUE_THREADS",
        "STAGEFEED_CURVE_KEYS",
        "STAGEFEED_JSON",
    ):
        assert key in trainer_env, key
    assert trainer_env["STAGEFEED_STEPS"] == "${STAGEFEED_STEPS:-0}"  # until stopped


def test_the_shared_memory_socket_volume_is_one_volume_at_one_path():
    """The pool socket the trainer names in its welcomes must be the same path inside every
    producer container: one named volume, mounted at the same point by all, the socket in a
    directory under it that the trainer makes private; both images make the mount point
    theirs and 0700, so a fresh volume starts closed to other users."""
    compose = cl.load_compose()
    services = compose["services"]
    assert "shm-sock" in compose["volumes"]
    for name in ("trainer", "trainer-gpu", "producer"):
        mounts = [v for v in services[name]["volumes"] if v.split(":")[0] == "shm-sock"]
        assert mounts == ["shm-sock:/run/stagefeed"], name
        assert services[name]["environment"]["STAGEFEED_TRANSPORT"] == (
            "${STAGEFEED_TRANSPORT:-auto}"
        ), name
    socket = services["trainer"]["environment"]["STAGEFEED_SHM_SOCKET"]
    assert socket == "/run/stagefeed/pools/pools.sock"
    assert "STAGEFEED_SHM_SOCKET" not in services["producer"]["environment"]  # told in welcome
    for dockerfile in DOCKERFILES:
        runs = " ".join(a for ins, a in cl.dockerfile_instructions(dockerfile) if ins == "RUN")
        assert "useradd --system --uid 10001 --gid stagefeed" in runs, dockerfile.name
        assert re.search(r"install -d -o stagefeed -g stagefeed -m 0700 [^&]*/run/stagefeed", runs)
        user = [a for ins, a in cl.dockerfile_instructions(dockerfile) if ins == "USER"][-1]
        assert user == "10001:10001", dockerfile.name


def test_every_variable_the_compose_file_reads_is_documented():
    used = cl.variables_used()
    assert used, "compose.yaml interpolates nothing?"
    assert all(v.startswith("STAGEFEED_") for v in used), used
    guide = (Path(REPO) / "docs" / "deployment.md").read_text()
    assert not [v for v in used if v not in guide]
    ci_only = cl.variables_used(cl.COMPOSE_CI_FILE) - used
    assert ci_only == set(CI_VARIABLES), ci_only
    assert not [v for v in ci_only if v not in guide]


# What tests/compose/run.sh exports for the override (any values will do for `config`).
CI_VARIABLES = {
    "STAGEFEED_CI_BASE_IMAGE": "local/stagefeed-ci-base:bookworm-python3",
    "STAGEFEED_CI_PIP_CONF": str(cl.DOCKER_DIR / "constraints.txt"),
    "STAGEFEED_CI_CA_BUNDLE": str(cl.DOCKER_DIR / "constraints.txt"),
}


def test_the_ci_override_runs_on_loopback_and_builds_from_the_ci_base():
    """Host networking (the CI engine runs without a bridge); every address 127.0.0.1; no
    published port; builds FROM STAGEFEED_CI_BASE_IMAGE on the host network, with pip's CA
    bundle and settings as BuildKit secrets (files on the host, never build arguments)."""
    override = cl.load_compose(cl.COMPOSE_CI_FILE)
    services = override["services"]
    assert set(services) == {"trainer", "producer"}
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert "networks" not in service, name
        build = service["build"]
        assert build["network"] == "host", name
        assert build["args"] == {
            "BASE_IMAGE": "${STAGEFEED_CI_BASE_IMAGE:?the base image to build FROM}"
        }
        assert set(build["secrets"]) <= set(override["secrets"]), name
        assert "ca-certificates" in build["secrets"], name
    assert services["trainer"]["ports"] is cl.RESET
    assert services["trainer"]["healthcheck"]["start_interval"] is cl.RESET  # needs engine 25
    env = cl.interpolated(override, {**CI_VARIABLES, "STAGEFEED_PORT": "5600"})["services"]
    assert env["trainer"]["environment"]["STAGEFEED_BIND"] == "tcp://127.0.0.1:5600"
    assert env["trainer"]["environment"]["STAGEFEED_METRICS_BIND"] == "127.0.0.1"
    assert env["producer"]["environment"]["STAGEFEED_CONNECT"] == "tcp://127.0.0.1:5600"
    text = cl.COMPOSE_CI_FILE.read_text()
    addresses = re.findall(r"tcp://([^:/\s]+)", text) + re.findall(
        r"_BIND: (\d[\d.]*)$", text, re.M
    )
    assert len(addresses) == 3 and set(addresses) == {"127.0.0.1"}, addresses
    for secret in override["secrets"].values():
        assert set(secret) == {"file"}, secret
