"""Link shaping of stepguard-launch (``link`` failures and ``--link``):
the spec grammar; through a real shaped link between network namespaces,
that delay, rate, loss and resets are applied and that the link is back to
normal afterwards, for connections made before the window too; cleanup of
the relay; and replica groups training through a slow, lossy window.

The shaping tests need root and iproute2 (network namespaces); skipped,
with the reason printed, elsewhere.  The parsing tests run everywhere.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from stepguard.launch import (
    FailureSpec,
    LaunchConfig,
    Launcher,
    netns_unavailable,
    parse_failure_spec,
    parse_link_spec,
)

ROOT = Path(__file__).resolve().parents[2]

# -- the grammar --


def test_link_spec_parses_every_key() -> None:
    s = parse_failure_spec(
        "link:start=10s,duration=20s,group=1,rate=100mbit,delay=20ms,jitter=5ms,loss=1%")
    assert (s.kind, s.start, s.duration, s.group) == ("link", 10.0, 20.0, 1)
    assert s.rate == 100e6 and s.delay == pytest.approx(0.02)
    assert s.jitter == pytest.approx(0.005) and s.loss == pytest.approx(0.01)
    assert s.reset == 0.0 and s.shapes_link()
    r = parse_failure_spec("link:every=30s,duration=2s,reset=100%")
    assert r.reset == 1.0 and r.rate is None and r.every == 30.0
    assert parse_failure_spec("link:start=1s,rate=1.5gbit").rate == 1.5e9
    assert parse_failure_spec("link:start=1s,rate=500KBIT").rate == 500e3
    assert parse_failure_spec("link:start=1s,loss=0.25").loss == 0.25
    st = parse_link_spec("rate=1gbit,delay=5ms")
    assert st.kind == "link" and st.group is None and st.rate == 1e9
    assert parse_link_spec("group=2,loss=0.5%").group == 2


@pytest.mark.parametrize("text,why", [
    ("link:start=1s", "needs one of"),
    ("link:duration=5s,delay=5ms", "every= or start="),
    ("link:start=1s,rate=100mb", "rate like"),
    ("link:start=1s,rate=100", "rate like"),
    ("link:start=1s,rate=1bit", "at least 8kbit"),
    ("link:start=1s,rate=-5mbit", "rate like"),
    ("link:start=1s,delay=fast", "duration like"),
    ("link:start=1s,delay=5ms,jitter=10ms", "jitter"),
    ("link:start=1s,delay=70s", "above 60"),
    ("link:start=1s,loss=101%", "between 0% and 100%"),
    ("link:start=1s,loss=-1%", "between 0% and 100%"),
    ("link:start=1s,loss=nan", "between 0% and 100%"),
    ("link:start=1s,reset=lots", "percentage"),
    ("link:start=1s,loss=1%,rank=0", "no rank"),
    ("link:start=1s,bandwidth=1gbit", "unknown key"),
    ("partition:start=1s,delay=5ms", "key of the link kind"),
    ("kill:every=1s,rate=1gbit", "key of the link kind"),
])
def test_bad_link_specs_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_failure_spec(text)


@pytest.mark.parametrize("text,why", [
    ("", "needs one of"),
    ("group=1", "needs one of"),
    ("start=5s,delay=5ms", "no schedule"),
    ("every=5s,loss=1%", "no schedule"),
    ("delay=5ms,jitter", "not key=value"),
])
def test_bad_static_links_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_link_spec(text)


def test_launcher_refuses_a_link_for_a_missing_group() -> None:
    cfg = LaunchConfig(cmd=["true"], groups=2, links=[parse_link_spec("group=2,delay=5ms")])
    with pytest.raises(ValueError, match="group 2"):
        Launcher(cfg)
    cfg = LaunchConfig(cmd=["true"], groups=2, links=[FailureSpec(kind="link")])
    with pytest.raises(ValueError, match="not a link shape"):
        Launcher(cfg)


def test_cli_rejects_a_bad_link(capsys: pytest.CaptureFixture[str]) -> None:
    from stepguard.launch import main

    assert main(["--link", "delay=5ms,jitter=9ms", "x.py"]) == 2
    assert "jitter" in capsys.readouterr().err
    assert main(["--inject", "link:start=1s,rate=fast", "x.py"]) == 2
    assert "rate like" in capsys.readouterr().err


# -- through a real shaped link --


def _why_not() -> str | None:
    why = netns_unavailable()
    if why is not None:
        return why
    probe = f"sgln{os.getpid()}x"  # the launcher's own pattern: swept if left
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                       timeout=30)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    if subprocess.run(["tc", "-V"], capture_output=True, timeout=30).returncode != 0:
        return "no tc command (iproute2)"
    return None


_WHY = _why_not()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))
if _WHY is not None:
    print(f"SKIP test_launch_links (shaping tests): {_WHY}", file=sys.stderr)


class _Servers:
    """TCP servers bound inside a namespace: ``echo`` answers every byte,
    ``sink`` reads to EOF and answers with the count (8 bytes)."""

    def __init__(self, listener: socket.socket, mode: str) -> None:
        self.listener = listener
        self.addr = listener.getsockname()
        self.mode = mode
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(120)
        n = 0
        try:
            while True:
                d = c.recv(1 << 20)
                if not d:
                    break
                n += len(d)
                if self.mode == "echo":
                    c.sendall(d)
            if self.mode == "sink":
                c.sendall(n.to_bytes(8, "little"))
        except OSError:
            pass
        finally:
            c.close()

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def _listen(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(16)
    return s


@pytest.fixture
def shaped() -> Any:
    """Two groups' namespaces (as a launch makes them) and a shaper; an
    echo and a sink server in group 0's namespace, and ``connect(g, addr)``
    to make a socket in group ``g``'s namespace (or the root one, g=None)."""
    if _WHY is not None:
        pytest.skip(_WHY)
    from stepguard.launch.links import _LinkShaper
    from stepguard.launch.netns import _Netns

    net = _Netns(2)
    net.setup()
    shaper = _LinkShaper(net)
    servers: list[_Servers] = []
    try:
        ip0 = net.ip_of(0)
        echo = _Servers(net.call_in(0, lambda: _listen(ip0)), "echo")
        sink = _Servers(net.call_in(0, lambda: _listen(ip0)), "sink")
        servers += [echo, sink]

        def connect(g: int | None, addr: tuple[str, int], timeout: float = 10) -> socket.socket:
            def make() -> socket.socket:
                return socket.create_connection(addr, timeout=timeout)
            return make() if g is None else net.call_in(g, make)

        yield {"net": net, "shaper": shaper, "echo": echo.addr, "sink": sink.addr,
               "connect": connect}
    finally:
        problems = shaper.cleanup()
        for s in servers:
            s.close()
        problems += net.cleanup()
        assert problems == []
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              timeout=30).stdout
        assert net.tag not in left


