"""Striping pays off on real links: two sources behind rate-limited links
(network namespaces, veth pairs shaped with tc tbf) serve a healer faster
than one.  Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from stepguard.checkpointing.native_transport import NativeTransport

RATE = "400mbit"  # per source link: 50 MB/s
MB = 48  # state size in MiB: about a second over one link

_SERVE = r"""
import sys, time
from datetime import timedelta
import torch
from stepguard.checkpointing.native_transport import NativeTransport
host, mb = sys.argv[1], int(sys.argv[2])
sd = {"w": torch.randn(mb << 18, generator=torch.Generator().manual_seed(3))}
t = NativeTransport(timedelta(seconds=60), hostname=host, bind=host + ":0")
t.send_checkpoint([1], 4, sd, timedelta(seconds=60))
print(t.metadata(), flush=True)
sys.stdin.read()  # until the test closes our stdin
t.shutdown()
"""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class _Net:
    """Namespaces sgA/sgB<pid>, each linked to this one by a shaped veth."""

    def __init__(self) -> None:
        base = (os.getpid() % 100) * 2 + 20
        self.names: list[str] = []
        self.links: list[str] = []
        self.hosts: list[str] = []
        for i, tag in enumerate("AB"):
            ns = f"sgck{tag}{os.getpid()}"
            outer, inner = f"sgk{tag}{os.getpid() % 100000}o", f"sgk{tag}i"
            net = f"10.213.{base + i}"
            _run("ip", "netns", "add", ns)
            self.names.append(ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "addr", "add", f"{net}.1/24", "dev", outer)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # shape what the source sends towards the healer
            _run(
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner,
                "root", "tbf", "rate", RATE, "burst", "256kb", "latency", "100ms",
            )  # fmt: skip
            self.hosts.append(f"{net}.2")

    def close(self) -> None:
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def net():
    reason = None
    if os.geteuid() != 0:
        reason = "needs root for network namespaces"
    elif not shutil.which("ip") or not shutil.which("tc"):
        reason = "needs iproute2 (ip, tc)"
    n = None
    if reason is None:
        try:
            n = _Net()
        except (subprocess.SubprocessError, OSError) as e:
            err = getattr(e, "stderr", b"") or b""
            reason = f"cannot make namespaces: {e} {err.decode(errors='replace')}"
    if reason:
        if n:
            n.close()
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    try:
        yield n
    finally:
        n.close()


def test_two_shaped_sources_beat_one(net, procs, monkeypatch) -> None:
    # the namespaces share this host's pid namespace: without this the
    # healer would copy from the sources' memory and never touch the links
    monkeypatch.setenv("STEPGUARD_SAME_HOST", "0")
    metas = []
    for ns, host in zip(net.names, net.hosts):
        # `ip netns exec` execs the interpreter: the pid is the source's
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", _SERVE, host, str(MB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.popens.append(p)
        line = p.stdout.readline().strip()
        assert line.startswith("http://") and "/sgckpt=" in line, line
        metas.append(line)
    expect = torch.randn(MB << 18, generator=torch.Generator().manual_seed(3))
    healer = NativeTransport(timedelta(seconds=60), streams_per_source=2)
    try:
        times = {}
        runs = [("one", metas[:1]), ("two", metas), ("one", metas[1:])]
        for label, sources in runs:
            t0 = time.monotonic()
            got = healer.recv_checkpoint_striped(sources, 4, timedelta(seconds=60))
            dt = time.monotonic() - t0
            times.setdefault(label, []).append(dt)
            assert torch.equal(got["w"], expect)
            if label == "two":
                split = healer.last_recv_bytes
                assert all(b > 0 for b in split), split
                assert sum(split) == MB << 20
                assert healer.last_recv_stats["tcp_bytes"] == MB << 20
        one, two = min(times["one"]), times["two"][0]
        print(
            f"\n{MB} MiB over {RATE} links: one source {one:.2f}s, "
            f"two sources {two:.2f}s ({one / two:.2f}x), split {split}"
        )
        # the shaped link bounds one source at ~1 s; two should take ~half
        assert two < 0.75 * one, times
    finally:
        healer.shutdown()
        for p in procs.popens:
            if p.stdin:
                p.stdin.close()
