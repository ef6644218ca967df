"""``kustomize build`` for the tests, without kubectl or Go: the real kustomize library.

pykustomize (PyPI) ships sigs.k8s.io/kustomize/api, compiled into a shared library with a C
entry point per operation. Its Python wrapper needs Python 3.14, so ``make venv`` installs
the wheel without that check (tests/k8s-renderer.txt) and this module calls the library's C
functions with ctypes: ``pykustomize_build(path, options_json, &result)`` returns 0 and the
YAML stream, or -1 and ``pykustomize_last_error()``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import yaml

LIBRARY = "_lib/linux-amd64/libpykustomize.so"


class RenderError(Exception):
    """kustomize refused the kustomization; the message is kustomize's."""


def library_path() -> Path | None:
    """The installed pykustomize's shared library, or None (not installed, not linux-amd64).
    Only the package is located: its ``__init__`` (the 3.14 wrapper) is never imported."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    spec = importlib.util.find_spec("pykustomize")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / LIBRARY
    return path if path.exists() else None


@functools.cache
def _library() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise RenderError("pykustomize is not installed (make venv installs it)")
    lib = ctypes.CDLL(str(path))
    lib.pykustomize_build.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    lib.pykustomize_build.restype = ctypes.c_int
    lib.pykustomize_last_error.restype = ctypes.c_void_p
    lib.pykustomize_version_string.restype = ctypes.c_void_p
    lib.pykustomize_free.argtypes = [ctypes.c_void_p]
    return lib


def version() -> str:
    """The library's version string (pykustomize's; its kustomize is sigs.k8s.io/kustomize/api
    v0.21.3 for pykustomize 0.1.4)."""
    return ctypes.string_at(_library().pykustomize_version_string()).decode()


def build_yaml(directory: str | os.PathLike[str]) -> str:
    """``kustomize build DIRECTORY`` (files loaded from inside the root only, kustomize's
    default); ``RenderError`` with kustomize's message if it fails."""
    lib = _library()
    options = json.dumps({"load_restrictions": 0, "reorder": "legacy"}).encode()
    result = ctypes.c_void_p()
    status = lib.pykustomize_build(os.fsencode(directory), options, ctypes.byref(result))
    if status != 0:
        error = lib.pykustomize_last_error()
        raise RenderError(ctypes.string_at(error).decode() if error else f"status {status}")
    try:
        return ctypes.string_at(result.value).decode()
    finally:
        lib.pykustomize_free(result.value)


def build(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The resources ``kustomize build DIRECTORY`` renders, parsed."""
    return [doc for doc in yaml.safe_load_all(build_yaml(directory)) if doc is not None]


# ---- reading what was rendered ----------------------------------------------------------------

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def find(resources: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one resource of ``kind`` (named ``name``); AssertionError if not exactly one."""
    found = [
        r for r in resources
        if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)
    ]  # fmt: skip
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in the rendered output"
    return found[0]


def pod_templates(resources: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``KIND/NAME`` -> pod template of every workload rendered (TFJob: per replica type)."""
    templates = {}
    for r in resources:
        key = f"{r['kind']}/{r['metadata']['name']}"
        if r["kind"] in ("Deployment", "Job"):
            templates[key] = r["spec"]["template"]
        elif r["kind"] == "TFJob":
            for replica, spec in r["spec"]["tfReplicaSpecs"].items():
                templates[f"{key}/{replica}"] = spec["template"]
    return templates


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers and init containers (native sidecars) of a pod template."""
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def environment(
    container: dict[str, Any],
    resources: list[dict[str, Any]],
    pod: dict[str, Any] | None = None,
) -> dict[str, str]:
    """What the container's process sees, as the kubelet makes it (``MakeEnvironmentVariables``
    in pkg/kubelet): its ConfigMaps (envFrom, in order), then its env in order, each value's
    ``$(VAR)`` expanded from what is defined so far (an undefined one stays as written, ``$$``
    is ``$``), a ``fieldRef`` to ``metadata.labels['K']`` or ``metadata.annotations['K']`` read
    from ``pod`` (a pod's metadata; a key it lacks reads as empty, as the kubelet's does).
    Without ``pod``, a variable from a ``fieldRef`` is left out: only a pod has its value."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif pod is not None:
            env[entry["name"]] = field_ref(pod, entry["valueFrom"]["fieldRef"]["fieldPath"])
    return env


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in ``value`` from ``env`` (third_party/forked/golang/expansion's rules for
    what tests use: a defined name is replaced, an undefined one kept, ``$$`` is one ``$``)."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REFERENCE.sub(one, value)


def field_ref(pod: dict[str, Any], path: str) -> str:
    """The downward API's ``metadata.labels['K']`` / ``metadata.annotations['K']`` of ``pod``
    (its metadata); AssertionError for another path (the manifests use no other)."""
    match = _FIELD.fullmatch(path)
    assert match, f"fieldRef {path!r}: only labels and annotations are modelled"
    return str(pod.get(match[1], {}).get(match[2], ""))
