"""Read docker/compose.yaml and the Dockerfiles, and turn a service into a local process.

No Docker engine here, so a service runs as what its container would run: the image's
ENTRYPOINT + ENV (from its Dockerfile) and the service's command + environment (from the
compose file, interpolated like compose does). What only a container has is mapped onto this
machine, and nothing else is changed:

- service names and the container's wildcard address -> 127.0.0.1 (loopback only);
- a named volume -> a directory under the test's tmp_path, the same for every service that
  mounts it; paths under its mount point, in the environment or the command, point there;
- the image's interpreter (its venv: VIRTUAL_ENV, and PATH in front of it) -> this one.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO, cli_env

DOCKER_DIR = Path(REPO) / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
COMPOSE_CI_FILE = DOCKER_DIR / "compose.ci.yaml"  # CI's override (make test-compose)

# The interpolation forms the compose files may use: ${NAME}, ${NAME:-default},
# ${NAME:?why it is required} and $$.
_VARIABLE = re.compile(
    r"\$(?:\{(?P<name>[A-Za-z_]\w*)(?:(?P<dflt>:-[^}]*)|(?P<required>:\?[^}]*))?\}|(?P<dollar>\$))"
)
_TCP = re.compile(r"tcp://(?P<host>[^:/]+):(?P<port>\d+)")
# Names that reach a container of this project (service names, network aliases) and the
# container's own wildcard address: all of them are loopback when the services run here.
_LOCAL_HOSTS = {"*", "0.0.0.0", "trainer", "trainer-gpu", "producer"}
# The images' ENV that names where their Python lives: none of it exists on this machine.
_IMAGE_LAYOUT = {"PATH", "VIRTUAL_ENV"}


# An override file's `!reset` (drop what the files before set): loaded as this marker.
RESET = object()


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda _loader, _node: RESET)


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=_ComposeLoader)  # a SafeLoader plus the one tag


def without_resets(node: Any) -> Any:
    """``node`` less every key set to ``!reset``: what the override says of its own."""
    if isinstance(node, dict):
        return {k: without_resets(v) for k, v in node.items() if v is not RESET}
    if isinstance(node, list):
        return [without_resets(v) for v in node]
    return node


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution; any other use of ``$`` is an error (not silently kept)."""
    out, pos = [], 0
    for dollar in re.finditer(r"\$", text):
        if dollar.start() < pos:
            continue
        match = _VARIABLE.match(text, dollar.start())
        if match is None:
            raise ValueError(f"unsupported interpolation in {text!r} at {dollar.start()}")
        out.append(text[pos : match.start()])
        if match["dollar"]:
            out.append("$")
        elif match["dflt"] is not None:
            out.append(env.get(match["name"]) or match["dflt"][2:])
        elif match["required"] is not None and not env.get(match["name"]):
            raise ValueError(f"{match['name']} is required: {match['required'][2:]}")
        else:
            out.append(env.get(match["name"], ""))
        pos = match.end()
    out.append(text[pos:])
    return "".join(out)


def interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: interpolated(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, env) for value in node]
    return node


def variables_used(path: Path = COMPOSE_FILE) -> set[str]:
    """Every variable name the compose file interpolates."""
    return {m["name"] for m in _VARIABLE.finditer(path.read_text()) if m["name"]}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    pairs = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        pairs.append((instruction.upper(), args.strip()))
    return pairs


def dockerfile_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in dockerfile_instructions(path):
        if instruction == "ENV":
            for item in shlex.split(args):
                key, sep, value = item.partition("=")
                assert sep, f"{path.name}: use ENV KEY=VALUE, got {item!r}"
                env[key] = value
    return env


def dockerfile_entrypoint(path: Path) -> list[str]:
    entries = [args for ins, args in dockerfile_instructions(path) if ins == "ENTRYPOINT"]
    assert entries, f"{path.name} has no ENTRYPOINT"
    return json.loads(entries[-1])  # exec form: a JSON array


def dockerfile_of(service: Mapping[str, Any]) -> Path:
    build = service["build"]
    return (DOCKER_DIR / build["context"] / build["dockerfile"]).resolve()


@dataclasses.dataclass
class LocalService:
    """A compose service as a local command: CLI arguments (after ``stagefeed``) and env."""

    name: str
    args: list[str]
    env: dict[str, str]
    healthcheck_args: list[str] | None
    volumes: dict[str, Path]  # mount point in the container -> local directory


def local_service(name: str, variables: Mapping[str, str], tmp: Path) -> LocalService:
    """Service ``name`` of compose.yaml with ``variables`` as the shell/.env of ``compose up``."""
    service = interpolated(load_compose()["services"][name], variables)
    dockerfile = dockerfile_of(service)
    argv = dockerfile_entrypoint(dockerfile) + list(service.get("command") or [])
    assert argv[0] == "stagefeed", f"{name}: the image must start stagefeed, got {argv}"
    volumes = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        assert re.fullmatch(r"[\w.-]+", source), f"{name}: {source!r} is not a named volume"
        local = tmp / "volumes" / source  # shared by every service that mounts it, as in Docker
        local.mkdir(parents=True, exist_ok=True)
        volumes[target] = local
    env = {k: v for k, v in dockerfile_env(dockerfile).items() if k not in _IMAGE_LAYOUT}
    for key, value in (service.get("environment") or {}).items():
        if value is not None:
            env[key] = _to_local(str(value), volumes)
    health = None
    if "healthcheck" in service:
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "stagefeed"], f"{name}: healthcheck must exec stagefeed"
        health = test[2:]
    args = [_to_local(arg, volumes) for arg in argv[1:]]
    return LocalService(name, args, cli_env(**env), health, volumes)


def _to_local(value: str, volumes: Mapping[str, Path]) -> str:
    def loopback(m: re.Match[str]) -> str:
        local = m["host"] in _LOCAL_HOSTS
        return f"tcp://127.0.0.1:{m['port']}" if local else m[0]

    value = _TCP.sub(loopback, value)
    for target, local in volumes.items():
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return str(local) + value[len(target.rstrip("/")) :]
    return value


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent directory decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def _glob_regex(pattern: str) -> re.Pattern[str]:
    glob = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    tokens = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
    return re.compile("".join(glob.get(token, re.escape(token)) for token in tokens))


def base_requirements() -> list[str]:
    """pyproject.toml's dependencies: what every image installs."""
    with open(Path(REPO) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def requirement_closure(requirements: list[str]) -> set[str]:
    """Distributions ``requirements`` pull in on this platform (installed metadata, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return seen
