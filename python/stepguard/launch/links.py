"""Link shaping for the ``link`` failure kind and ``--link``: rate, delay,
jitter, loss and connection resets on one replica group's network link.

Works on the namespaces of :mod:`stepguard.launch.netns` (so it needs what
they need: root, ``ip``; and ``tc`` for a rate).  One :class:`_LinkShaper`
per launch shapes and restores the groups' links:

- ``rate``: a ``tc tbf`` qdisc on both ends of the group's veth pair, its
  ``eth0`` in the group's namespace (what the group sends) and ``g<G>`` in
  the hub (what it receives), so each direction gets the rate.
- ``delay``, ``jitter``, ``loss``, ``reset``: ``tc netem`` would be the
  kernel's way, but these machines' kernels lack it (and modules cannot be
  loaded), so a userspace packet relay does it
  (:mod:`stepguard.launch.linkrelay`, a process of its own).  While it runs,
  the group's hub port ``g<G>`` leaves the bridge, a veth pair ``s<G>`` /
  ``t<G>`` joins it (``t<G>`` on the bridge), and the relay copies every
  frame between ``g<G>`` and ``s<G>`` through ``AF_PACKET`` sockets,
  holding, dropping or answering with resets on the way.  When the window
  ends ``g<G>`` goes back on the bridge and the relay and the pair go.

  Why a packet relay and not a TCP proxy: a TCP proxy sees only new
  connections (redirected by iptables/nftables NAT rules, which are not
  installed on these machines either), while training keeps its
  connections (the collectives' mesh, the lighthouse's HTTP/2 stream) for
  the whole quorum: a window opened mid-run would change nothing on them.
  A relay of frames shapes every packet of every connection, old and new,
  TCP or not, needs no addresses of its own and nothing from netfilter, and
  both ends keep their addresses and MACs (the bridge relearns the port),
  so established connections live through the switch in either direction.
  Its cost: a Python loop per frame; frames keep their offload headers,
  so one is up to 64 KiB, and bulk TCP still moves 1-2 Gbit/s through it,
  0.3-0.8 Gbit/s when ``loss`` makes the kernel hand over single segments,
  with tens of microseconds added to a round trip (``bench/links.py``,
  quoted in ``docs/demo.md``).

The group keeps its loopback throughout (its ranks and store are not
shaped), as with a partition.  Everything created lives in the launch's hub
and group namespaces and goes with them; the relay processes are ended by
:meth:`_LinkShaper.cleanup` and also die with the launcher's thread
(``PR_SET_PDEATHSIG``) or when their standard input closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepguard.launch.netns import _ip, _Netns
from stepguard.launch.spec import FailureSpec

__all__ = ["links_unavailable"]

_RELAY = str(Path(__file__).with_name("linkrelay.py"))
_TC_TIMEOUT = 30.0  # seconds for one `tc` command
_RELAY_START = 30.0  # seconds for a relay to open its sockets
_RELAY_STOP = 5.0  # seconds for a relay to report and exit after SIGTERM
_TBF_LATENCY = "100ms"  # tbf queue: what it holds before dropping
_PR_SET_PDEATHSIG = 1


def links_unavailable(spec: FailureSpec) -> str | None:
    """Why ``spec``'s link shape cannot be made on this host (None: it can);
    the namespaces' own needs are :func:`netns_unavailable`'s."""
    if spec.rate is not None and shutil.which("tc") is None:
        return "a link rate needs the 'tc' command (iproute2)"
    return None


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True,
                           timeout=_TC_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: no answer in "
                           f"{_TC_TIMEOUT:.0f} s") from None
    if check and p.returncode != 0:
        why = p.stderr.strip() or f"exit status {p.returncode}"
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {why}")
    return p


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _tbf_args(rate: float) -> list[str]:
    # The bucket holds 10 ms at the rate, and at least 64 KiB (one
    # segmentation burst; tbf splits bigger ones).
    burst = max(65536, int(rate / 8 / 100))
    return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "latency", _TBF_LATENCY]


@dataclass
class _Shaped:
    """What is in effect on one group's link."""

    spec: FailureSpec
    tbf: bool = False
    relay: subprocess.Popen | None = None
    pair: bool = False  # s<G>/t<G> exist
    detached: bool = False  # g<G> is off the bridge
    gso_segs: int | None = None  # eth0's gso_max_segs before we set 1


