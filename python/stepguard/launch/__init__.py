"""stepguard-launch: run replica groups, restart them, inject failures.

A small torchrun for fault-tolerance experiments on one machine.  It starts
(or uses) a lighthouse, runs ``N`` replica groups of ``M`` ranks with the
environment torchrun would give them plus the variables torchft reads, hosts
a fresh TCPStore for every incarnation of every group, and when a rank of a
group dies it ends the whole group and starts it again, as torchrun does.

On request it injects failures on a schedule:

``kill``      SIGKILL one rank of a group (``rank=all``: every rank; the
              group then restarts);
``hang``      SIGSTOP every rank of a group, then SIGCONT (``then=cont``,
              the default) or SIGKILL (``then=kill``) after ``duration``;
``slow``      limit a group to a fraction of one CPU for ``duration``:
              cgroup v2 ``cpu.max`` when a writable cgroup v2 hierarchy
              with the cpu controller exists, else cgroup v1
              ``cpu.cfs_quota_us``, else SIGSTOP/SIGCONT duty cycling (the
              timeline says which);
``partition`` cut a group off the network for ``duration``, then heal it.
              Every group then runs in its own network namespace (root and
              the ``ip`` and ``unshare`` commands are needed; see
              :class:`_Netns`), also available without partitions as
              ``--netns``;
``link``      shape a group's link for ``duration``, then restore it:
              ``rate`` (``100mbit``; tc tbf, each direction), ``delay`` and
              ``jitter`` (added to each direction), ``loss`` (``1%`` of the
              packets, each direction) and ``reset`` (``5%`` of the TCP
              segments reset their connection) through a userspace packet
              relay (see :mod:`stepguard.launch.links`); network
              namespaces as for ``partition``.  ``--link`` shapes links
              for the whole run;
``lighthouse`` SIGKILL the lighthouse the launcher started and start it
              again on the same port after ``duration`` (with its
              ``--quorum_id_file`` unless ``id_file=no``);
``kill_source`` arm the ``serve`` fault point (:func:`hook_point`) and
              SIGKILL the recovery source that reaches it, while a peer
              heals from it (a group is killed first to make a heal);
``kill_after_heal`` the same with the ``after_heal`` point: SIGKILL a
              replica during its first step after a heal.

A spec reads ``KIND:key=value,...``, e.g. ``kill:every=20s``,
``kill:every=20s,random,seed=3`` (intervals drawn uniformly from
[0.5, 1.5] x every), ``hang:every=30s,duration=10s,then=kill``,
``slow:start=10s,duration=30s,cpu=0.25,group=1``,
``partition:start=20s,duration=8s,group=2``,
``link:start=10s,duration=20s,group=1,rate=100mbit,delay=20ms,jitter=5ms,loss=1%``,
``link:every=30s,duration=2s,reset=100%``.  Other keys: ``start``
(first injection, default ``every``), ``stop`` (no injection after this
time), ``count``, ``group``, ``rank``.

Everything that happens goes to a timeline of JSON lines (``--timeline``):
launches, exits, restarts, injections, and the workers' own events, which
they send with :func:`report` over a pipe the launcher reads; from those the
launcher derives quorum changes, commits, discards, and recoveries with
their durations (a worker that reports ``ready`` once its setup is done
also gets the time from there to its first commit, ``join_s``).  Ctrl-C
(or SIGTERM) ends every process it started, by process group id, and
removes the namespaces and cgroups it created.

Worker helpers (dependency-free, usable from any training script):
:func:`report` sends an event, :func:`stop_step` reads the step at which the
launcher asked the workers to finish.

The package, one module per part:

``worker``    what a training script calls (:func:`report`, :func:`stop_step`)
              and the environment names the two sides share;
``spec``      failure schedules: :class:`FailureSpec`,
              :func:`parse_failure_spec`;
``netns``     the network namespaces of ``partition``, ``link`` and ``--netns``;
``links``     the link shaping of ``link`` and ``--link`` (tbf, and the relay
              process ``linkrelay``);
``cgroups``   the CPU limits of ``slow``;
``launcher``  :class:`LaunchConfig` and :class:`Launcher`: groups,
              restarts, injection, the timeline;
``spare_pool`` the warm spares of ``--spares N`` (see
              :mod:`stepguard.spares` and ``docs/spares.md``);
``cli``       ``stepguard-launch`` and ``python -m stepguard.launch``.
``slurm``     ``stepguard-slurm``: the groups as Slurm jobs, kept running
              from the head node (not imported here: see its docstring).
"""

from stepguard.launch.cgroups import _CpuLimit
from stepguard.launch.cli import _console_main, main
from stepguard.launch.launcher import LaunchConfig, Launcher
from stepguard.launch.netns import _Netns, netns_unavailable
from stepguard.launch.spec import FailureSpec, parse_failure_spec, parse_link_spec
from stepguard.launch.worker import (
    EVENTS_FD_ENV,
    INCARNATION_ENV,
    STOP_FILE_ENV,
    report,
    stop_step,
)

__all__ = [
    "FailureSpec",
    "LaunchConfig",
    "Launcher",
    "main",
    "netns_unavailable",
    "parse_failure_spec",
    "parse_link_spec",
    "report",
    "stop_step",
]
