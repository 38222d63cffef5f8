"""``import stepguard as torchft``: every name the installed torchft exports
at top level and in the modules stepguard mirrors exists here, and every
public function and method takes the same parameters with the same
defaults."""

from __future__ import annotations

import importlib
import inspect
from typing import List, Optional, Tuple

import pytest

torchft = pytest.importorskip("torchft")

MODULES = [
    "process_group",
    "manager",
    "work",
    "futures",
    "ddp",
    "optim",
    "data",
    "checkpointing",
    "checkpointing.transport",
    "checkpointing.http_transport",
    "checkpointing.pg_transport",
    "checkpointing._rwlock",
    "checkpointing._serialization",
    "local_sgd",
    "otel",
    "parameter_server",
]

# Private helpers torchft code imports from these modules, that we provide.
PRIVATE_USED = {
    "manager": ["_ManagedWork", "_ManagedFuture", "_SimpleFuture", "_ManagerLogger"],
    "work": ["_DummyWork"],
    "process_group": ["_ErrorSwallowingWork", "_WorkAcceleratorTimeout", "_rendezvous",
                      "_Rendezvous"],
    "checkpointing._serialization": ["_streaming_save", "_streaming_load"],
    "checkpointing.http_transport": ["_split_chunks", "_merge_chunks", "_to_cpu"],
    "checkpointing.pg_transport": ["_TensorMeta", "_DTensorMeta", "_StateDictMeta"],
}

# torchft's process-group internals of the child-process "baby" groups
# (ours run in process) and its timeout event loop (ours is a timer thread).
NOT_MIRRORED = {
    "process_group": {"_BabyWork", "_FutureMetadata", "_OpMetadata", "_PickleSafeOptions",
                      "_assert_list", "_is_any_cuda", "_is_any_xpu", "_maybe_share_tensors"},
    "futures": {"_TIMEOUT_MANAGER", "_TimeoutManager", "_TimerHandle"},
}


def public_names(mod: object, modname: str) -> List[str]:
    declared = getattr(mod, "__all__", None)
    if declared is not None:
        return list(declared)
    return [
        n for n in dir(mod)
        if not n.startswith("_") and getattr(getattr(mod, n), "__module__", None) == modname
    ]


def params(fn: object) -> Optional[List[Tuple[str, str, str]]]:
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return [
        (p.name, str(p.kind),
         "" if p.default is inspect.Parameter.empty else repr(p.default))
        for p in sig.parameters.values()
    ]


def test_top_level_names() -> None:
    import stepguard

    missing = [n for n in torchft.__all__ if not hasattr(stepguard, n)]
    assert missing == []
    assert set(torchft.__all__) <= set(stepguard.__all__)
    assert stepguard.Optimizer.__name__ == "OptimizerWrapper"


@pytest.mark.parametrize("sub", MODULES)
def test_module_names(sub: str) -> None:
    theirs = importlib.import_module(f"torchft.{sub}")
    ours = importlib.import_module(f"stepguard.{sub}")
    wanted = public_names(theirs, theirs.__name__) + PRIVATE_USED.get(sub, [])
    missing = [n for n in wanted if not hasattr(ours, n)]
    assert missing == [], f"stepguard.{sub} lacks {missing}"
    own = {n for n in dir(theirs) if getattr(getattr(theirs, n), "__module__", None) == theirs.__name__}
    unknown = sorted(own - set(dir(ours)) - NOT_MIRRORED.get(sub, set()))
    # Every name torchft defines in the module is either here or listed
    # above as deliberately not mirrored.
    assert unknown == [], f"stepguard.{sub} lacks {unknown}"


@pytest.mark.parametrize("sub", MODULES)
def test_signatures(sub: str) -> None:
    theirs = importlib.import_module(f"torchft.{sub}")
    ours = importlib.import_module(f"stepguard.{sub}")
    diffs = []
    for name in public_names(theirs, theirs.__name__):
        a, b = getattr(theirs, name), getattr(ours, name)
        if inspect.isclass(a):
            for meth, fn in vars(a).items():
                if (meth.startswith("_") and meth != "__init__") or not callable(fn):
                    continue
                other = getattr(b, meth, None)
                if other is None:
                    diffs.append(f"{name}.{meth} missing")
                elif params(fn) != params(other):
                    diffs.append(f"{name}.{meth}: {params(fn)} != {params(other)}")
        elif inspect.isfunction(a) and params(a) != params(b):
            diffs.append(f"{name}: {params(a)} != {params(b)}")
    assert diffs == []


def test_manager_constructor_defaults() -> None:
    from stepguard.manager import Manager

    ours = inspect.signature(Manager.__init__).parameters
    theirs = inspect.signature(torchft.Manager.__init__).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        if name == "hostname":  # the machine's name, evaluated at import
            continue
        assert repr(ours[name].default) == repr(p.default), name


def test_backend_names_match() -> None:
    import stepguard.process_group as ours
    import torchft.process_group as theirs

    for cls in ("ProcessGroupGloo", "ProcessGroupBabyGloo"):
        assert getattr(ours, cls)().getBackendName() == getattr(theirs, cls)().getBackendName()
    assert ours.ProcessGroupDummy(0, 1).getBackendName() == \
        theirs.ProcessGroupDummy(0, 1).getBackendName()


def test_coordination_does_not_import_torch() -> None:
    """The lighthouse CLI imports stepguard.coordination: it must not pay
    for torch; the training names load on first use."""
    import subprocess
    import sys

    code = (
        "import sys, stepguard, stepguard.coordination\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "from stepguard import Manager\n"
        "assert 'torch' in sys.modules and Manager.__module__ == 'stepguard.manager'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
