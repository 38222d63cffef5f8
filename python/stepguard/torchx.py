"""A torchx component: replica groups x workers, one torchrun per group.

``stepguard.torchx.hsdp`` takes the arguments of torchft's component of
the same name (in torchft mode it is ``torchft.torchx.hsdp``)::

    torchx run --scheduler local_cwd stepguard/torchx.py:hsdp \\
        --replicas 2 --workers_per_replica 2 --script train_ddp.py -- --steps 100

Every replica group is one role, ``replica_<i>``: one node (or
``nodes_per_replica``) running ``torchrun`` with ``workers_per_replica``
ranks in all, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` in its
environment and the lighthouse's address in ``TORCHFT_LIGHTHOUSE``.  The
lighthouse runs outside the app (``stepguard-lighthouse``); its address is
the ``lighthouse`` argument, else ``TORCHFT_LIGHTHOUSE`` (or
``STEPGUARD_LIGHTHOUSE``) where ``torchx run`` runs, else
``http://localhost:29510``.  ``torchrun`` restarts a group's ranks up to
``max_restarts`` times; the scheduler does not retry the role.

Single-node groups rendezvous on a free port that torchrun picks (no two
groups on one host collide); a multi-node group rendezvouses on its first
node (the scheduler's ``TORCHX_RANK0_HOST``) at ``rdzv_port``.
"""

import shlex
from typing import Dict, Optional

import torchx.specs as specs

from stepguard import config

__all__ = ["hsdp"]

_DEFAULT_LIGHTHOUSE = "http://localhost:29510"


def hsdp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "train_ddp.py",
    env: Optional[Dict[str, str]] = None,
    image: str = "",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,  # noqa: N803 - torchx's and torchft's name
    nodes_per_replica: int = 1,
    lighthouse: Optional[str] = None,
    rdzv_port: int = 29500,
) -> specs.AppDef:
    """Replica groups of torchrun workers for fault-tolerant training.

    Args:
        script_args: arguments of the training script.
        replicas: number of replica groups.
        workers_per_replica: ranks in each replica group, over all its nodes.
        max_restarts: times torchrun restarts a group's ranks.
        script: the training script every rank runs.
        env: environment of every rank (the component's variables win).
        image: the image (local schedulers: the working directory).
        h: a named resource (host type) instead of cpu/gpu/memMB.
        cpu: CPUs per node.
        gpu: GPUs per node.
        memMB: memory per node in MB.
        nodes_per_replica: nodes in each replica group.
        lighthouse: the lighthouse address(es), comma-separated.
        rdzv_port: torchrun's rendezvous port on a multi-node group's
            first node.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: at least one replica group")
    if workers_per_replica < 1:
        raise ValueError(f"workers_per_replica={workers_per_replica}: at least one")
    if nodes_per_replica < 1 or workers_per_replica % nodes_per_replica:
        raise ValueError(f"workers_per_replica={workers_per_replica} does not split over "
                         f"nodes_per_replica={nodes_per_replica}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts}: not negative")
    address = lighthouse or config.get("TORCHFT_LIGHTHOUSE") or _DEFAULT_LIGHTHOUSE
    base = dict(env or {})
    base.setdefault("LOGLEVEL", "INFO")
    if gpu == 0:
        base.setdefault("CUDA_VISIBLE_DEVICES", "")
    per_node = workers_per_replica // nodes_per_replica
    roles = []
    for group in range(replicas):
        role_env = {**base, "TORCHFT_LIGHTHOUSE": address,
                    "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(replicas)}
        run = [f"--nnodes={nodes_per_replica}", f"--nproc-per-node={per_node}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d",
               f"--rdzv-id={specs.macros.app_id}-{group}"]
        tail = [script, *script_args] if script else list(script_args)
        if nodes_per_replica == 1:
            entrypoint = "torchrun"
            args = [*run, "--rdzv-endpoint=localhost:0", *tail]
        else:
            # the first node's address comes from the scheduler at run
            # time, through the shell
            entrypoint = "bash"
            endpoint = f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"
            args = ["-c", " ".join(["exec torchrun", *map(shlex.quote, run),
                                    f"--rdzv-endpoint={endpoint}",
                                    *map(shlex.quote, tail)])]
        roles.append(specs.Role(
            name=f"replica_{group}",
            image=image,
            entrypoint=entrypoint,
            args=args,
            env=role_env,
            num_replicas=nodes_per_replica,
            min_replicas=nodes_per_replica,
            max_retries=0,
            resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
            port_map={"c10d": rdzv_port} if nodes_per_replica > 1 else {},
        ))
    return specs.AppDef(name="stepguard", roles=roles)
