"""torchft mode (STEPGUARD_TORCHFT=1): the name torchft is stepguard, in
this process's children of every kind, while the real torchft wheel stays
installed beside it.

Every check runs in a fresh interpreter (the mode is switched on at
interpreter start by stepguard-torchft.pth), with a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lighthouse_util import LighthouseProc, http_get

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMEOUT = 120


def _env(on: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("STEPGUARD_TORCHFT", None)
    if on:
        env["STEPGUARD_TORCHFT"] = "1"
    return env


def _python(code: str, on: bool = True, cwd: Path | None = None) -> dict:
    """Runs `code` in a new Python; it prints one JSON object last."""
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(on),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


# what a child reports about its torchft name
_PROBE = """
import json, sys
import torchft, torchft.manager, stepguard, stepguard.manager
print(json.dumps({
    "same": torchft is stepguard and torchft.manager is stepguard.manager,
    "file": torchft.__file__,
}), flush=True)
"""


def test_every_torchft_name_is_the_stepguard_module():
    got = _python(
        """
        import importlib.util, json
        from unittest import mock
        import torchft
        from torchft.process_group import ProcessGroupGloo, ManagedProcessGroup
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.local_sgd import DiLoCo
        import torchft._torchft
        import stepguard, stepguard.manager, stepguard.process_group
        import stepguard.checkpointing.pg_transport, stepguard.local_sgd
        import stepguard.coordination
        import torchft.parameter_server, stepguard.parameter_server

        pairs = {
            "parameter_server": torchft.parameter_server is stepguard.parameter_server,
            "torchft": torchft is stepguard,
            "manager": torchft.manager is stepguard.manager,
            "process_group": torchft.process_group is stepguard.process_group,
            "pg_transport": torchft.checkpointing.pg_transport
                is stepguard.checkpointing.pg_transport,
            "local_sgd": torchft.local_sgd is stepguard.local_sgd,
            "classes": PGTransport is stepguard.checkpointing.pg_transport.PGTransport
                and DiLoCo is stepguard.local_sgd.DiLoCo
                and ProcessGroupGloo is stepguard.process_group.ProcessGroupGloo
                and ManagedProcessGroup is stepguard.process_group.ManagedProcessGroup,
            "native": torchft._torchft.LighthouseServer
                is stepguard.coordination.LighthouseServer
                and torchft._torchft.ManagerClient is stepguard.coordination.ManagerClient,
        }
        with mock.patch("torchft.manager.ManagerClient") as patched:
            pairs["patch"] = stepguard.manager.ManagerClient is patched
        pairs["unpatched"] = (
            stepguard.manager.ManagerClient is stepguard.coordination.ManagerClient)
        spec = importlib.util.find_spec("torchft")
        print(json.dumps({
            "pairs": pairs,
            "spec": spec is not None,
            "name": torchft.__name__,
            "top": [n for n in ("Manager", "Optimizer", "DistributedDataParallel",
                                "ProcessGroupGloo") if not hasattr(torchft, n)],
        }))
        """
    )
    assert got["spec"]
    assert got["pairs"] == {k: True for k in got["pairs"]}, got
    # stepguard's modules keep their own names (pickling, -m, reload)
    assert got["name"] == "stepguard"
    assert got["top"] == []


def test_mode_off_leaves_the_real_torchft():
    got = _python(
        """
        import json, torchft, stepguard
        print(json.dumps({"same": torchft is stepguard, "file": torchft.__file__}))
        """,
        on=False,
    )
    assert not got["same"]
    assert Path(got["file"]).parent.name == "torchft"


def test_torchfts_test_files_load_from_the_wheel():
    got = _python(
        """
        import json
        import torchft.manager_test as t
        import torchft.checkpointing.rwlock_test as r
        import torchft.manager, stepguard.manager
        print(json.dumps({
            "file": t.__file__,
            "rwlock": r.__file__,
            "uses_ours": t.Manager is stepguard.manager.Manager,
        }))
        """
    )
    assert Path(got["file"]).name == "manager_test.py"
    assert "site-packages" in got["file"], got
    assert Path(got["rwlock"]).parent.name == "checkpointing"
    assert got["uses_ours"]


def test_missing_optional_modules_fail_as_in_torchft():
    got = _python(
        """
        import json
        out = {}
        for name in ("torchft.torchcomms", "torchft.no_such_module"):
            try:
                __import__(name)
                out[name] = None
            except ImportError as e:
                out[name] = [type(e).__name__, e.name, str(e)]
        print(json.dumps(out))
        """
    )
    # torchft's own torchft/torchcomms.py fails on its dependency's import
    assert got["torchft.torchcomms"][:2] == ["ModuleNotFoundError", "torchcomms"]
    kind, name, msg = got["torchft.no_such_module"]
    assert kind == "ModuleNotFoundError" and name == "torchft.no_such_module"
    assert "stepguard" in msg


def test_mode_holds_in_subprocess_and_multiprocessing_children(tmp_path):
    script = tmp_path / "children.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, multiprocessing as mp, subprocess, sys

            def probe(q):
                import torchft, stepguard
                q.put(torchft is stepguard)

            if __name__ == "__main__":
                out = {}
                for method in ("spawn", "forkserver"):
                    ctx = mp.get_context(method)
                    q = ctx.Queue()
                    p = ctx.Process(target=probe, args=(q,))
                    p.start()
                    out[method] = q.get(timeout=60)
                    p.join(60)
                probe_code = sys.argv[1]
                line = subprocess.run([sys.executable, "-c", probe_code],
                                      capture_output=True, text=True,
                                      timeout=60, check=True).stdout
                out["subprocess"] = json.loads(line)["same"]
                print(json.dumps(out))
            """
        )
    )
    p = subprocess.run(
        [sys.executable, str(script), _PROBE],
        env=_env(True),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"spawn": True, "forkserver": True, "subprocess": True}


