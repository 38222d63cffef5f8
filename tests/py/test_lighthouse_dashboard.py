"""The lighthouse dashboard with its history, in a real headless browser.

A real lighthouse (port 0) with replica groups that each run a real
manager and step (tests/py/helpers/dashboard_replica.py); Debian's
Chromium loads the page (tests/py/helpers/cdp.py drives it over the
DevTools protocol).  Checked: the membership timeline, the step rates, the
failures and heals tables, /status carrying the same history, a kill
through the page's button refused without the token and done with it (and
done on a lighthouse without a token), and that the page fetches nothing
but the lighthouse's own URLs.  A screenshot is kept under the test's tmp
directory; the test prints its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cdp import Browser, chromium_path
from helpers.lighthouse_util import LogProc, start_ours, status, wait_until

REPLICA = Path(__file__).resolve().parent / "helpers" / "dashboard_replica.py"
TOKEN = "dash-s3cret"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if chromium_path() is None:
        pytest.skip("chromium is not installed: scripts/bootstrap installs "
                    "Debian's chromium package")
    b = Browser(tmp_path_factory.mktemp("chromium"))
    if b.no_sandbox:
        print("\nchromium runs with --no-sandbox: it refuses to run as root "
              "without it")
    try:
        yield b
    finally:
        b.close()


def start_replica(procs, lh, replica_id: str, step: int = 0,
                  token: str | None = None) -> LogProc:
    env = dict(os.environ)
    env.pop("STEPGUARD_AUTH_TOKEN", None)
    if token:
        env["STEPGUARD_AUTH_TOKEN"] = token
    p = subprocess.Popen([sys.executable, str(REPLICA), lh.addr, replica_id, str(step),
                          "0.05"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=env)
    procs.popens.append(p)  # killed by pid at teardown
    r = LogProc(p)
    r.wait_line(r"^MANAGER ", 60)
    return r


def members(port: int) -> list[str]:
    q = status(port)["prev_quorum"]
    return [m["replica_id"] for m in q["members"]] if q else []


def page_text(b: Browser, selector: str) -> str:
    return b.evaluate("document.querySelector(%r).textContent" % selector)


def member_card_count(b: Browser) -> int:
    return b.evaluate("document.querySelectorAll('#members .member').length")


def test_dashboard_history_and_kill_in_a_browser(browser, procs, tmp_path):
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    # a join timeout far above a step: no group misses a quorum under load
    lh = start_ours(procs, "--min_replicas", "2", "--join_timeout_ms", "3000",
                    "--heartbeat_timeout_ms", "2000", "--auth_token_file", str(tok))
    reps = {rid: start_replica(procs, lh, rid, token=TOKEN) for rid in ("a", "b", "c")}
    wait_until(lambda: members(lh.port) == ["a", "b", "c"], 60, "a quorum of a, b, c")

    # /status carries the history: a change, and step rates after 2 s of steps
    def rates() -> dict[str, float]:
        h = status(lh.port)["history"]
        return {r["replica_id"]: r["step_rate"] for r in h["replicas"]}

    wait_until(lambda: all(v > 0 for v in rates().values()) and len(rates()) == 3,
               30, "a step rate for every replica")
    h = status(lh.port)["history"]
    assert h["window_ms"] == 15 * 60 * 1000
    assert h["changes"] and h["changes"][-1]["members"] == 3
    assert h["failures"] == []
    # a group that joined after the first two stepped is behind: a heal
    assert all(e["step"] < e["max_step"] for e in h["heals"])
    heals_before = len(h["heals"])

    b = browser
    b.navigate(lh.addr + "/")
    b.wait_for("document.querySelectorAll('#members .member').length === 3", 20,
               "three member cards")
    b.wait_for("document.querySelectorAll('#tl g.row').length === 3", 10,
               "three timeline rows")
    rows = b.evaluate("[...document.querySelectorAll('#tl g.row')]"
                      ".map(g => [g.dataset.replica, g.querySelectorAll('rect.span.open')"
                      ".length])")
    assert rows == [["a", 1], ["b", 1], ["c", 1]]
    rate_rows = b.evaluate("[...document.querySelectorAll('#rates tr')].slice(1)"
                           ".map(r => [...r.cells].map(c => c.textContent))")
    assert [r[0] for r in rate_rows] == ["a", "b", "c"]
    assert all(float(r[2].split()[0]) > 0 for r in rate_rows), rate_rows
    assert "No failure." in page_text(b, "#failures")

    # the kill button without the token: refused, b lives on
    b.click('#members .member[data-replica="b"] button.kill')
    b.wait_for("document.getElementById('msg').textContent.startsWith('kill b: 401')",
               10, "a 401 for a kill without the token")
    assert b.dialogs == ["Kill replica b?"]
    assert reps["b"].popen.poll() is None
    assert "b" in members(lh.port)

    # with the token: b's manager exits (status 1, its kill handler)
    b.type_into("#token", TOKEN)
    b.click('#members .member[data-replica="b"] button.kill')
    b.wait_for("document.getElementById('msg').textContent.startsWith('kill b: 200')",
               15, "a 200 for a kill with the token")
    assert reps["b"].wait_exit(15) == 1
    wait_until(lambda: members(lh.port) == ["a", "c"], 30, "a quorum without b")
    b.wait_for("[...document.querySelectorAll('#failures td')]"
               ".some(td => td.textContent === 'killed from the dashboard')", 10,
               "b's failure and its reason in the failures table")
    b.wait_for("document.querySelector('#tl g.row[data-replica=\"b\"] circle.fail')"
               " !== null && document.querySelector('#tl g.row[data-replica=\"b\"]"
               " rect.span.open') === null", 10, "b's span closed with a failure mark")

    # b comes back at step 0, behind the others: a heal
    reps["b"] = start_replica(procs, lh, "b", step=0, token=TOKEN)
    wait_until(lambda: members(lh.port) == ["a", "b", "c"], 60, "b back in the quorum")
    heals = wait_until(lambda: status(lh.port)["history"]["heals"][heals_before:], 10,
                       "b's heal")
    assert heals[-1]["replica_id"] == "b" and heals[-1]["step"] == 0
    assert heals[-1]["max_step"] > 0
    fails = status(lh.port)["history"]["failures"]
    assert [(f["replica_id"], f["reason"]) for f in fails] == [
        ("b", "killed from the dashboard")]
    b.wait_for("[...document.querySelectorAll('#heals tr')].slice(1)"
               ".some(r => r.cells[1].textContent === 'b' && r.cells[3].textContent === '0')",
               10, "b in the heals table")
    b.wait_for("document.querySelectorAll('#tl g.row[data-replica=\"b\"] rect.span')"
               ".length === 2 && document.querySelector('#tl g.row[data-replica=\"b\"]"
               " rect.heal') !== null", 10, "b's second span and its heal mark")
    changes = b.evaluate("document.querySelectorAll('#changes tr').length - 1")
    assert changes >= 3  # a, b, c; without b; with b again

    shot = b.screenshot(tmp_path / "dashboard.png")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    print(f"\ndashboard screenshot: {shot}")

    # nothing but the lighthouse itself was fetched
    urls = b.requested_urls()
    assert urls and all(u.startswith(lh.addr + "/") for u in urls), set(urls)


def test_dashboard_kill_without_a_token_configured(browser, procs):
    lh = start_ours(procs, "--min_replicas", "1", "--join_timeout_ms", "200")
    r = start_replica(procs, lh, "solo")
    wait_until(lambda: members(lh.port) == ["solo"], 60, "a quorum of solo")
    b = browser
    b.navigate(lh.addr + "/")
    b.wait_for("document.querySelectorAll('#members .member').length === 1", 20,
               "solo's card")
    b.evaluate("document.getElementById('token').value = ''")
    b.click('#members .member[data-replica="solo"] button.kill')
    b.wait_for("document.getElementById('msg').textContent.startsWith('kill solo: 200')",
               15, "a 200 for a kill on a lighthouse without a token")
    assert r.wait_exit(15) == 1
