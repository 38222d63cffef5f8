"""The soak's history checker: the launcher's timeline and the replicas'
step logs in, every violation out (``docs/soak.md`` lists the rules).

Each :class:`Violation` names its rule, and where it can the step, the
replica (its name and group rank) and the incarnation.  :func:`check`
is pure (histories in, violations out), so synthetic histories test it;
:func:`load` reads a soak's output folder.

``python -m stepguard.soak.checker DIR`` checks a finished soak's folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["Bounds", "History", "Violation", "check", "load", "recovery_times"]


@dataclass
class Violation:
    rule: str
    detail: str
    step: int | None = None
    replica: str | None = None
    rank: int | None = None
    incarnation: int | None = None

    def __str__(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in (
            ("step", self.step), ("replica", self.replica), ("rank", self.rank),
            ("incarnation", self.incarnation)) if v is not None)
        return f"{self.rule}: {self.detail}" + (f" ({where})" if where else "")


@dataclass
class Bounds:
    """The limits the rules use."""

    min_replicas: int = 2
    survivors_s: float = 60.0  # a fault -> the survivors' next commit
    rejoin_s: float = 120.0  # a restart -> that incarnation's first commit
    lighthouse_rss_kib: int = 32 * 1024  # growth allowed over one lighthouse's life
    lighthouse_fds: int = 32
    lighthouse_warmup_s: float = 30.0


@dataclass
class History:
    timeline: list[dict[str, Any]]
    steps: list[dict[str, Any]]  # every step log line (kind step or heal)
    lighthouse: list[dict[str, Any]] = field(default_factory=list)  # samples
    leftovers: dict[str, list[Any]] = field(default_factory=dict)


def _v(rule: str, detail: str, rec: dict[str, Any] | None = None,
       step: int | None = None) -> Violation:
    rec = rec or {}
    return Violation(rule, detail, step if step is not None else rec.get("step"),
                     rec.get("replica_id"), rec.get("rank"), rec.get("incarnation"))


def _who(rec: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (rec.get("replica_id"), rec.get("rank"), rec.get("incarnation"))


def check(h: History, b: Bounds | None = None) -> list[Violation]:
    """Every violation in ``h`` (an empty list: the history is clean)."""
    b = b or Bounds()
    out: list[Violation] = []
    steps = sorted((r for r in h.steps if r.get("kind") == "step"), key=lambda r: r["t"])
    heals = [r for r in h.steps if r.get("kind") == "heal"]
    commits = [r for r in steps if r.get("committed")]
    out += _quorums(steps)
    out += [_v("too_few_participants", f"committed with {r.get('participants')} "
               f"participants, min_replica_size {b.min_replicas}", r)
            for r in commits if r.get("participants") is not None
            and r["participants"] < b.min_replicas]
    out += _state(commits, heals, steps)
    out += _histories(commits)
    out += _recoveries(h.timeline, b)
    out += _exits(h.timeline)
    out += _lighthouse(h.lighthouse, b)
    out += _ending(h.timeline, h.leftovers)
    return out


def _quorums(steps: list[dict[str, Any]]) -> list[Violation]:
    out: list[Violation] = []
    last: dict[tuple[Any, Any, Any], int] = {}
    members: dict[int, tuple[list[str], dict[str, Any]]] = {}
    max_step: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}
    for r in steps:
        q = r.get("quorum_id")
        if q is None:
            continue
        who = _who(r)
        if who in last and q < last[who]:
            out.append(_v("quorum_id_backwards", f"quorum id {q} after {last[who]}", r))
        last[who] = max(q, last.get(who, q))
        m = r.get("members")
        if m is not None:
            first = members.setdefault(q, (sorted(m), r))
            if sorted(m) != first[0]:
                out.append(_v("quorum_members_differ",
                              f"quorum {q}: members {sorted(m)}, but {first[1].get('replica_id')} "
                              f"saw {first[0]}", r))
        if r.get("committed") and r.get("max_step") is not None:
            key = (q, r["step"])
            seen = max_step.setdefault(key, (r["max_step"], r))
            if r["max_step"] != seen[0]:
                out.append(_v("quorum_max_step_differs",
                              f"quorum {q} step {r['step']}: max_step {r['max_step']}, "
                              f"but {seen[1].get('replica_id')} saw {seen[0]}", r))
    # the highest committed step never goes back: a quorum commits only
    # steps above every step committed in an earlier (lower id) quorum
    top: dict[int, int] = {}
    low: dict[int, dict[str, Any]] = {}
    for r in steps:
        if r.get("committed") and r.get("quorum_id") is not None:
            q = r["quorum_id"]
            top[q] = max(top.get(q, -1), r["step"])
            if q not in low or r["step"] < low[q]["step"]:
                low[q] = r
    best, best_q = -1, None
    for q in sorted(top):
        if low[q]["step"] <= best:
            out.append(_v("job_went_back",
                          f"quorum {q} committed step {low[q]['step']}, but quorum {best_q} "
                          f"had committed step {best}", low[q]))
        if top[q] > best:
            best, best_q = top[q], q
    return out


def _state(commits: list[dict[str, Any]], heals: list[dict[str, Any]],
           steps: list[dict[str, Any]]) -> list[Violation]:
    out: list[Violation] = []
    by: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in commits:
        by[(r["step"], r.get("rank", 0))].append(r)
    # one violation per replica rank and incarnation: its first divergent
    # step, and how many more followed (a job that started over diverges
    # at every step it commits again)
    first: dict[tuple[Any, Any, Any], tuple[dict[str, Any], int, int]] = {}
    for (step, rank), recs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        counts: dict[str, int] = defaultdict(int)
        for r in recs:
            counts[r["hash_after"]] += 1
        if len(counts) > 1:
            major = max(counts, key=lambda k: (counts[k], k))
            for r in recs:
                if r["hash_after"] != major:
                    f = first.get(_who(r))
                    first[_who(r)] = (r, counts[major], 0) if f is None else \
                        (f[0], f[1], f[2] + 1)
    for r, others, more in first.values():
        out.append(_v("divergent_state",
                      f"state after step {r['step']} differs from {others} other "
                      f"replica(s)" + (f"; so did {more} later step(s)" if more else ""), r))
    for r in heals:
        src = by.get((r["step"] - 1, r.get("rank", 0)), [])
        if src and all(s["hash_after"] != r["hash"] for s in src):
            out.append(_v("heal_differs_from_source",
                          f"loaded state for step {r['step']} (from {r.get('source')}) differs "
                          "from every replica that committed the step before", r))
    for r in steps:
        if not r.get("committed") and r.get("hash_before") is not None \
                and r["hash_before"] != r.get("hash_after"):
            out.append(_v("discard_changed_state", "a discarded step changed the state", r))
    return out


def _histories(commits: list[dict[str, Any]]) -> list[Violation]:
    out: list[Violation] = []
    last: dict[tuple[Any, Any, Any], int] = {}
    for r in commits:
        who = _who(r)
        if who in last and r["step"] <= last[who]:
            out.append(_v("history_went_back",
                          f"committed step {r['step']} after step {last[who]}", r))
        last[who] = max(r["step"], last.get(who, r["step"]))
    return out


def recovery_times(timeline: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per fault kind: ``survivors`` (fault -> the others' next commit) and
    ``rejoin`` (a victim's restart -> its first commit) durations."""
    kind_of = {r["failure"]: r["kind"] for r in timeline
               if r.get("event") == "inject" and "failure" in r}
    victim_kind: dict[tuple[int, int], str] = {}
    for r in timeline:
        if r.get("event") == "inject" and r.get("group") is not None:
            victim_kind.setdefault((r["group"], r.get("incarnation", -1) + 1), r["kind"])
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"survivors": [],
                                                                  "rejoin": []})
    seen: set[int] = set()
    for r in timeline:
        if r.get("event") != "recovery":
            continue
        if r.get("kind") == "survivors" and r.get("failure") in kind_of \
                and r["failure"] not in seen:
            seen.add(r["failure"])
            out[kind_of[r["failure"]]]["survivors"].append(r["duration_s"])
        elif r.get("kind") == "rejoin":
            k = victim_kind.get((r["group"], r["incarnation"]), "own exit")
            out[k]["rejoin"].append(r["duration_s"])
    return dict(out)


