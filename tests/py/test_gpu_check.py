"""scripts/gpu-check where no GPU can be used: it says why and builds
nothing; scripts/gpu-prepare --print: the call it prints is the one
docs/gpu.md gives.  (The checks themselves run on a GPU machine:
docs/gpu.md.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu-check"


def run_check(tmp_path: Path, path: str | None = None, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    e.update(OUT=str(tmp_path / "out"), STEPGUARD_GPU_WORK=str(tmp_path / "work"), **env)
    if path is not None:
        e["PATH"] = path
    return subprocess.run(["bash", str(CHECK)], env=e, capture_output=True, text=True,
                          timeout=180)


def assert_built_nothing(tmp_path: Path, r: subprocess.CompletedProcess) -> None:
    assert not (tmp_path / "work").exists(), "it unpacked or built without a GPU"
    assert (tmp_path / "out" / "gpu-check.log").read_text() == r.stdout


def test_hidden_devices_skip_before_anything_is_built(tmp_path):
    r = run_check(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["SKIP: no GPU: CUDA_VISIBLE_DEVICES is set and empty"]
    assert_built_nothing(tmp_path, r)


def test_this_machine_without_a_gpu_skips(tmp_path):
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU: scripts/gpu-check would run the checks")
    r = run_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("SKIP: no GPU: nvidia-smi"), lines
    print(lines[0])
    assert_built_nothing(tmp_path, r)


def test_a_gpu_that_torch_cannot_use_fails_without_building(tmp_path):
    """A driver that lists a GPU (a stand-in nvidia-smi here) with a torch
    that sees no CUDA device (this machine's) is a failure, not a skip, and
    still nothing is built."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Stand-in GPU (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    r = run_check(tmp_path, path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                  STEPGUARD_GPU_PYTHON=sys.executable)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "GPU 0: Stand-in GPU (UUID: GPU-0)"
    assert re.match(r"FAIL torch-cuda: .*sees no CUDA device$", lines[1]), lines
    assert lines[2] == "gpu-check: 0 passed, 1 failed, 0 skipped"
    assert_built_nothing(tmp_path, r)


def test_prepare_prints_the_documented_call():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-prepare"), "--print"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    call = dict(re.findall(r"^\s+(command|carry|timeout_s):\s+(.*)$", r.stdout, re.M))
    assert len(call["command"]) <= 2000  # the device tool's limits
    assert len(json.loads(call["carry"])) <= 8 and 0 < int(call["timeout_s"]) <= 600
    doc = (ROOT / "docs" / "gpu.md").read_text()
    for key, value in call.items():
        assert f"{key}: {value}" in doc, f"docs/gpu.md does not give {key}: {value}"
