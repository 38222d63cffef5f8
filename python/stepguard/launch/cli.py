"""The ``stepguard-launch`` command (also ``python -m stepguard.launch``)."""

from __future__ import annotations

import argparse
import sys

from stepguard.launch.launcher import LaunchConfig, Launcher
from stepguard.launch.netns import netns_unavailable
from stepguard.launch.spec import parse_failure_spec, parse_link_spec

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepguard-launch",
        description="Run replica groups of a training script with a lighthouse, "
        "restart groups that lose a rank, and inject failures.",
    )
    p.add_argument("--groups", "--replica-groups", type=int, default=2,
                   help="number of replica groups (default 2)")
    p.add_argument("--nproc-per-group", "--nproc_per_node", type=int, default=1,
                   help="ranks per replica group (default 1)")
    p.add_argument("--lighthouse", default=None,
                   help="address of a running lighthouse (default: start one)")
    p.add_argument("--lighthouse-impl", choices=("stepguard", "torchft"),
                   default="stepguard", help="which lighthouse to start")
    p.add_argument("--lighthouses", type=int, default=1,
                   help="start this many lighthouses electing a leader in etcd "
                   "(replicated; stepguard's; default 1)")
    p.add_argument("--etcd", default=None, metavar="ENDPOINTS",
                   help="with --lighthouses N: the etcd to elect in (default: "
                   "start a one-member etcd)")
    p.add_argument("--min-replicas", "--min_replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", "--join_timeout_ms", type=int, default=10000)
    p.add_argument("--quorum-tick-ms", "--quorum_tick_ms", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", "--heartbeat_timeout_ms", type=int,
                   default=5000)
    p.add_argument("--state-loss-wait-ms", "--state_loss_wait_ms", type=int,
                   default=None, metavar="MS",
                   help="how long the lighthouse holds a quorum behind the step the "
                   "job reached for a silent replica holding it (default 60000; -1: "
                   "until one is back; 0: not at all; docs/lighthouse.md)")
    p.add_argument("--omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every rank (default: CPUs / ranks)")
    p.add_argument("--max-restarts", type=int, default=100,
                   help="restarts per group before giving up (default 100)")
    p.add_argument("--max-failed-starts", type=int, default=3,
                   help="give up on a group after this many incarnations in a row "
                   "fail on their own before their first commit (default 3)")
    p.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="keep N warm spares (each a group's worth of ranks, set up and "
                   "waiting); a lost group's restart takes one over (docs/spares.md)")
    p.add_argument("--spare-nice", type=int, default=19, metavar="N",
                   help="a spare runs N nicer than the trainers until its takeover, so "
                   "its setup takes the CPU the training leaves (default 19, the lowest "
                   "priority; 0: the trainers' priority)")
    p.add_argument("--term-grace", type=float, default=2.0, metavar="SECONDS",
                   help="SIGTERM to SIGKILL when ending a group (default 2)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop everything after this long")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="failure schedule, e.g. kill:every=20s (repeatable)")
    p.add_argument("--timeline", default=None, help="JSON lines output file")
    p.add_argument("--log-dir", default=None,
                   help="write each rank's output to LOG_DIR/groupG.rankR.incK.log")
    p.add_argument("--stop-file", default=None,
                   help="file through which finish(step) tells workers where to stop")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--netns", action="store_true",
                   help="run each group in its own network namespace (root; implied by "
                   "partition and link injection and --link)")
    p.add_argument("--link", action="append", default=[], metavar="SHAPE",
                   help="shape the groups' links for the whole run, e.g. "
                   "rate=1gbit,delay=5ms or group=1,loss=1%% (keys rate, delay, jitter, "
                   "loss, reset, group; repeatable; implies --netns)")
    p.add_argument("--no-python", action="store_true",
                   help="run SCRIPT as an executable, not with this Python")
    p.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module (python -m)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def training_command(args: argparse.Namespace) -> list[str]:
    """The trainer's command line from the launchers' common options
    (``script``, ``script_args``, ``--module``, ``--no-python``)."""
    if args.no_python:
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-m", args.script, *args.script_args]
    return [sys.executable, args.script, *args.script_args]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stepguard-launch`` and ``python -m stepguard.launch``."""
    args = _parser().parse_args(argv)
    try:
        failures = [parse_failure_spec(s) for s in args.inject]
        links = [parse_link_spec(s) for s in args.link]
    except ValueError as e:
        print(f"stepguard-launch: {e}", file=sys.stderr)
        return 2
    cmd = training_command(args)
    cfg = LaunchConfig(
        cmd=cmd, groups=args.groups, nproc_per_group=args.nproc_per_group,
        lighthouse=args.lighthouse, lighthouse_impl=args.lighthouse_impl,
        lighthouses=args.lighthouses, etcd=args.etcd,
        min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        omp_threads=args.omp_threads, max_restarts=args.max_restarts,
        max_failed_starts=args.max_failed_starts,
        restart_delay=args.restart_delay, duration=args.duration, failures=failures,
        timeline=args.timeline, log_dir=args.log_dir, stop_file=args.stop_file,
        master_addr=args.master_addr, quiet=args.quiet, term_grace=args.term_grace,
        netns=args.netns, links=links, spares=args.spares, spare_nice=args.spare_nice,
        state_loss_wait_ms=args.state_loss_wait_ms,
    )
    if cfg.netns or links or any(f.kind in ("partition", "link") for f in failures):
        why = netns_unavailable()
        if why is not None:
            print("stepguard-launch: partition and link injection, --link and --netns "
                  f"run each group in a network namespace, and {why}", file=sys.stderr)
            return 2
    try:
        return Launcher(cfg).run()
    except (RuntimeError, ValueError, OSError) as e:
        print(f"stepguard-launch: {e}", file=sys.stderr)
        return 1


def _console_main() -> None:
    sys.exit(main())