def _recoveries(tl: list[dict[str, Any]], b: Bounds) -> list[Violation]:
    out: list[Violation] = []
    if not tl:
        return out
    stop = next((r["t"] for r in tl if r.get("event") == "finish"), tl[-1]["t"])
    surv: dict[int, float] = {}
    rejoin: dict[tuple[int, int], float] = {}
    for r in tl:
        if r.get("event") == "recovery" and r.get("kind") == "survivors":
            surv.setdefault(r["failure"], r["duration_s"])
        elif r.get("event") == "recovery" and r.get("kind") == "rejoin":
            rejoin[(r["group"], r["incarnation"])] = r["duration_s"]
    restarts_lh = {r["failure"]: r["t"] for r in tl if r.get("event") == "lighthouse_restart"}
    for r in tl:
        if r.get("event") != "inject" or "failure" not in r:
            continue
        f = r["failure"]
        t = restarts_lh.get(f, r["t"]) if r["kind"] == "lighthouse" else r["t"]
        if r["kind"] == "lighthouse" and f not in restarts_lh:
            if stop - r["t"] > b.survivors_s:
                out.append(Violation("no_recovery", f"lighthouse fault {f}: never restarted"))
            continue
        d = surv.get(f)
        if (d is None and stop - t > b.survivors_s) or (d is not None and d > b.survivors_s):
            out.append(Violation(
                "no_recovery", f"{r['kind']} fault {f}: the survivors' next commit "
                + (f"took {d:.1f} s" if d is not None else "never came")
                + f" (bound {b.survivors_s:.0f} s)", incarnation=r.get("incarnation"),
                replica=None if r.get("group") is None else f"group {r['group']}"))
    ended = {(r["group"], r["incarnation"]): r["t"] for r in tl if r.get("event") == "exit"}
    for r in tl:
        if r.get("event") != "restart":
            continue
        key = (r["group"], r["incarnation"])
        d = rejoin.get(key)
        if d is None:
            end = min(ended.get(key, stop), stop)
            if end - r["t"] <= b.rejoin_s:
                continue  # ended (or the run did) before the bound: nothing to say
        if d is None or d > b.rejoin_s:
            out.append(Violation(
                "no_rejoin", "restarted group " + (f"took {d:.1f} s" if d is not None else
                                                   "never committed")
                + f" to rejoin (bound {b.rejoin_s:.0f} s)", replica=f"group {r['group']}",
                incarnation=r["incarnation"]))
    return out