def test_mode_holds_in_torchrun_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, sys, torchft, stepguard\n"
        "path = os.path.join(sys.argv[1], 'rank%s.json' % os.environ['RANK'])\n"
        "open(path, 'w').write(json.dumps({'rank': os.environ['RANK'],"
        " 'same': torchft is stepguard}))\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node=2", str(script), str(tmp_path)],
        env=_env(True),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stderr
    # one file per rank: the two workers share torchrun's stdout
    seen = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(d["rank"] for d in seen) == ["0", "1"]
    assert all(d["same"] for d in seen), seen


def _stepguard_lighthouse_runs(procs, argv: list[str], env: dict[str, str]) -> None:
    """Starts argv (a lighthouse command line) and checks that it is
    stepguard's: its /status answers JSON (torchft's answers HTML)."""
    p = subprocess.Popen(
        [*argv, "--bind", "127.0.0.1:0", "--min_replicas", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    procs.popens.append(p)
    lh = LighthouseProc(p, timeout=60)
    code, headers, body = http_get(lh.port, "/status")
    assert code == 200
    assert "json" in headers.get("content-type", ""), headers
    doc = json.loads(body)
    assert "heartbeats" in doc and "reason" in doc, doc


def test_torchft_lighthouse_command_runs_stepguards(procs):
    # the real torchft's console script, in the mode: its import of
    # torchft._torchft reaches stepguard's lighthouse
    _stepguard_lighthouse_runs(procs, [str(BIN / "torchft_lighthouse")], _env(True))

    # stepguard-torchft puts its own torchft_lighthouse first on PATH and
    # leaves the real script where it was
    exports = subprocess.run(
        [str(BIN / "stepguard-torchft")], env=_env(False), capture_output=True,
        text=True, timeout=TIMEOUT, check=True,
    ).stdout
    assert "export STEPGUARD_TORCHFT=1" in exports
    which = subprocess.run(
        [str(BIN / "stepguard-torchft"), "sh", "-c", "command -v torchft_lighthouse"],
        env=_env(False), capture_output=True, text=True, timeout=TIMEOUT, check=True,
    ).stdout.strip()
    assert which and Path(which).parent != BIN, which
    assert (BIN / "torchft_lighthouse").read_text().count("torchft._torchft") == 1
    env = _env(False)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", os.defpath)])
    _stepguard_lighthouse_runs(
        procs, [str(BIN / "stepguard-torchft"), "torchft_lighthouse"], env)


def test_python_m_coordination_runs_the_lighthouse(procs):
    _stepguard_lighthouse_runs(procs, [sys.executable, "-m", "stepguard.coordination"],
                               _env(False))


def test_stepguard_torchft_reports_a_missing_command():
    p = subprocess.run(
        [str(BIN / "stepguard-torchft"), "no-such-command-for-stepguard"],
        env=_env(False), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert p.returncode == 127
    assert "no-such-command-for-stepguard" in p.stderr


def test_bare_import_reaches_torchfts_submodules():
    got = _python(
        """
        import json, stepguard
        names = ["process_group", "manager", "checkpointing", "coordination",
                 "futures", "ddp", "local_sgd", "optim", "data", "setup_logger"]
        print(json.dumps([n for n in names if not hasattr(stepguard, n)]))
        """,
        on=False,
    )
    assert got == []


def test_shell_switch_from_the_readme():
    # eval "$(stepguard-torchft)" then python: the README's one-line switch
    p = subprocess.run(
        ["sh", "-c", f'eval "$("{BIN}/stepguard-torchft")" && "{sys.executable}" -c '
         '"import torchft, stepguard; print(torchft is stepguard)"'],
        env=_env(False), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "True"
