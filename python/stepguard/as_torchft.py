"""torchft mode: the name ``torchft`` imports stepguard, for a whole program.

Switched on by ``STEPGUARD_TORCHFT=1`` in the environment.  A line in
``stepguard-torchft.pth`` (site-packages) calls :func:`install` at every
interpreter start when the variable is set, so the mode holds in every
child that inherits the environment: torchrun's workers, ``multiprocessing``
spawn and forkserver children, plain ``subprocess`` Pythons.

In the mode:

- ``torchft`` and every ``torchft.X`` that stepguard has are the very module
  objects ``stepguard`` and ``stepguard.X`` (so ``mock.patch("torchft.
  manager.ManagerClient")`` patches what stepguard's Manager calls);
  ``torchft._torchft`` is :mod:`stepguard._torchft`, the coordination
  classes and ``lighthouse_main``;
- torchft's test files and their helpers (``*_test``, ``*_bench``,
  ``_test/``, ``_test_utils``) load from an installed torchft wheel, under
  their torchft names, so its shipped suite runs against stepguard;
- a torchft module stepguard does not provide raises the ImportError
  torchft itself raises where its optional dependency is missing
  (``torchft.torchcomms``: ``No module named 'torchcomms'``), or a
  ModuleNotFoundError naming the module;
- the real torchft's ``torchft_lighthouse`` script, which imports
  ``torchft._torchft``, starts stepguard's lighthouse.

``stepguard-torchft CMD [ARG...]`` (also ``python -m stepguard.as_torchft``)
runs CMD in the mode, with a directory first on PATH that holds a
``torchft_lighthouse`` command of stepguard's own (for machines without
torchft installed); with no CMD it prints the ``export`` lines for a shell.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shlex
import sys
import tempfile
from types import ModuleType
from typing import Sequence

from stepguard import config

__all__ = ["ENV", "active", "install", "installed", "main"]

#: the environment variable that switches the mode on (any value but "" / "0")
ENV = "STEPGUARD_TORCHFT"

_ALIAS = "torchft"
_TARGET = "stepguard"

# torchft modules stepguard does not provide whose import, in torchft, fails
# first on an optional dependency: the mode raises that same error.
_OPTIONAL_DEPENDENCY = {
    "torchcomms": "torchcomms",
    "quantization": "triton",
}


def active(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for the mode."""
    return bool(config.get("STEPGUARD_TORCHFT", environ=environ))


def _from_wheel(rest: str) -> bool:
    """Whether torchft.<rest> is a test file or helper, loaded from the wheel."""
    parts = rest.split(".")
    if any(p in ("_test", "_test_utils") for p in parts):
        return True
    return parts[-1].endswith("_test") or parts[-1].endswith("_bench")


def _wheel_root() -> str | None:
    """The installed torchft package directory, found without importing it."""
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), _ALIAS)
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    return None


class _AliasLoader(importlib.abc.Loader):
    """Registers an already importable stepguard module under a torchft name."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set __spec__ to the alias's; stepguard's module
        # keeps its own identity (its name, -m, reload, pickling)
        module.__spec__ = self._spec


class _Finder(importlib.abc.MetaPathFinder):
    """sys.meta_path[0] in the mode: resolves every torchft name."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _ALIAS:
            return importlib.util.spec_from_loader(
                fullname, _AliasLoader(_TARGET), is_package=True
            )
        if not fullname.startswith(_ALIAS + "."):
            return None
        rest = fullname[len(_ALIAS) + 1 :]
        if _from_wheel(rest):
            return self._wheel_spec(fullname, rest)
        target_name = f"{_TARGET}.{rest}"
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            found = None
        if found is not None:
            return importlib.util.spec_from_loader(
                fullname,
                _AliasLoader(target_name),
                is_package=found.submodule_search_locations is not None,
            )
        dependency = _OPTIONAL_DEPENDENCY.get(rest)
        if dependency is not None and importlib.util.find_spec(dependency) is None:
            raise ModuleNotFoundError(f"No module named {dependency!r}", name=dependency)
        raise ModuleNotFoundError(
            f"No module named {fullname!r} (stepguard, standing in for torchft, "
            f"does not provide it)",
            name=fullname,
        )

    @staticmethod
    def _wheel_spec(fullname: str, rest: str) -> importlib.machinery.ModuleSpec | None:
        root = _wheel_root()
        if root is None:
            return None
        base = os.path.join(root, *rest.split("."))
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[base]
            )
        if os.path.isdir(base):  # a namespace package such as torchft._test
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [base]
            return spec
        return None


_finder = _Finder()


def installed() -> bool:
    """Whether this interpreter is in the mode."""
    return _finder in sys.meta_path


def install() -> None:
    """Puts this interpreter in the mode (idempotent).

    A real torchft already imported here is an error: its modules and
    stepguard's cannot both be ``torchft``.
    """
    existing = sys.modules.get(_ALIAS)
    if existing is not None and existing is not sys.modules.get(_TARGET):
        raise RuntimeError(
            "torchft is already imported; stepguard's torchft mode must start "
            f"before it (set {ENV}=1 in the environment)"
        )
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    # first, ahead of path-based finders that would find the real wheel
    sys.meta_path.insert(0, _finder)


def _startup() -> None:
    """Called from stepguard-torchft.pth at every interpreter start."""
    if active():
        install()


# ---- the command -------------------------------------------------------------


def bin_dir() -> str:
    """A directory holding this Python's ``torchft_lighthouse`` command.

    Written once per interpreter, under the user's cache (or the temporary
    directory when that is not writable).
    """
    tag = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    script = (
        f"#!{sys.executable}\n"
        "import sys\n"
        "from stepguard.coordination import lighthouse_main\n"
        "sys.exit(lighthouse_main())\n"
    )
    cache = config.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    for parent in (os.path.join(cache, "stepguard"), tempfile.gettempdir()):
        directory = os.path.join(parent, f"torchft-bin-{os.getuid()}-{tag}")
        path = os.path.join(directory, "torchft_lighthouse")
        try:
            with open(path) as f:
                if f.read() == script:
                    return directory
        except OSError:
            pass
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(script)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
            return directory
        except OSError:
            continue
    raise RuntimeError("stepguard-torchft: no writable directory for torchft_lighthouse")


def environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables the mode sets: its switch, and PATH with bin_dir() first."""
    environ = dict(os.environ if environ is None else environ)
    path = environ.get("PATH", os.defpath)
    return {ENV: "1", "PATH": bin_dir() + os.pathsep + path}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(
            "usage: stepguard-torchft [CMD [ARG...]]\n\n"
            "Runs CMD with the name torchft importing stepguard (STEPGUARD_TORCHFT=1,\n"
            "and a torchft_lighthouse command first on PATH).  Without CMD, prints\n"
            'the export lines for a shell: eval "$(stepguard-torchft)".'
        )
        return 0
    env = environment()
    if not args:
        for key, value in env.items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    full = dict(os.environ)
    full.update(env)
    try:
        os.execvpe(args[0], args, full)
    except OSError as e:
        print(f"stepguard-torchft: {args[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


def _console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _console_main()
