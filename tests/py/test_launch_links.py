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
        shaped["shaper"].apply(0, parse_link_spec("delay=100ms,jitter=10ms"))
        during = _rtts(c, 6)
        assert min(during) >= 2 * 0.090, during  # 2 x (100 - 10) ms at least
        net = shaped["net"]
        assert len([p for p in _all_relays() if _in_ns(p, net.hub)]) == 1
        stats = shaped["shaper"].clear(0)
        assert stats.get("recv_ab", 0) >= 6 and stats.get("recv_ba", 0) >= 6, stats
        assert [p for p in _all_relays() if _in_ns(p, net.hub)] == []
        after = statistics.median(_rtts(c, 5))
        assert after < 0.09 and before < 0.09, (before, after)
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
def test_partition_during_a_window_cuts_and_heals(shaped: dict) -> None:
    """A partition inside a delay window: nothing crosses while cut (the
    relay lives on), the same connection carries on, still delayed, once
    healed, and at normal speed once the window ends."""
    net, c = shaped["net"], shaped["connect"](None, shaped["echo"])
    try:
        shaped["shaper"].apply(0, parse_link_spec("delay=60ms"))
        assert min(_rtts(c, 2)) >= 0.1
        net.cut(0)
        c.settimeout(1.0)
        c.sendall(b"x")
        with pytest.raises(TimeoutError):
            c.recv(1)
        net.heal(0)
        c.settimeout(20)
        assert c.recv(1) == b"x"  # retransmitted once the link is back
        assert min(_rtts(c, 3)) >= 0.1
        stats = shaped["shaper"].clear(0)
        assert "relay_exit" not in stats, stats
        assert statistics.median(_rtts(c, 5)) < 0.09
    finally:
        c.close()


@needs_netns
def test_relay_survives_garbage_frames(shaped: dict) -> None:
    """Frames the relay cannot make sense of (truncated, lying IPv4 and TCP
    headers, random bytes), sent from inside the group onto its link, pass
    or go without harm: the relay keeps running and keeps resetting."""
    import random

    net = shaped["net"]
    shaped["shaper"].apply(0, parse_link_spec("reset=100%"))
    pid = shaped["shaper"].relay_pid(0)
    eth = b"\xff" * 6 + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00"

    def ip(ihl: int, total: int, proto: int, rest: bytes) -> bytes:
        return bytes([0x40 | ihl, 0]) + total.to_bytes(2, "big") + bytes(5) + \
            bytes([proto]) + bytes(10) + rest

    frames = [eth, eth + b"\x45", eth + ip(15, 60, 6, b""), eth + ip(2, 20, 6, bytes(40)),
              eth + ip(5, 0xFFFF, 6, bytes(12) + b"\x00\x12" + bytes(6)),
              eth + ip(5, 3, 6, bytes(20)), eth + ip(5, 40, 17, bytes(20)),
              eth + ip(5, 40, 6, b"\x00\x01\x00\x02" + bytes(8) + b"\xf0\x02" + bytes(6))]
    rng = random.Random(7)
    frames += [eth + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
               for _ in range(300)]

    def blast() -> int:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        s.bind(("eth0", 0))
        try:
            for f in frames:
                s.send(f)
        finally:
            s.close()
        return len(frames)

    assert net.call_in(0, blast) == len(frames)
    time.sleep(0.5)
    assert pid is not None and _alive(pid)
    with pytest.raises(ConnectionRefusedError):
        shaped["connect"](1, shaped["echo"]).close()
    stats = shaped["shaper"].clear(0)
    assert stats.get("recv_ab", 0) >= len(frames), stats
    assert "relay_exit" not in stats, stats


def test_launcher_inject_refuses_bad_link_specs() -> None:
    """Launcher.inject checks a link spec at once: it must shape something
    and the groups must be in namespaces."""
    plain = Launcher(LaunchConfig(cmd=["true"], groups=1))
    with pytest.raises(ValueError, match="network namespaces"):
        plain.inject(parse_failure_spec("link:start=1s,delay=5ms"))
    with pytest.raises(ValueError, match="needs one of"):
        plain.inject(FailureSpec(kind="link", start=0.0))


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
        from stepguard.launch.netns import _NS_LOCK, _host_lock, _Netns

        with _host_lock(_NS_LOCK):  # as a launch's setup sweeps
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


