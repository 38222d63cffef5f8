"""The packet relay behind the launcher's ``link`` shaping (stdlib only).

Run by :mod:`stepguard.launch.links` as a script, inside the hub network
namespace: ``python linkrelay.py --a IF --b IF [--delay S] [--jitter S]
[--loss P] [--reset P] [--seed N]``.  It copies every Ethernet frame that
arrives on interface ``a`` out of interface ``b`` and back, through two
``AF_PACKET`` sockets, and on the way

- holds each frame for ``delay`` +- ``jitter`` seconds (uniform), never
  reordering frames of one direction (a frame leaves no earlier than the
  one before it);
- drops a fraction ``loss`` of the IPv4 frames (ARP and the rest pass);
- turns a fraction ``reset`` of the TCP segments (other than resets) into
  a pair of RSTs: one to the segment's receiver, in the segment's place,
  with the sequence number it expects next, and one back to its sender,
  with the sequence number the sender expects next (both are known
  exactly, since every segment of the connection passes here), so both
  ends see ``ECONNRESET``; a SYN so hit is answered with RST+ACK (the
  connect is refused).

The sockets use ``PACKET_VNET_HDR``: each frame comes with its offload
header (a TCP segmentation burst of up to 64 KiB, a checksum the kernel
has yet to fill in) and goes out with it unchanged, so the kernel does the
checksums and the segmentation, and a Python loop keeps up with Gbit/s of
bulk TCP (``bench/links.py``).  When ``loss`` is set the launcher makes
the kernel hand over single segments instead (``gso_max_segs 1``), so a
loss is one packet's.

It prints one JSON line ``{"ready": true}`` once both sockets are open,
and on SIGTERM or SIGINT (or when its standard input closes) one JSON line
of counters, then exits.  Frames that cannot be sent at once (the other
side's queue is full, ``send_drops``) or that would make the frames held
for a delay exceed 64 MiB in one direction (``queue_drops``) are dropped
and counted, as a full router queue would drop them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_VNET_HDR = 15
VNET_LEN = 10  # struct virtio_net_hdr
ETH_LEN = 14
_MAX_FRAME = VNET_LEN + 65536 + ETH_LEN + 64
_BATCH = 64  # frames read from one socket before looking at the other
_MAX_FLOWS = 65536  # tracked TCP flows; the table is cleared when full
_MAX_QUEUED = 64 << 20  # bytes held per direction; frames beyond are dropped


def _ifindex(name: str) -> int:
    return socket.if_nametoindex(name)


def _open(name: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    # Frames for any MAC address (the group's peers', not this namespace's).
    mreq = struct.pack("iHH8s", _ifindex(name), PACKET_MR_PROMISC, 0, b"")
    s.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.bind((name, ETH_P_ALL))
    s.setblocking(False)
    return s


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _rst(eth_dst: bytes, eth_src: bytes, ip_src: bytes, ip_dst: bytes, sport: int,
         dport: int, seq: int, ack: int | None) -> bytes:
    """One IPv4 TCP RST frame (with a zero offload header); RST+ACK when
    ``ack`` is given."""
    flags = 0x04 | (0x10 if ack is not None else 0)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq & 0xFFFFFFFF, (ack or 0) & 0xFFFFFFFF,
                      5 << 4, flags, 0, 0, 0)
    pseudo = ip_src + ip_dst + struct.pack("!BBH", 0, 6, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", _csum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0,
                     ip_src, ip_dst)
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return bytes(VNET_LEN) + eth_dst + eth_src + b"\x08\x00" + ip + tcp


def _seq_after(a: int, b: int) -> bool:
    """a comes after b in TCP's modulo-2^32 sequence space."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000