def _exits(tl: list[dict[str, Any]]) -> list[Violation]:
    """A trainer that exited without a fault injected into its incarnation
    (a lost peer or lighthouse is an error to survive, not to exit on)."""
    out: list[Violation] = []
    hit: dict[tuple[int, int], float] = {}
    cut: dict[int, float] = {}  # group -> partitioned since
    for r in tl:
        ev = r.get("event")
        if ev == "inject" and r.get("group") is not None:
            hit.setdefault((r["group"], r.get("incarnation", -1)), r["t"])
            if r.get("kind") == "partition":
                cut[r["group"]] = r["t"]
        elif ev == "partition_end":
            cut.pop(r.get("group"), None)
        elif ev == "restart" and r.get("group") in cut:
            # started inside a partition: its failure is the partition's
            hit.setdefault((r["group"], r["incarnation"]), r["t"])
    stop = next((r["t"] for r in tl if r.get("event") in ("finish", "duration_reached",
                                                         "interrupted")), None)
    seen: set[tuple[int, int]] = set()
    for r in tl:
        if r.get("event") != "exit":
            continue
        key = (r["group"], r["incarnation"])
        if key in seen:
            continue  # the rest of a group the launcher ended
        seen.add(key)
        if stop is not None and r["t"] >= stop:
            continue
        if key in hit and hit[key] <= r["t"]:
            continue
        if r.get("returncode") == 0:
            continue
        out.append(Violation("unplanned_exit",
                             f"rank {r.get('rank')} exited with {r.get('returncode')} "
                             "with no fault injected into it", replica=f"group {r['group']}",
                             rank=r.get("rank"), incarnation=r["incarnation"]))
    return out


