"""What the launcher's link relay costs: bulk TCP throughput and round
trips between two groups' network namespaces (as ``stepguard-launch``
makes them), through the plain veth/bridge path (the limit) and through
the userspace packet relay of ``link`` windows, in the same run:

- ``veth``: no shaping, the kernel alone;
- ``relay``: the relay passing every frame (a 1 us delay: nothing held in
  practice), frames as the kernel hands them over (segmentation bursts of
  up to 64 KiB);
- ``relay, single segments``: the same with ``loss`` set (1e-9: nothing
  lost in practice), which makes the kernel hand over one segment per
  frame (``gso_max_segs 1``);
- ``netem`` (the kernel's own shaper, what the relay stands in for), only
  where the kernel has it (these machines' do not: reported as missing).

Throughput: MIB MiB from group 1 to a sink in group 0, until the sink
confirms the count; round trip: a 1-byte TCP ping-pong.  Medians of
--iters runs.  Needs root and iproute2.

    python bench/links.py [--iters 5] [--mib 64]

Results: bench/results/links.json and bench/results/links.md.  Prints
medians and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "links.json"
TABLE = HERE / "results" / "links.md"


def _serve(listener: socket.socket, mode: str) -> None:
    def one(c: socket.socket) -> None:
        c.settimeout(300)
        n = 0
        try:
            while True:
                d = c.recv(1 << 20)
                if not d:
                    break
                n += len(d)
                if mode == "echo":
                    c.sendall(d)
            if mode == "sink":
                c.sendall(n.to_bytes(8, "little"))
        except OSError:
            pass
        finally:
            c.close()

    while True:
        try:
            c, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(c,), daemon=True).start()


def _listen(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(8)
    return s


def _throughput(net: Any, addr: tuple[str, int], nbytes: int) -> float:
    c = net.call_in(1, lambda: socket.create_connection(addr, timeout=300))
    try:
        chunk = b"\0" * (1 << 20)
        t = time.monotonic()
        left = nbytes
        while left > 0:
            c.sendall(chunk[:left])
            left -= min(left, len(chunk))
        c.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < 8:
            d = c.recv(8 - len(got))
            if not d:
                raise RuntimeError("the sink closed early")
            got += d
        if int.from_bytes(got, "little") != nbytes:
            raise RuntimeError("the sink got a different count")
        return nbytes * 8 / (time.monotonic() - t) / 1e9  # Gbit/s
    finally:
        c.close()


def _rtt(net: Any, addr: tuple[str, int], n: int = 200) -> float:
    c = net.call_in(1, lambda: socket.create_connection(addr, timeout=60))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        out = []
        for _ in range(n):
            t = time.monotonic()
            c.sendall(b"x")
            if c.recv(1) != b"x":
                raise RuntimeError("echo failed")
            out.append(time.monotonic() - t)
        return statistics.median(out) * 1e6  # us
    finally:
        c.close()


def _netem_missing(hub: str) -> str | None:
    p = subprocess.run(["tc", "-n", hub, "qdisc", "add", "dev", "g0", "root", "netem",
                        "delay", "0ms"], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return p.stderr.strip() or "tc netem failed"
    subprocess.run(["tc", "-n", hub, "qdisc", "del", "dev", "g0", "root"],
                   capture_output=True, timeout=30)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    a = ap.parse_args()
    from stepguard.launch.links import _LinkShaper
    from stepguard.launch.netns import _Netns, netns_unavailable
    from stepguard.launch.spec import parse_link_spec

    why = netns_unavailable()
    if why is not None:
        print(f"bench/links.py: skipped: {why}")
        return 0
    net = _Netns(2)
    net.setup()
    shaper = _LinkShaper(net)
    results: dict[str, Any] = {"mib": a.mib, "iters": a.iters, "rows": []}
    try:
        ip0 = net.ip_of(0)
        sink = net.call_in(0, lambda: _listen(ip0))
        echo = net.call_in(0, lambda: _listen(ip0))
        for lst, mode in ((sink, "sink"), (echo, "echo")):
            threading.Thread(target=_serve, args=(lst, mode), daemon=True).start()
        missing = _netem_missing(net.hub)
        setups: list[tuple[str, Any]] = [
            ("veth", None),
            ("relay", parse_link_spec("delay=0.001ms")),
            ("relay, single segments", parse_link_spec("loss=0.0000001%")),
        ]
        if missing is None:
            setups.append(("netem", "netem"))
        for name, shape in setups:
            if shape == "netem":
                subprocess.run(["tc", "-n", net.hub, "qdisc", "add", "dev", "g0", "root",
                                "netem", "delay", "0ms"], check=True, timeout=30)
            elif shape is not None:
                shaper.apply(0, shape)
            try:
                gbit = [_throughput(net, sink.getsockname(), a.mib << 20)
                        for _ in range(a.iters)]
                rtt = [_rtt(net, echo.getsockname()) for _ in range(a.iters)]
            finally:
                if shape == "netem":
                    subprocess.run(["tc", "-n", net.hub, "qdisc", "del", "dev", "g0",
                                    "root"], timeout=30)
                elif shape is not None:
                    shaper.clear(0)
            results["rows"].append({"path": name, "gbit_s": statistics.median(gbit),
                                    "rtt_us": statistics.median(rtt),
                                    "gbit_s_runs": gbit, "rtt_us_runs": rtt})
        if missing is not None:
            results["netem"] = f"not available: {missing}"
    finally:
        shaper.cleanup()
        net.cleanup()
    base = results["rows"][0]
    lines = [f"{a.mib} MiB group 1 -> group 0, medians of {a.iters}", "",
             "| path | Gbit/s | x veth | round trip (us) | + vs veth (us) |",
             "|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['path']} | {r['gbit_s']:.2f} | {r['gbit_s'] / base['gbit_s']:.2f} "
                     f"| {r['rtt_us']:.0f} | {r['rtt_us'] - base['rtt_us']:+.0f} |")
    if "netem" in results:
        lines += ["", f"netem (the kernel's shaper): {results['netem']}"]
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    TABLE.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
