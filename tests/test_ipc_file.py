"""``common.ipc_file``: the owner of an ipc bind removes its socket file, and only that file."""

from __future__ import annotations

import os

import zmq

from stagefeed.common.ipc_file import IpcFile


def _bind(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def test_removes_the_socket_file_libzmq_leaves_behind(tmp_path):
    path = str(tmp_path / "t.sock")
    ctx = zmq.Context()
    sock = _bind(ctx, f"ipc://{path}")
    ipc = IpcFile(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    sock.close()
    ctx.term()
    assert os.path.exists(path)  # libzmq does not remove it: the reason for IpcFile
    ipc.remove()
    assert not os.path.exists(path)
    ipc.remove()  # idempotent


def test_leaves_a_file_another_bind_made_at_the_same_path(tmp_path):
    path = str(tmp_path / "t.sock")
    ctx = zmq.Context()
    first = _bind(ctx, f"ipc://{path}")
    ipc = IpcFile(f"ipc://{path}")
    second = _bind(ctx, f"ipc://{path}")  # libzmq replaces the file
    first.close()
    ipc.remove()
    assert os.path.exists(path), "removed the socket file of a later bind"
    second.close()
    ctx.term()


def test_endpoints_without_a_file():
    assert IpcFile("tcp://127.0.0.1:5555").path is None
    assert IpcFile("ipc://@abstract-name").path is None
    IpcFile("inproc://x").remove()
