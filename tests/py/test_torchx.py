"""stepguard.torchx.hsdp: the app it describes, torchft mode's name for it,
and a real run of 2 replica groups x 2 ranks with torchx's local scheduler
driven by examples/torchx/.torchxconfig."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchx", reason="torchx is not installed (the torchx extra)")

from stepguard.torchx import hsdp  # noqa: E402
from torchx.specs import macros  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def test_one_role_per_replica_group_with_its_environment(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("STEPGUARD_LIGHTHOUSE", raising=False)
    app = hsdp("--steps", "5", replicas=3, workers_per_replica=4, script="train.py",
               env={"A": "1", "REPLICA_GROUP_ID": "overridden"}, max_restarts=2)
    assert [r.name for r in app.roles] == ["replica_0", "replica_1", "replica_2"]
    for i, r in enumerate(app.roles):
        assert r.entrypoint == "torchrun" and r.num_replicas == 1 and r.max_retries == 0
        assert r.env["REPLICA_GROUP_ID"] == str(i) and r.env["NUM_REPLICA_GROUPS"] == "3"
        assert r.env["TORCHFT_LIGHTHOUSE"] == "http://localhost:29510"
        assert r.env["A"] == "1" and r.env["CUDA_VISIBLE_DEVICES"] == ""
        assert "--nproc-per-node=4" in r.args and "--max-restarts=2" in r.args
        # a free port per group, never a fixed one two groups could share
        assert "--rdzv-endpoint=localhost:0" in r.args
        assert r.args[-3:] == ["train.py", "--steps", "5"]
    monkeypatch.setenv("STEPGUARD_LIGHTHOUSE", "http://lh:1")
    assert hsdp(replicas=1).roles[0].env["TORCHFT_LIGHTHOUSE"] == "http://lh:1"
    assert hsdp(replicas=1, lighthouse="http://a:2,http://b:3").roles[0].env[
        "TORCHFT_LIGHTHOUSE"] == "http://a:2,http://b:3"


def test_multi_node_groups_rendezvous_on_their_first_node():
    app = hsdp("x y", replicas=2, workers_per_replica=8, nodes_per_replica=2, gpu=4,
               rdzv_port=29777)
    r = app.roles[1]
    assert r.num_replicas == 2 and r.min_replicas == 2 and r.entrypoint == "bash"
    assert r.port_map == {"c10d": 29777} and "CUDA_VISIBLE_DEVICES" not in r.env
    cmd = r.args[1]
    assert "--nnodes=2 --nproc-per-node=4" in cmd and "'x y'" in cmd
    assert f"--rdzv-endpoint=$${{{macros.rank0_env}:=localhost}}:29777" in cmd


@pytest.mark.parametrize("kw, why", [
    (dict(replicas=0), "at least one replica group"),
    (dict(workers_per_replica=0), "at least one"),
    (dict(workers_per_replica=3, nodes_per_replica=2), "does not split"),
    (dict(max_restarts=-1), "not negative"),
])
def test_bad_arguments_say_why(kw, why):
    with pytest.raises(ValueError, match=why):
        hsdp(**kw)


def test_torchft_mode_serves_it_as_torchft_torchx():
    code = ("import torchft.torchx as t, stepguard.torchx as s\n"
            "assert t.hsdp is s.hsdp, (t, s)\n"
            "print(t.hsdp(replicas=2).roles[1].env['REPLICA_GROUP_ID'])\n")
    env = {**os.environ, "STEPGUARD_TORCHFT": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "1", p.stderr


def test_local_scheduler_runs_two_groups_of_two_ranks(tmp_path):
    lh_log = open(tmp_path / "lighthouse.log", "w+")  # noqa: SIM115
    lh = subprocess.Popen([str(VENV_BIN / "stepguard-lighthouse"), "--bind", "127.0.0.1:0",
                           "--min_replicas", "2", "--join_timeout_ms", "1000"],
                          stdout=lh_log, stderr=subprocess.STDOUT, start_new_session=True)
    run = None
    try:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"listening on http://\S+:(\d+)",
                                  (tmp_path / "lighthouse.log").read_text())):
            assert lh.poll() is None and time.monotonic() < deadline, "no lighthouse"
            time.sleep(0.05)
        env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{m.group(1)}",
               "TORCHX_LOG_DIR": str(tmp_path / "torchx")}
        env.pop("STEPGUARD_TORCHFT", None)
        # scheduler, component and its arguments from the example's .torchxconfig
        run = subprocess.Popen([str(VENV_BIN / "torchx"), "run", "--wait", "--log",
                                "--", "--", "--steps", "12"],
                               cwd=ROOT / "examples" / "torchx", env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
        out, _ = run.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate(timeout=10)
        pytest.fail(f"torchx run did not finish in 150 s:\n{out[-4000:]}")
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait(10)
        lh_log.close()
    assert run.returncode == 0 and "job finished: SUCCEEDED" in out, out[-4000:]
    # every rank of both groups trained with both groups in the quorum
    for group in (0, 1):
        lines = re.findall(rf"replica_{group}/0 .*group {group} step 10 loss \S+ participants 2",
                           out)
        assert len(lines) == 2, out[-4000:]