def _rtts(c: socket.socket, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.monotonic()
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        out.append(time.monotonic() - t)
    return out


def _send(connect: Callable[..., socket.socket], g: int | None, addr: tuple[str, int],
          nbytes: int) -> float:
    """Sends ``nbytes`` to a sink from group ``g``; seconds until the sink
    confirmed them all."""
    c = connect(g, addr, timeout=60)
    try:
        chunk = b"\0" * (64 << 10)
        t = time.monotonic()
        left = nbytes
        while left > 0:
            c.sendall(chunk[:left])
            left -= min(left, len(chunk))
        c.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < 8:
            d = c.recv(8 - len(got))
            assert d, "the sink closed early"
            got += d
        assert int.from_bytes(got, "little") == nbytes
        return time.monotonic() - t
    finally:
        c.close()


def _in_ns(pid: int, ns: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return False


@needs_netns
def test_delay_applies_to_open_connections_and_goes(shaped: dict) -> None:
    """A connection made before the window: its round trips take at least
    twice the delay while the link is shaped (it is added each way), and
    fall back once restored; the same connection lives throughout."""
    c = shaped["connect"](None, shaped["echo"])
    try:
        before = statistics.median(_rtts(c, 5))
        shaped["shaper"].apply(0, parse_link_spec("delay=60ms,jitter=10ms"))
        during = _rtts(c, 6)
        assert min(during) >= 2 * 0.050, during  # 2 x (60 - 10) ms at least
        net = shaped["net"]
        assert len([p for p in _all_relays() if _in_ns(p, net.hub)]) == 1
        stats = shaped["shaper"].clear(0)
        assert stats.get("recv_ab", 0) >= 6 and stats.get("recv_ba", 0) >= 6, stats
        assert [p for p in _all_relays() if _in_ns(p, net.hub)] == []
        after = statistics.median(_rtts(c, 5))
        assert after < 0.060 and before < 0.060, (before, after)
    finally:
        c.close()


@needs_netns
def test_rate_limits_both_directions_then_lifts(shaped: dict) -> None:
    """At 8 Mbit/s 2 MiB take at least 1.2 s (2.1 s at the rate) into the
    group and out of it; afterwards far less."""
    net, connect = shaped["net"], shaped["connect"]
    mib2 = 2 << 20
    sink_root = _Servers(_listen(net.host_ip), "sink")
    try:
        shaped["shaper"].apply(0, parse_link_spec("rate=8mbit"))
        into = _send(connect, None, shaped["sink"], mib2)  # root -> group 0
        out = _send(connect, 0, sink_root.addr, mib2)  # group 0 -> root
        assert into >= 1.2 and out >= 1.2, (into, out)
        assert shaped["shaper"].clear(0) == {}  # no relay for a rate alone
        fast = _send(connect, None, shaped["sink"], mib2)
        fast_out = _send(connect, 0, sink_root.addr, mib2)
        assert fast < 0.6 and fast_out < 0.6, (fast, fast_out)
        tc = subprocess.run(["tc", "-n", net.group_ns[0], "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True, timeout=30).stdout
        assert "tbf" not in tc, tc
    finally:
        sink_root.close()


def _retrans(ns: str) -> int:
    snmp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    head, vals = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


@needs_netns
def test_loss_makes_tcp_retransmit_and_everything_arrives(shaped: dict) -> None:
    """With 10% loss each way, 1 MiB from group 1 to group 0 still arrives
    whole, the relay counts lost packets, and the sender retransmitted."""
    net = shaped["net"]
    shaped["shaper"].apply(0, parse_link_spec("loss=10%"))
    r0 = _retrans(net.group_ns[1])
    _send(shaped["connect"], 1, shaped["sink"], 1 << 20)
    r1 = _retrans(net.group_ns[1])
    stats = shaped["shaper"].clear(0)
    assert stats.get("lost", 0) > 0, stats
    assert r1 > r0, (r0, r1)
    # single segments while lossy (gso_max_segs 1), restored after
    link = json.loads(subprocess.run(
        ["ip", "-n", net.group_ns[0], "-d", "-j", "link", "show", "dev", "eth0"],
        capture_output=True, text=True, timeout=30, check=True).stdout)[0]
    assert link["gso_max_segs"] > 1, link


@needs_netns
def test_reset_ends_connections_and_refuses_new_ones(shaped: dict) -> None:
    """reset=100%: an open connection gets ECONNRESET on its next segment
    and a new one is refused; once restored, connections work again."""
    connect = shaped["connect"]
    c = connect(None, shaped["echo"])
    try:
        assert _rtts(c, 1)
        shaped["shaper"].apply(0, parse_link_spec("reset=100%"))
        c.settimeout(10)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            c.sendall(b"x")
            c.recv(1)  # the RST to this side arrives in place of the echo
        with pytest.raises(ConnectionRefusedError):
            connect(1, shaped["echo"]).close()
        stats = shaped["shaper"].clear(0)
        assert stats.get("resets", 0) >= 2, stats
    finally:
        c.close()
    c2 = connect(1, shaped["echo"])
    try:
        assert len(_rtts(c2, 3)) == 3
    finally:
        c2.close()


@needs_netns
def test_relay_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    """A launcher SIGKILLed while a link window runs leaves no relay: it
    dies with its parent; and the next launch sweeps the namespaces."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys, time\n"
        "from stepguard.launch.links import _LinkShaper\n"
        "from stepguard.launch.netns import _Netns\n"
        "from stepguard.launch.spec import parse_link_spec\n"
        "net = _Netns(1); net.setup()\n"
        "_LinkShaper(net).apply(0, parse_link_spec('delay=5ms'))\n"
        "print(net.hub, flush=True)\n"
        "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        hub = p.stdout.readline().strip()
        assert hub.startswith("sgln"), hub
        relays = [pid for pid in _all_relays() if _in_ns(pid, hub)]
        assert len(relays) == 1
        p.kill()
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in relays):
            assert time.monotonic() < deadline, "the relay outlived its launcher"
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        from stepguard.launch.netns import _Netns

        _Netns.sweep()


def _all_relays() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"linkrelay.py") for a in cmd):
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