def _lighthouse(samples: list[dict[str, Any]], b: Bounds) -> list[Violation]:
    out: list[Violation] = []
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by[s["pid"]].append(s)
    for pid, ss in by.items():
        ss.sort(key=lambda s: s["t"])
        ss = [s for s in ss if s["t"] - ss[0]["t"] >= b.lighthouse_warmup_s]
        if len(ss) < 6:
            continue
        third = len(ss) // 3
        for key, limit, unit in (("rss_kib", b.lighthouse_rss_kib, "KiB"),
                                 ("fds", b.lighthouse_fds, "descriptors")):
            early = min(s[key] for s in ss[:third])
            late = min(s[key] for s in ss[-third:])
            if late - early > limit:
                out.append(Violation("lighthouse_grows",
                                     f"lighthouse pid {pid}: {key} {early} -> {late} "
                                     f"(more than {limit} {unit})"))
    return out


def _ending(tl: list[dict[str, Any]], leftovers: dict[str, list[Any]]) -> list[Violation]:
    out: list[Violation] = []
    events = [r.get("event") for r in tl]
    if "end" not in events:
        out.append(Violation("run_did_not_end", "the timeline has no end record"))
    if "interrupted" in events:
        out.append(Violation("run_did_not_end", "the run was interrupted"))
    if "finish" not in events:
        out.append(Violation("run_did_not_end", "the run never reached its stop step "
                             "(no finish record)"))
    for r in tl:
        if r.get("event") == "give_up":
            out.append(Violation("group_given_up", str(r.get("reason")),
                                 replica=f"group {r.get('group')}"))
    for what, items in sorted(leftovers.items()):
        for item in items:
            out.append(Violation("left_behind", f"{what}: {item}"))
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a SIGKILL
            if isinstance(rec, dict):
                out.append(rec)
    return out


def load(folder: str | Path) -> History:
    """Reads a soak's output folder (timeline.jsonl, steps/, lighthouse.jsonl,
    leftovers.json)."""
    d = Path(folder)
    steps: list[dict[str, Any]] = []
    for p in sorted((d / "steps").glob("*.jsonl")):
        steps += _jsonl(p)
    lh = _jsonl(d / "lighthouse.jsonl") if (d / "lighthouse.jsonl").exists() else []
    left = json.loads((d / "leftovers.json").read_text()) \
        if (d / "leftovers.json").exists() else {}
    return History(_jsonl(d / "timeline.jsonl"), steps, lh, left)


def summarize(vs: Iterable[Violation]) -> str:
    vs = list(vs)
    lines = [f"violations: {len(vs)}"]
    lines += [f"  {v}" for v in vs[:200]]
    if len(vs) > 200:
        lines.append(f"  ... and {len(vs) - 200} more")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="check a soak's history")
    p.add_argument("folder")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the violations as JSON")
    a = p.parse_args(argv)
    vs = check(load(a.folder), Bounds(min_replicas=a.min_replicas))
    if a.json:
        print(json.dumps([asdict(v) for v in vs], indent=1))
    else:
        print(summarize(vs))
    return 1 if vs else 0


def median(v: list[float]) -> float | None:
    return statistics.median(v) if v else None


if __name__ == "__main__":
    sys.exit(main())
