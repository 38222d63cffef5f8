"""Superseded by bench/allreduce.py (both ProcessGroupTCP paths, Gloo, and
the loopback TCP ring limit, 2 and 4 ranks, float32 and bfloat16).

Kept so that existing callers (``make bench``) go on working: it runs
bench/allreduce.py with the same arguments.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    target = Path(__file__).resolve().parent / "allreduce.py"
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
