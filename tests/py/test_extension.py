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


def test_one_address_parser_for_every_layer() -> None:
    assert _C.split_address("h.example:80") == ("h.example", 80)
    assert _C.split_address("[::1]:9") == ("::1", 9)
    for bad in ["", "h", "h:", ":1", "h:65536", "::1:5", "[::1]", "h :1"]:
        with pytest.raises(_C.Error, match="address"):
            _C.split_address(bad)
    # the store address parser is the same one (and takes torchft's bare v6)
    from stepguard.process_group import _split_store_addr

    assert _split_store_addr("[::1]:5/p/q") == ("::1", 5, "p/q")
    assert _split_store_addr("::1:5/p") == ("::1", 5, "p")
    with pytest.raises(ValueError, match="host:port/prefix"):
        _split_store_addr("nohost/p")


def test_advertised_host_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepguard.checkpointing import NativeTransport

    monkeypatch.delenv("STEPGUARD_ADVERTISE_HOST", raising=False)
    assert _C.advertised_host("opt.example", "fb.example") == "opt.example"
    assert _C.advertised_host(None, "fb.example") == "fb.example"
    assert _C.advertised_host("::1") == "[::1]"
    assert _C.advertised_host("lo") == "127.0.0.1"  # an interface name
    assert _C.advertised_host() == socket.gethostname()
    t = NativeTransport(hostname="opt.example")
    try:
        assert "opt.example" in t.metadata()
    finally:
        t.shutdown()
    # the variable wins over the argument, in every server alike
    monkeypatch.setenv("STEPGUARD_ADVERTISE_HOST", "lo")
    assert _C.advertised_host("opt.example") == "127.0.0.1"
    t = NativeTransport(hostname="opt.example")
    try:
        assert "opt.example" not in t.metadata() and "127.0.0.1" in t.metadata()
    finally:
        t.shutdown()
