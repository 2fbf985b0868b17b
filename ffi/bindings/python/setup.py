"""Build hook of the ``ferry`` Python package: builds ``libferry_c.so`` with cargo and ships it
inside the package.

``pip install ./ffi/bindings/python`` (from the repository root) runs ``cargo build --release -p
ferry-capi -p ferry-cli`` in the Cargo workspace two directories up and copies the library into
the wheel (for an editable install, ``pip install -e``, into ``src/ferry/``). Building the C API
together with the CLI gives every shared crate the features README's first command (``cargo run
--release -p ferry-cli -- demo``) built it with, so after that command only the C API's own
crate is compiled; built alone, tokio (and everything above it) would be rebuilt with other
features. Cargo's progress goes to the terminal (``/dev/tty``) when there is one, since pip
hides a build's output unless run with ``-v``.

Environment:
  FERRY_CARGO_PROFILE  cargo profile to build (default ``release``; ``debug`` is faster to build)
  FERRY_CAPI_LIB       path of an already built libferry_c.so: bundled as is, cargo is not run
  FERRY_WORKSPACE      the Cargo workspace root, when the package is built outside the repository
  CARGO                the cargo executable (default: ``cargo`` on PATH, then ~/.cargo/bin/cargo)
  FERRY_BUILD_LOG      ``inherit``: cargo's output goes to pip's log instead of the terminal
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
LIB_NAME = "libferry_c.so"


def fail(message: str) -> None:
    sys.stderr.write(f"\nferry build: {message}\n\n")
    raise SystemExit(1)


def workspace_root() -> Path:
    root = Path(os.environ.get("FERRY_WORKSPACE") or HERE.parent.parent.parent).resolve()
    if not (root / "Cargo.toml").is_file() or not (root / "ffi" / "bindings" / "c" / "Cargo.toml").is_file():
        fail(
            f"{root} is not the Ferry Cargo workspace (no Cargo.toml with ffi/bindings/c). Build from the "
            f"repository with `pip install ./ffi/bindings/python`, set FERRY_WORKSPACE to the repository, "
            f"or set FERRY_CAPI_LIB to a built {LIB_NAME}."
        )
    return root


def cargo_executable() -> str:
    for candidate in (os.environ.get("CARGO"), shutil.which("cargo"), str(Path.home() / ".cargo" / "bin" / "cargo")):
        if candidate and Path(candidate).is_file():
            return candidate
    fail(f"cargo was not found (install Rust with rustup, or set CARGO, or set FERRY_CAPI_LIB to a built {LIB_NAME})")


def build_library() -> Path:
    prebuilt = os.environ.get("FERRY_CAPI_LIB")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            fail(f"FERRY_CAPI_LIB={prebuilt!r} does not name a file")
        print(f"ferry build: bundling {path} (FERRY_CAPI_LIB)", flush=True)
        return path
    root = workspace_root()
    cargo = cargo_executable()
    profile = os.environ.get("FERRY_CARGO_PROFILE", "release").strip() or "release"
    # With the CLI: the same feature set as README's first command, so its build is reused.
    cmd = [cargo, "build", "-p", "ferry-capi", "-p", "ferry-cli"]
    if profile == "release":
        cmd.append("--release")
        out_dir = "release"
    elif profile in ("debug", "dev"):
        out_dir = "debug"
    else:
        cmd += ["--profile", profile]
        out_dir = profile
    print(f"ferry build: {' '.join(cmd)} (in {root})", flush=True)
    if subprocess.run(cmd, cwd=root, stderr=terminal()).returncode != 0:
        fail(f"`{' '.join(cmd)}` failed (see the cargo output above)")
    meta = subprocess.run(
        [cargo, "metadata", "--format-version", "1", "--no-deps"], cwd=root, capture_output=True, text=True
    )
    if meta.returncode != 0:
        fail(f"`cargo metadata` failed: {meta.stderr.strip()}")
    lib = Path(json.loads(meta.stdout)["target_directory"]) / out_dir / LIB_NAME
    if not lib.is_file():
        fail(f"cargo succeeded but {lib} does not exist")
    return lib


def terminal():
    """The user's terminal for cargo's progress (pip captures the build's own output), or None
    (inherit) without one, or when FERRY_BUILD_LOG=inherit asks for the output in pip's log."""
    if os.environ.get("FERRY_BUILD_LOG") == "inherit":
        return None
    try:
        tty = open("/dev/tty", "w")  # noqa: SIM115 (kept open for the child; closed at exit)
    except OSError:
        return None
    tty.write("ferry build: compiling the C API with cargo (progress below; pip -v shows it too)\n")
    tty.flush()
    return tty


class BuildPyWithCargo(build_py):
    """build_py that also builds libferry_c.so and places it in the package."""

    def run(self) -> None:
        super().run()
        lib = build_library()
        # An editable install (pip install -e) imports the package from src/: put it there.
        package_dir = HERE / "src" if getattr(self, "editable_mode", False) else Path(self.build_lib)
        dest = package_dir / "ferry" / LIB_NAME
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest)


class PlatformWheel(bdist_wheel):
    """The wheel holds a native library but no Python extension: tag it py3-none-<platform>."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):  # type: ignore[no-untyped-def]
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildPyWithCargo, "bdist_wheel": PlatformWheel})
