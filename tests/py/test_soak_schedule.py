"""The soak's schedule and its pacing: every kind is in every schedule and
is injected in every run, whatever the launcher skipped (no processes)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stepguard.soak import runner
from stepguard.soak.schedule import KINDS, Entry, Pacer, SoakParams, make_schedule


def test_every_short_schedule_has_every_kind_first():
    """The short run's schedule (4 minutes, a fault every ~11 s) begins
    with each kind once, with time left after them for retries."""
    for seed in range(200):
        s = make_schedule(seed, 240, 11)
        first = [e.kind for e in s[:len(KINDS)]]
        assert sorted(first) == sorted(KINDS), seed
        assert s[len(KINDS) - 1].at <= len(KINDS) * 11 * 1.3 < 240 - 60, seed


def test_a_schedule_too_short_for_every_kind_is_refused():
    with pytest.raises(ValueError, match="cannot hold each"):
        make_schedule(1, 60, 11)
    assert {e.kind for e in make_schedule(1, 60, 11, kinds=["hang", "kill_group"])} \
        == {"hang", "kill_group"}


def _entries(*kinds: str, at: float = 0.0) -> list[Entry]:
    return [Entry(at=at + i, kind=k, specs=KINDS[k](random.Random(i), SoakParams()))
            for i, k in enumerate(kinds)]


def test_entries_due_together_are_injected_one_at_a_time_spaced():
    """Entries that came due together (one before them waited for holders)
    go one per ``spacing_s``, so each sees what the one before took down."""
    p = Pacer(_entries("double", "lighthouse_no_id_file", "lossy_link"), spacing_s=2.0)
    assert p.next(1.0, holders=2) is None  # double waits for 3 holders
    tag, e = p.next(20.0, holders=3)
    assert (tag, e.kind) == ("double#0", "double")
    assert p.next(20.0, holders=3) is None and p.next(21.9, holders=3) is None
    assert p.next(22.0, holders=1)[1].kind == "lighthouse_no_id_file"  # needs none
    assert p.next(24.0, holders=1) is None  # lossy_link waits for 2 holders
    assert p.next(30.0, holders=2)[1].kind == "lossy_link"


def test_an_entry_waits_for_holders_at_most_its_patience():
    e = _entries("kill_group", "kill_group")
    e[1].at = 100.0
    p = Pacer(e, spacing_s=2.0, patience_s=15.0, patience_new_s=60.0)
    assert p.next(59.9, holders=1) is None
    tag, _ = p.next(60.0, holders=1)  # a kind never injected: 60 s
    p.injected(tag)
    assert p.next(114.9, holders=1) is None
    assert p.next(115.0, holders=1) is not None  # injected before: 15 s


def test_a_kind_skipped_before_it_was_ever_injected_is_queued_again():
    """Seed 1's short run: lossy_link came due with a double while the
    double took down two groups, the launcher skipped it (only the last
    holder to hit), and the run never injected lossy_link."""
    p = Pacer(_entries("lossy_link", "hang", "partition", at=0.0), spacing_s=2.0,
              max_retries=2)
    tag, e = p.next(0.0, holders=2)
    p.skipped(tag, at=0.1)
    tag2, e2 = p.next(2.0, holders=2)
    assert e2.kind == "lossy_link" and e2.retry and tag2 != tag
    assert e2.specs == [s.__class__(**{**s.__dict__, "tag": None}) for s in e.specs]
    p.skipped(tag2, at=2.1)
    tag3, e3 = p.next(4.0, holders=2)
    assert e3.kind == "lossy_link"
    p.skipped(tag3, at=4.1)  # max_retries reached: not again
    assert p.next(6.0, holders=2)[1].kind == "hang"
    assert "lossy_link" not in p.done


def test_a_retry_of_a_kind_injected_meanwhile_is_dropped_and_injected_kinds_not_retried():
    p = Pacer(_entries("double", "hang", at=0.0), spacing_s=0.0)
    tag, _ = p.next(0.0, holders=3)
    p.skipped(tag + ".1", at=0.1)  # the double's second fault found no group
    p.injected(tag)  # its first did: the double was injected
    assert p.next(1.0, holders=3)[1].kind == "hang"
    # a heal trigger the launcher added for an armed kind is not the kind
    p2 = Pacer(_entries("kill_source", at=0.0), spacing_s=0.0)
    t, _ = p2.next(0.0, holders=3)
    p2.injected(f"{t}:heal_trigger")
    assert "kill_source" not in p2.done
    p2.skipped(t, at=60.0)  # nobody reached the armed point
    assert p2.next(60.0, holders=3)[1].kind == "kill_source"


class _FakeLauncher:
    """What the soak's driver uses of the launcher; every injection of a
    link is skipped the first time (no group to hit)."""

    def __init__(self, drv: runner._Driver) -> None:
        self.drv = drv
        self.groups = [SimpleNamespace(state="running", first_commit_seen=True, stopped=False,
                                       hung=False, hit_at=-1e9) for _ in range(3)]
        self.refused = 0
        self.injected: list[str] = []

    def lighthouse_pids(self) -> list[int]:
        return []

    def stop_injecting(self) -> None:
        pass

    def inject(self, spec) -> None:
        ev = {"event": "inject", "t": time.time(), "tag": spec.tag}
        if spec.kind == "link" and self.refused < 1:
            self.refused += 1
            ev["event"] = "inject_skipped"
        else:
            self.injected.append(spec.tag)
        self.drv.on_event(ev)


def test_the_driver_injects_every_kind_though_the_launcher_skipped_one(tmp_path: Path):
    a = runner.parse_args(["--short", "--seed", "1", "--out", str(tmp_path)])
    sched = make_schedule(1, 240, 11)
    drv = runner._Driver(a, sched, tmp_path)
    la = _FakeLauncher(drv)
    drv.pacer.spacing_s = 0.0  # one entry per tick
    # near the end of the fault phase: every first-round entry is due
    drv.phase, drv.t["faults0"] = "faults", time.time() - 230.0
    for _ in range(40):
        drv.on_tick(la)
    assert drv.phase == "faults"
    drv.lh.close()
    kinds = {t.split("#", 1)[0] for t in la.injected}
    assert kinds == set(KINDS), set(KINDS) - kinds
    assert la.refused == 1
    assert [e for e in drv.entries if e["retry"]]


def test_a_skipped_entry_of_a_kind_injected_before_is_queued_again_once():
    p = Pacer(_entries("hang", "hang", "kill_source", "kill_source", "partition"),
              spacing_s=0.0)
    t0, _ = p.next(0.0, holders=3)
    p.injected(t0)
    t1, _ = p.next(1.0, holders=3)
    p.skipped(t1, at=1.1, reason="no running group to hit")
    t2, e2 = p.next(1.1, holders=3)
    assert e2.kind == "hang" and e2.retry == "again"
    p.skipped(t2, at=1.2)  # once only
    t3, e3 = p.next(2.0, holders=3)
    assert e3.kind == "kill_source" and e3.retry is None
    p.injected(t3)
    t4, _ = p.next(3.0, holders=3)
    # the point is still armed by the one before: it is struck yet
    p.skipped(t4, at=3.1, reason="already armed")
    assert p.next(4.0, holders=3)[1].kind == "partition"
    assert not p.queue


def test_a_short_run_has_enough_entries_for_its_minimum_of_faults():
    """The short run's gap leaves room for a few skipped entries above the
    minimum of faults it must inject."""
    a = runner.parse_args(["--short"])
    for seed in range(50):
        n = len(make_schedule(seed, a.minutes * 60, a.gap))
        assert n >= runner.SHORT_MIN_FAULTS + 2, (seed, n)
