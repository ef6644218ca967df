"""``stagefeed keygen DIR``: write the CURVE key pairs of a trainer and its producers.

The layout is documented in ``common.curve``. Secret key files are made readable by their
owner only (0600, in 0700 directories); an existing key set is never overwritten.
"""

from __future__ import annotations

import argparse
import os
import shutil

import zmq
import zmq.auth

from stagefeed.common import curve
from stagefeed.common.errors import ConfigError

MAX_CLIENTS = 1000


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``keygen`` on the ``stagefeed`` command line."""
    p = subparsers.add_parser(
        "keygen",
        help="write CURVE key pairs for a trainer and its producers (--curve-keys)",
        description="Write the trainer's key pair, a 'local' producer key pair and N more "
        "producer key pairs (DIR/client-I), and list every producer key as allowed.",
    )
    p.add_argument("dir", help="directory to create (or an empty one)")
    p.add_argument("--clients", type=int, default=1, help="producer key pairs in DIR/client-I")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_keygen)


def write_keys(keys_dir: str, clients: int) -> list[str]:
    """Write a complete key set into ``keys_dir``; return the producer directories written."""
    if not isinstance(clients, int) or not 0 <= clients <= MAX_CLIENTS:
        raise ConfigError(f"--clients must be an integer in [0, {MAX_CLIENTS}], got {clients!r}")
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    if os.path.exists(keys_dir) and (not os.path.isdir(keys_dir) or os.listdir(keys_dir)):
        raise ConfigError(
            f"{keys_dir!r} exists and is not an empty directory; keys are never overwritten"
        )
    authorized = os.path.join(keys_dir, curve.AUTHORIZED)
    _make_private_dir(keys_dir)
    _make_private_dir(authorized)
    _create_pair(keys_dir, "server")
    _create_pair(keys_dir, "client")
    shutil.copy(os.path.join(keys_dir, curve.CLIENT_PUBLIC), os.path.join(authorized, "local.key"))
    server_public = os.path.join(keys_dir, curve.SERVER_PUBLIC)
    written = []
    for index in range(clients):
        client_dir = os.path.join(keys_dir, f"client-{index}")
        _make_private_dir(client_dir)
        _create_pair(client_dir, "client")
        shutil.copy(server_public, os.path.join(client_dir, curve.SERVER_PUBLIC))
        shutil.copy(
            os.path.join(client_dir, curve.CLIENT_PUBLIC),
            os.path.join(authorized, f"client-{index}.key"),
        )
        written.append(client_dir)
    return written


def _make_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _create_pair(folder: str, name: str) -> None:
    # Created inside a 0700 directory, so the secret is never readable by others.
    _, secret_file = zmq.auth.create_certificates(folder, name)
    os.chmod(secret_file, 0o600)


def _keygen(args: argparse.Namespace) -> int:
    clients = write_keys(args.dir, args.clients)
    print(f"CURVE keys written to {args.dir}")
    print(f"  trainer:            stagefeed train --curve-keys {args.dir}")
    print(f"  producers here:     stagefeed produce --curve-keys {args.dir}")
    for client_dir in clients:
        public = curve.load_public_key(os.path.join(client_dir, curve.CLIENT_PUBLIC))
        print(f"  producer elsewhere: copy {client_dir}, then --curve-keys <that copy> "
              f"(books name it '<name> {curve.key_fingerprint(public)}')")  # fmt: skip
    return 0