# -- the launcher --

# Times TCP connects to the lighthouse (one round trip each) and reports
# them, until told to stop; no torch.
RTT_WORKER = r'''
import os, socket, sys, time
from stepguard.launch import report, stop_step

host, port = os.environ["TORCHFT_LIGHTHOUSE"].split("//")[1].rsplit(":", 1)
group = int(os.environ["REPLICA_GROUP_ID"])
step = 0
while True:
    stop = stop_step()
    if stop is not None and step >= stop:
        sys.exit(0)
    t = time.time()
    t0 = time.monotonic()
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        report("rtt", group=group, t=t, rtt=time.monotonic() - t0)
    except OSError as e:
        report("rtt_failed", group=group, t=t, error=str(e))
    time.sleep(0.05)
    report("step", group=group, step=step, committed=True, participants=2)
    step += 1
'''


@needs_netns
def test_cli_static_link_and_a_window(tmp_path: Path) -> None:
    """``--link group=0,delay=60ms`` slows group 0's round trips for the
    whole run; ``--inject link:...,group=1,delay=60ms`` slows group 1's for
    the window only: inside it every connect takes >= 2 x 55 ms, after it
    (and before it) half that (median).  The timeline has the static ``link``,
    the ``inject`` and ``link_end`` records; nothing is left behind."""
    worker = tmp_path / "rtt_worker.py"
    worker.write_text(RTT_WORKER)
    tl_path = tmp_path / "tl.jsonl"
    p = subprocess.Popen(
        [sys.executable, "-m", "stepguard.launch", "--groups", "2", "--quiet",
         "--timeline", str(tl_path), "--log-dir", str(tmp_path / "logs"),
         "--stop-file", str(tmp_path / "stop"), "--duration", "120",
         "--link", "group=0,delay=60ms,jitter=5ms",
         "--inject", "link:start=1s,duration=3s,group=1,delay=60ms,jitter=5ms",
         str(worker)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 150
        while True:
            tl = _timeline(tl_path)
            ends = _of(tl, "link_end")
            if ends and [r for r in _of(tl, "rtt", group=1) if r["t"] > ends[0]["t"] + 1.5]:
                break
            assert p.poll() is None, p.stderr.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, [r["event"] for r in tl][-20:]
            time.sleep(0.2)
        p.terminate()
        assert p.wait(timeout=60) == 143
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    tl = _timeline(tl_path)
    static = _of(tl, "link")
    assert [r["group"] for r in static] == [0] and static[0]["delay_s"] == 0.06
    inj = _of(tl, "inject", kind="link")
    assert len(inj) == 1 and inj[0]["group"] == 1 and "relay" in inj[0]["mechanism"]
    end = _of(tl, "link_end", failure=inj[0]["failure"])
    assert len(end) == 1 and end[0]["relay"].get("recv_ab", 0) > 0, end
    t0, t1 = inj[0]["t"], end[0]["t"]
    g0 = [r["rtt"] for r in _of(tl, "rtt", group=0)]
    assert g0 and min(g0) >= 0.11, g0
    g1 = _of(tl, "rtt", group=1)
    inside = [r["rtt"] for r in g1 if t0 + 0.2 < r["t"] and r["t"] + r["rtt"] < t1 - 0.2]
    outside = [r["rtt"] for r in g1 if r["t"] > t1 + 0.5 or r["t"] + r["rtt"] < t0]
    assert inside and min(inside) >= 0.11, inside
    assert outside and statistics.median(outside) < 0.055, outside
    assert not _of(tl, "rtt_failed")
    assert tl[-1]["event"] == "end" and tl[-1]["cleanup_problems"] == []
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout
    assert f"sgln{p.pid}" not in left
    relays = [static[0]["relay_pid"], inj[0]["relay_pid"]]
    assert all(isinstance(pid, int) for pid in relays), relays
    assert not any(_alive(pid) for pid in relays)


# -- replica groups through a shaped window --

TRAIN = str(ROOT / "examples" / "train_llama.py")
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--hidden", "64",
        "--seq-len", "32", "--batch-size", "4"]


def _timeline(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _of(tl: list[dict], event: str, **match: Any) -> list[dict]:
    return [r for r in tl if r["event"] == event
            and all(r.get(k) == v for k, v in match.items())]


@pytest.mark.long
@needs_netns
def test_groups_keep_committing_through_a_slow_lossy_window(tmp_path: Path) -> None:
    """Two groups train a tiny Llama; once both commit together, group 1's
    link gets 20 ms +- 5 ms each way, 5% loss and 50 Mbit/s for 4 s.  Both
    keep committing as two through the window (the relay lost packets on
    the way: TCP carried on), the link is restored and the timeline says
    so, and the replicas end bit-identical."""
    spec = parse_failure_spec(
        "link:start=600s,duration=4s,group=1,rate=50mbit,delay=20ms,jitter=5ms,loss=5%")
    seen: dict[str, float] = {}
    launcher: Launcher | None = None

    def on_event(rec: dict) -> None:
        assert launcher is not None
        ev = rec["event"]
        if ev == "commit" and rec.get("participants") == 2 and "inject" not in seen:
            seen.setdefault(f"full{rec['group']}", rec["t"])
            if all(f"full{g}" in seen for g in range(2)):
                seen["inject"] = rec["t"]
                launcher.injectors[0].next_at = launcher.elapsed()  # now
        if ev == "link_end":
            seen["end"] = rec["t"]
        if (ev == "commit" and "end" in seen and rec["t"] > seen["end"] + 0.5
                and rec.get("participants") == 2 and not launcher._finishing):
            launcher.finish(step=rec["step"] + 3)

    cfg = LaunchConfig(
        cmd=[sys.executable, TRAIN, *TINY, "--pg", "tcp", "--pg-timeout", "10",
             "--timeout", "10", "--quorum-timeout", "10", "--step-sleep", "0.1",
             "--save-dir", str(tmp_path / "params")],
        groups=2, failures=[spec], heartbeat_timeout_ms=5000, min_replicas=2,
        timeline=str(tmp_path / "tl.jsonl"), log_dir=str(tmp_path / "logs"),
        stop_file=str(tmp_path / "stop"), quiet=True, duration=150, omp_threads=1)
    launcher = Launcher(cfg, on_event=on_event)
    rc = launcher.run()
    tl = _timeline(tmp_path / "tl.jsonl")
    assert rc == 0 and not _of(tl, "duration_reached"), \
        [r for r in tl if r["event"] not in ("commit", "discard")][-20:]
    inj = _of(tl, "inject", kind="link")
    assert len(inj) == 1 and inj[0]["group"] == 1, inj
    assert inj[0]["loss"] == 0.05 and inj[0]["rate_bit_s"] == 50e6
    assert "relay" in inj[0]["mechanism"] and "tbf" in inj[0]["mechanism"]
    end = _of(tl, "link_end", failure=inj[0]["failure"])
    assert len(end) == 1 and 3.5 < end[0]["t"] - inj[0]["t"] < 10, end
    relay = end[0]["relay"]
    assert relay.get("recv_ab", 0) > 100 and relay.get("recv_ba", 0) > 100, relay
    assert relay.get("lost", 0) > 0, relay
    t0, t1 = inj[0]["t"], end[0]["t"]
    commits = _of(tl, "commit")
    for g in (0, 1):
        inside = [c for c in commits if c["group"] == g and t0 < c["t"] < t1
                  and c["participants"] == 2]
        assert len(inside) >= 3, (g, len(inside))
    assert not _of(tl, "restart"), "no group should have needed a restart"
    back = _of(tl, "recovery", kind="link_end", failure=inj[0]["failure"])
    assert len(back) == 1 and back[0]["group"] == 1 and back[0]["t"] > t1
    import torch

    saved = [torch.load(tmp_path / "params" / f"params_g{g}_r0.pt") for g in range(2)]
    assert len({s["step"] for s in saved}) == 1
    for name, t in saved[0]["params"].items():
        assert torch.equal(t, saved[1]["params"][name]), name
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout
    assert f"sgln{os.getpid()}" not in left