class _LinkShaper:
    """Shapes and restores the links of one launch's groups (see above)."""

    def __init__(self, net: _Netns) -> None:
        self.net = net
        self.shaped: dict[int, _Shaped] = {}

    @staticmethod
    def mechanism(spec: FailureSpec) -> str:
        parts = []
        if spec.rate is not None:
            parts.append("tc tbf on both ends of the veth")
        if spec.delay > 0 or spec.jitter > 0 or spec.loss > 0 or spec.reset > 0:
            parts.append("userspace packet relay (AF_PACKET) in the hub")
        return " + ".join(parts)

    def relay_pid(self, g: int) -> int | None:
        """The pid of group ``g``'s relay process, while one runs."""
        st = self.shaped.get(g)
        return st.relay.pid if st is not None and st.relay is not None else None

    def apply(self, g: int, spec: FailureSpec, seed: int = 0) -> None:
        """Shapes group ``g``'s link as ``spec`` says, replacing any shape it
        had.  Raises RuntimeError (after undoing what it did) when something
        cannot be made."""
        if not spec.shapes_link():
            raise ValueError(f"{spec!r} shapes nothing")
        if g in self.shaped:
            self.clear(g)
        st = _Shaped(spec)
        self.shaped[g] = st
        try:
            if spec.rate is not None:
                st.tbf = True
                args = _tbf_args(spec.rate)
                _tc(self.net.hub, "qdisc", "replace", "dev", f"g{g}", "root", *args)
                _tc(self.net.group_ns[g], "qdisc", "replace", "dev", "eth0", "root", *args)
            if spec.delay > 0 or spec.jitter > 0 or spec.loss > 0 or spec.reset > 0:
                self._start_relay(g, st, seed)
        except BaseException:
            with contextlib.suppress(RuntimeError):
                self.clear(g)  # its own failures would hide the cause
            raise

    def _start_relay(self, g: int, st: _Shaped, seed: int) -> None:
        hub, ns, spec = self.net.hub, self.net.group_ns[g], st.spec
        s, t = f"s{g}", f"t{g}"
        _ip("-n", hub, "link", "add", s, "type", "veth", "peer", "name", t)
        st.pair = True
        if spec.loss > 0:
            # Single segments, so that one loss is one packet's: the group
            # stops handing its eth0 bursts, and the bridge splits the ones
            # it forwards to the relay.
            link = json.loads(_ip("-n", ns, "-d", "-j", "link", "show", "dev", "eth0").stdout)
            st.gso_segs = int(link[0].get("gso_max_segs", 65535))
            _ip("-n", ns, "link", "set", "dev", "eth0", "gso_max_segs", "1")
            _ip("-n", hub, "link", "set", "dev", t, "gso_max_segs", "1")
        _ip("-n", hub, "link", "set", t, "master", "br0", "up")
        _ip("-n", hub, "link", "set", s, "up")
        argv = ["ip", "netns", "exec", hub, sys.executable, "-I", _RELAY,
                "--a", f"g{g}", "--b", s, "--delay", repr(spec.delay),
                "--jitter", repr(spec.jitter), "--loss", repr(spec.loss),
                "--reset", repr(spec.reset), "--seed", str(seed)]
        st.relay = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True, preexec_fn=_die_with_parent)
        line = _read_line(st.relay, _RELAY_START)
        if line is None or not line.get("ready"):
            err = _stderr_of(st.relay)
            raise RuntimeError(f"the link relay of group {g} did not start"
                               + (f": {err}" if err else ""))
        # From here the group's frames reach the bridge only through it.
        _ip("-n", hub, "link", "set", f"g{g}", "nomaster")
        st.detached = True

    def clear(self, g: int) -> dict[str, Any]:
        """Restores group ``g``'s link (idempotent); returns the relay's
        counters (frames each way, lost, resets, dropped), if one ran.
        Raises RuntimeError when a step fails, after trying every step."""
        st = self.shaped.pop(g, None)
        if st is None:
            return {}
        hub, ns = self.net.hub, self.net.group_ns[g]
        problems: list[str] = []
        stats: dict[str, Any] = {}

        def step(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except (RuntimeError, OSError) as e:
                problems.append(str(e))

        if st.detached:
            step(_ip, "-n", hub, "link", "set", f"g{g}", "master", "br0")
        if st.relay is not None:
            stats = _stop(st.relay)
        if st.pair:
            step(_ip, "-n", hub, "link", "del", f"s{g}")
        if st.gso_segs is not None:
            step(_ip, "-n", ns, "link", "set", "dev", "eth0", "gso_max_segs", str(st.gso_segs))
        if st.tbf:
            step(_tc, hub, "qdisc", "del", "dev", f"g{g}", "root")
            step(_tc, ns, "qdisc", "del", "dev", "eth0", "root")
        if problems:
            raise RuntimeError(f"restoring group {g}'s link: " + "; ".join(problems))
        return stats

    def cleanup(self) -> list[str]:
        """Ends every relay and restores every link; returns the problems
        met, as text (the namespaces, going next, take the rest)."""
        problems: list[str] = []
        for g in list(self.shaped):
            try:
                self.clear(g)
            except RuntimeError as e:
                problems.append(str(e))
        return problems


def _read_line(p: subprocess.Popen, timeout: float) -> dict[str, Any] | None:
    """The next JSON line of ``p``'s stdout within ``timeout`` s, or None."""
    out: queue.Queue[bytes] = queue.Queue()
    assert p.stdout is not None
    stream = p.stdout

    def read() -> None:
        with contextlib.suppress(ValueError, OSError):
            out.put(stream.readline())

    threading.Thread(target=read, name="link-relay", daemon=True).start()
    try:
        raw = out.get(timeout=timeout)
    except queue.Empty:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _stderr_of(p: subprocess.Popen) -> str:
    """Ends ``p`` and returns the end of what it wrote to stderr."""
    _kill(p)
    assert p.stderr is not None
    try:
        return p.stderr.read().decode("utf-8", "replace").strip()[-2000:]
    except (OSError, ValueError):
        return ""


def _kill(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=_RELAY_STOP)
    for f in (p.stdin, p.stdout):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def _stop(p: subprocess.Popen) -> dict[str, Any]:
    """Asks the relay to stop (SIGTERM), reads its counters and reaps it;
    SIGKILL when it does not answer within _RELAY_STOP."""
    stats: dict[str, Any] = {}
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
        rec = _read_line(p, _RELAY_STOP)
        if rec is not None:
            stats = rec
    else:  # it died during the window: say so
        stats = {"relay_exit": p.returncode, "relay_stderr": _stderr_of(p)}
    _kill(p)
    if p.stderr is not None:
        with contextlib.suppress(OSError):
            p.stderr.close()
    return stats