class Relay:
    def __init__(self, a: str, b: str, delay: float, jitter: float, loss: float,
                 reset: float, seed: int) -> None:
        self.socks = [_open(a), _open(b)]
        self.delay = delay
        self.jitter = jitter
        self.loss = loss
        self.reset = reset
        self.rng = random.Random(seed)
        # One queue per direction: index 0 carries a -> b, 1 carries b -> a.
        self.queues: list[collections.deque[tuple[float, bytes]]] = [
            collections.deque(), collections.deque()]
        self.last_release = [0.0, 0.0]
        self.queued = [0, 0]  # bytes held, per direction
        # (src ip, src port, dst ip, dst port) -> next sequence number.
        self.next_seq: dict[tuple[bytes, int, bytes, int], int] = {}
        self.stats: dict[str, int] = collections.defaultdict(int)
        self.stop = False

    def _release_at(self, d: int, now: float) -> float:
        if self.delay <= 0 and self.jitter <= 0:
            return now
        at = now + max(0.0, self.delay + self.rng.uniform(-self.jitter, self.jitter))
        at = max(at, self.last_release[d])
        self.last_release[d] = at
        return at

    def _send(self, d: int, frame: bytes) -> None:
        try:
            self.socks[1 - d].send(frame)
            self.stats[f"sent_{'ab'[d]}{'ba'[d]}"] += 1
        except (BlockingIOError, OSError):
            self.stats["send_drops"] += 1

    def _enqueue(self, d: int, frame: bytes, now: float) -> None:
        at = self._release_at(d, now)
        if at <= now and not self.queues[d]:
            self._send(d, frame)
        elif self.queued[d] + len(frame) > _MAX_QUEUED:
            self.stats["queue_drops"] += 1
        else:
            self.queues[d].append((at, frame))
            self.queued[d] += len(frame)

    def _frame(self, d: int, frame: bytes, now: float) -> None:
        ethertype = frame[VNET_LEN + 12:VNET_LEN + 14]
        if len(frame) < VNET_LEN + ETH_LEN + 20 or ethertype != b"\x08\x00":
            self._enqueue(d, frame, now)  # not IPv4: passes untouched
            return
        if self.loss > 0 and self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        ip = VNET_LEN + ETH_LEN
        ihl = (frame[ip] & 0x0F) * 4
        tcp = ip + ihl
        fragment = struct.unpack_from("!H", frame, ip + 6)[0] & 0x1FFF
        if frame[ip + 9] != 6 or fragment or ihl < 20 or len(frame) < tcp + 20:
            self._enqueue(d, frame, now)
            return
        src, dst = frame[ip + 12:ip + 16], frame[ip + 16:ip + 20]
        sport, dport, seq, ack, off, flags = struct.unpack_from("!HHIIBB", frame, tcp)
        total = struct.unpack_from("!H", frame, ip + 2)[0]
        hdr = (off >> 4) * 4
        # The IPv4 total length (a frame may carry padding), unless it is 0
        # (a burst above 64 KiB): then the frame's length.
        payload = total - ihl - hdr if total >= ihl + hdr else len(frame) - tcp - hdr
        end = (seq + max(payload, 0) + (1 if flags & 0x02 else 0)
               + (1 if flags & 0x01 else 0)) & 0xFFFFFFFF
        key = (src, sport, dst, dport)
        old = self.next_seq.get(key)
        if old is None or _seq_after(end, old):
            if len(self.next_seq) >= _MAX_FLOWS:
                self.next_seq.clear()
            self.next_seq[key] = end
        if flags & 0x04 or self.reset <= 0 or self.rng.random() >= self.reset:
            self._enqueue(d, frame, now)
            return
        # Reset this connection: the segment's receiver gets a RST in its
        # place; its sender gets one back, after what is queued towards it.
        self.stats["resets"] += 1
        eth = VNET_LEN
        mac_dst, mac_src = frame[eth:eth + 6], frame[eth + 6:eth + 12]
        back = self.next_seq.get((dst, dport, src, sport))
        if flags & 0x10:  # ACK set: the sender expects `ack` (or later)
            theirs = back if back is not None and _seq_after(back, ack) else ack
            self._enqueue(1 - d, _rst(mac_src, mac_dst, dst, src, dport, sport,
                                      theirs, None), now)
            mine = old if old is not None and _seq_after(old, seq) else seq
            self._enqueue(d, _rst(mac_dst, mac_src, src, dst, sport, dport, mine, None), now)
        else:  # a SYN: nothing to reset yet on the other side; refuse it
            self._enqueue(1 - d, _rst(mac_src, mac_dst, dst, src, dport, sport, 0,
                                      end), now)

    def _release(self, now: float) -> float | None:
        """Sends what is due; returns when the next frame is due."""
        nxt: float | None = None
        for d, q in enumerate(self.queues):
            while q and q[0][0] <= now:
                frame = q.popleft()[1]
                self.queued[d] -= len(frame)
                self._send(d, frame)
            if q and (nxt is None or q[0][0] < nxt):
                nxt = q[0][0]
        return nxt

    def run(self) -> None:
        poller = select.poll()
        fds = {}
        for i, s in enumerate(self.socks):
            poller.register(s.fileno(), select.POLLIN)
            fds[s.fileno()] = i
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        while not self.stop:
            now = time.monotonic()
            nxt = self._release(now)
            timeout = 200.0 if nxt is None else max(0.0, min(200.0, (nxt - now) * 1000))
            try:
                events = poller.poll(timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd, ev in events:
                if fd not in fds:
                    self.stop = True  # stdin closed: the launcher is gone
                    continue
                d = fds[fd]
                s = self.socks[d]
                for _ in range(_BATCH):
                    try:
                        frame, addr = s.recvfrom(_MAX_FRAME)
                    except BlockingIOError:
                        break
                    except OSError:  # the link went down (a partition): carry on
                        self.stats["recv_errors"] += 1
                        break
                    if addr[2] == socket.PACKET_OUTGOING:
                        continue  # what this relay itself sent out of it
                    self.stats[f"recv_{'ab'[d]}{'ba'[d]}"] += 1
                    try:
                        self._frame(d, frame, now)
                    except (struct.error, IndexError, ValueError):
                        # Not a frame it can read: it passes untouched.
                        self.stats["unparsed"] += 1
                        self._enqueue(d, frame, now)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--reset", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    relay = Relay(a.a, a.b, a.delay, a.jitter, a.loss, a.reset, a.seed)

    def on_signal(signum: int, frame: Any) -> None:
        relay.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    relay.run()
    print(json.dumps(dict(relay.stats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
