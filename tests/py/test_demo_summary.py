"""examples/demo.py's summary from a made-up timeline: the goodput line
comes from stepguard.soak.goodput over the kill window."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import demo  # noqa: E402


def timeline(lost: int) -> list[dict]:
    """Three groups, a step every 0.5 s from t=0 to 60 s, kills of group 1
    at 10 s and 30 s; its next incarnation commits nothing in the first
    ``lost`` steps after each kill."""
    tl = [{"event": "inject", "kind": "kill", "t": t, "elapsed": t, "group": 1, "pid": 1}
          for t in (10.0, 30.0)]
    for step in range(120):
        t = step * 0.5
        for g in range(3):
            if g == 1 and any(k <= t < k + lost * 0.5 for k in (10.0, 30.0)):
                continue
            inc = sum(1 for k in (10.0, 30.0) if g == 1 and t >= k)  # relaunched
            tl.append({"event": "commit", "t": t, "elapsed": t, "group": g, "rank": 0,
                       "incarnation": inc, "step": step, "loss": 1.0, "participants": 3,
                       "healed": False, "step_time": 0.5})
    return sorted(tl, key=lambda r: r["t"])


def test_demo_summary_prints_goodput():
    s = demo.summarize(timeline(0), 3, (True, "same"), "stepguard", "stepguard", 20.0)
    assert s["goodput"] == pytest.approx(1.0)
    assert s["fault_free_rate"] == pytest.approx(2.0)
    # window [10, 50): 80 steps x 3 replicas possible, 2 x 8 lost
    s = demo.summarize(timeline(8), 3, (True, "same"), "stepguard", "stepguard", 20.0)
    assert s["goodput"] == pytest.approx((240 - 16) / 240)
    line = [x for x in demo.summary_text(s).splitlines() if x.startswith("goodput:")]
    assert line and line[0].startswith(f"goodput: {(240 - 16) / 240:.3f} (")
    s = demo.summarize([r for r in timeline(0) if r["event"] != "inject"], 3, (True, "same"),
                       "stepguard", "stepguard", 20.0)
    assert s["goodput"] is None and "goodput: n/a" in demo.summary_text(s)


def test_demo_goodput_rate_from_the_quiet_end():
    # group 1 is away from 10 s to 51 s (a relaunch slower than the kills):
    # no full-quorum step in the window, so the rate comes from the steps
    # before and after it (the demo's quiet end)
    tl = []
    for r in timeline(0):
        if r["event"] == "commit" and 10.0 <= r["t"] < 51.0:
            if r["group"] == 1:
                continue
            r = {**r, "participants": 2}
        tl.append(r)
    tl += [{"event": "restart", "t": 30.0, "group": 1, "incarnation": 2},
           {"event": "ready", "t": 50.0, "group": 1, "incarnation": 2}]
    tl.sort(key=lambda r: r["t"])
    s = demo.summarize(tl, 3, (True, "same"), "stepguard", "stepguard", 20.0)
    assert s["fault_free_rate"] == pytest.approx(2.0)
    assert s["goodput"] == pytest.approx(160 / 240)
