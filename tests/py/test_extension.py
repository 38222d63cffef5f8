"""The extension loads, calls into libstepguard and maps its errors."""

from __future__ import annotations

import errno
import socket

import pytest

import stepguard
from stepguard import _C


def test_version_comes_from_c() -> None:
    assert stepguard.__version__ == _C.version()
    assert stepguard.__version__.count(".") == 2


def test_error_table() -> None:
    assert _C.ETIMEDOUT == -errno.ETIMEDOUT
    assert _C.strerror(_C.ETIMEDOUT) == "deadline exceeded"
    assert _C.err_name(_C.EPROTO) == "SG_EPROTO"
    assert _C.err_name(42) == "SG_E?"
    assert _C.err_is_fatal(_C.EABORTED)
    assert not _C.err_is_fatal(_C.ETIMEDOUT)


def test_errors_become_exceptions() -> None:
    with pytest.raises(TimeoutError, match="slow peer"):
        _C._raise_error(_C.ETIMEDOUT, "slow peer")
    with pytest.raises(stepguard.Error) as info:
        _C._raise_error(_C.EPROTO)
    assert info.value.code == _C.EPROTO
    assert "protocol error" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(MemoryError):
        _C._raise_error(_C.ENOMEM)


def test_monotonic_clock() -> None:
    a = _C.monotonic_ns()
    b = _C.monotonic_ns()
    assert 0 < a <= b


def test_log_level_validation() -> None:
    _C.set_log_level("warn")
    _C.log(2, "test", "not shown at warn")
    with pytest.raises(ValueError):
        _C.set_log_level("loud")
    with pytest.raises(ValueError):
        _C.log(9, "test", "x")
    _C.set_log_level("info")


def test_tcp_round_trip_through_c() -> None:
    before = _C.registered_sockets()
    lfd, port = _C.tcp_listen("127.0.0.1", 0)
    assert port > 0
    fd = _C.tcp_connect("127.0.0.1", port, 5.0)
    assert _C.registered_sockets() == before + 2
    listener = socket.socket(fileno=socket.dup(lfd))
    conn, _ = listener.accept()
    client = socket.socket(fileno=socket.dup(fd))
    client.setblocking(True)
    client.sendall(b"ping")
    assert conn.recv(4) == b"ping"
    for s in (conn, client, listener):
        s.close()
    _C.tcp_close(fd)
    _C.tcp_close(lfd)
    assert _C.registered_sockets() == before


def test_connect_refused_is_runtime_error() -> None:
    lfd, port = _C.tcp_listen("127.0.0.1", 0)
    _C.tcp_close(lfd)
    with pytest.raises(stepguard.Error) as info:
        _C.tcp_connect("127.0.0.1", port, 5.0)
    assert info.value.code == _C.ECONNREFUSED
    with pytest.raises(ValueError):
        _C.tcp_connect("127.0.0.1", port, -1.0)
