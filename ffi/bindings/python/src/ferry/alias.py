"""``python -m ferry.alias install|uninstall|status``: an opt-in alias that makes
``import mooncake.engine`` (and ``from mooncake.engine import TransferEngine``) load Ferry in the
current Python environment, so programs written against Mooncake's transfer engine (vLLM's
MooncakeConnector, SGLang, vllm-ascend, Mooncake's own tests) run on Ferry without an edit.

How it works: ``install`` writes two files into the environment's ``site-packages``:

- ``_ferry_mooncake_alias.py``, a small import hook (a :class:`importlib.abc.MetaPathFinder`
  appended to the *end* of ``sys.meta_path``) that answers ``mooncake`` and ``mooncake.engine``
  only when no real ``mooncake`` package is found first. ``mooncake.engine`` then re-exports
  ``ferry.engine`` (``TransferEngine``, ``TransferNotify``, ``TransferOpcode``, ``Read``,
  ``Write``); other ``mooncake.*`` modules (the store, the EP buffer) do not exist.
- ``_ferry_mooncake_alias.pth``, one line that imports the hook at interpreter start. The hook
  imports nothing of Ferry until ``mooncake`` is imported, so other programs start as before.

``install`` refuses when the real Mooncake package is installed in the environment (the alias
must never shadow it); ``uninstall`` removes both files (``import mooncake`` then fails as
before); ``status`` says whether the alias is installed and which implementation
``mooncake.engine`` resolves to. Exit status: 0 on success, 1 when refused or failed, and for
``status`` 0 as well (it only reports).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence

HOOK_MODULE = "_ferry_mooncake_alias"
"""Name of the import-hook module written into site-packages."""

PTH_NAME = f"{HOOK_MODULE}.pth"
"""Name of the ``.pth`` file that loads the hook at interpreter start."""

MARKER = "__ferry_alias__"
"""Attribute set on the alias's ``mooncake`` and ``mooncake.engine`` modules."""

_HOOK_SOURCE = '''"""Ferry's alias for Mooncake (written by `python -m ferry.alias install`; remove it with
`python -m ferry.alias uninstall`). Answers `import mooncake` / `import mooncake.engine` with
Ferry when no real `mooncake` package is found first."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

MARKER = "__ferry_alias__"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        setattr(module, MARKER, True)
        if module.__name__ == "mooncake":
            module.__doc__ = "Ferry's alias of Mooncake: only mooncake.engine is provided (python -m ferry.alias status)"
            module.__path__ = []
            return
        import ferry.engine as engine

        names = list(engine.__all__)
        module.__dict__.update({name: getattr(engine, name) for name in names})
        module.__all__ = names
        module.__doc__ = "Ferry's transfer engine under Mooncake's name (" + engine.__file__ + ")"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ("mooncake", "mooncake.engine"):
            return None
        if fullname == "mooncake.engine":
            parent = sys.modules.get("mooncake")
            if parent is None or not getattr(parent, MARKER, False):
                return None  # the real mooncake package was imported: never mix the two
        return importlib.util.spec_from_loader(
            fullname, _Loader(), origin="ferry-alias", is_package=fullname == "mooncake"
        )


def install():
    if not any(isinstance(f, _Finder) or type(f).__name__ == "_Finder" for f in sys.meta_path):
        sys.meta_path.append(_Finder())


install()
'''


def site_dir() -> Path:
    """The ``site-packages`` directory of this interpreter's environment (where pip installs)."""
    return Path(sysconfig.get_paths()["purelib"])


def real_mooncake() -> Optional[str]:
    """Where the real Mooncake package is installed in this environment, or ``None``.

    Looks for a ``mooncake`` package on ``sys.path`` (without the alias's hook) and for an
    installed distribution that provides one (``mooncake-transfer-engine*``)."""
    spec = importlib.machinery.PathFinder.find_spec("mooncake")
    if spec is not None:
        where = spec.origin if spec.origin not in (None, "namespace") else ", ".join(spec.submodule_search_locations or [])
        return f"a `mooncake` package at {where}"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("mooncake"):
            return f"the distribution {dist.metadata['Name']} {dist.version}"
    return None


def _installed_files(site: Path) -> List[Path]:
    return [p for p in (site / PTH_NAME, site / f"{HOOK_MODULE}.py") if p.exists()]


def install(site: Optional[Path] = None) -> int:
    """Installs the alias into ``site`` (default: this environment's site-packages)."""
    site = site or site_dir()
    real = real_mooncake()
    if real is not None:
        print(
            f"ferry.alias: refusing to install: the real Mooncake is installed in this environment ({real}).\n"
            f"The alias must not shadow it. Use Ferry in another environment (python -m venv ...), or uninstall "
            f"Mooncake there first (pip uninstall <its distribution>).",
            file=sys.stderr,
        )
        return 1
    try:
        site.mkdir(parents=True, exist_ok=True)
        (site / f"{HOOK_MODULE}.py").write_text(_HOOK_SOURCE)
        (site / PTH_NAME).write_text(f"import {HOOK_MODULE}\n")
    except OSError as e:
        print(f"ferry.alias: cannot write into {site}: {e}", file=sys.stderr)
        return 1
    print(f"ferry.alias: installed in {site}: `import mooncake.engine` now loads Ferry in this environment")
    return 0


def uninstall(site: Optional[Path] = None) -> int:
    """Removes the alias from ``site`` (default: this environment's site-packages)."""
    site = site or site_dir()
    files = _installed_files(site)
    if not files:
        print(f"ferry.alias: not installed in {site}: nothing to remove")
        return 0
    try:
        for f in files:
            f.unlink()
        cache = site / "__pycache__"
        if cache.is_dir():
            for f in cache.glob(f"{HOOK_MODULE}.*.pyc"):
                f.unlink()
    except OSError as e:
        print(f"ferry.alias: cannot remove the alias from {site}: {e}", file=sys.stderr)
        return 1
    print(f"ferry.alias: removed from {site}")
    return 0


def resolution() -> str:
    """Which implementation ``mooncake.engine`` resolves to in this interpreter, in words."""
    real = real_mooncake()
    hooked = any(type(f).__name__ == "_Finder" and type(f).__module__ == HOOK_MODULE for f in sys.meta_path)
    if real is not None:
        return f"mooncake.engine -> the real Mooncake ({real})"
    if hooked:
        import ferry

        return f"mooncake.engine -> Ferry {ferry.__version__} ({Path(ferry.__file__).parent}, C library {ferry.library_path()})"
    return "mooncake.engine -> nothing: `import mooncake.engine` fails (ModuleNotFoundError)"


def status(site: Optional[Path] = None) -> int:
    """Prints whether the alias is installed and what ``mooncake.engine`` resolves to."""
    site = site or site_dir()
    files = _installed_files(site)
    state = f"installed ({', '.join(str(f) for f in files)})" if files else "not installed"
    print(f"alias: {state}")
    print(resolution())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m ferry.alias``."""
    parser = argparse.ArgumentParser(
        prog="python -m ferry.alias",
        description="Make `import mooncake.engine` load Ferry in this Python environment (opt-in).",
    )
    parser.add_argument("command", choices=["install", "uninstall", "status"])
    args = parser.parse_args(argv)
    return {"install": install, "uninstall": uninstall, "status": status}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
