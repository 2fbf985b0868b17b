"""`python -m ferry.alias install|uninstall|status`: in a fresh environment an unmodified script
written against `mooncake.engine` runs on Ferry, the import fails again after `uninstall`, and the
alias refuses to shadow a real Mooncake."""

from __future__ import annotations

import subprocess
from pathlib import Path

from _support import REPO, Child, alias_python, ferry_site, make_venv, mooncake_python

MOONCAKE_PEER = REPO / "transports" / "tcp" / "tests" / "interop" / "mooncake_peer.py"


def run(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=120)


def alias(python: Path, command: str) -> subprocess.CompletedProcess:
    return run(python, "-m", "ferry.alias", command)


def test_alias_install_runs_an_unmodified_mooncake_script_and_uninstall_undoes_it(tmp_path, child_factory):
    python = make_venv(tmp_path / "venv", ferry_site())
    before = run(python, "-c", "import mooncake.engine")
    assert before.returncode != 0 and "No module named 'mooncake'" in before.stderr
    st = alias(python, "status")
    assert st.returncode == 0 and "alias: not installed" in st.stdout and "nothing" in st.stdout, st.stdout

    done = alias(python, "install")
    assert done.returncode == 0, done.stderr
    st = alias(python, "status")
    assert "alias: installed" in st.stdout and "mooncake.engine -> Ferry" in st.stdout, st.stdout
    probe = run(
        python,
        "-c",
        "from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode; import ferry; "
        "print(TransferEngine is ferry.TransferEngine, TransferOpcode.Write == 1)",
    )
    assert probe.stdout.split() == ["True", "True"], probe.stderr
    other = run(python, "-c", "import mooncake.store")
    assert other.returncode != 0 and "mooncake.store" in other.stderr, "only mooncake.engine is provided"
    plain = run(python, "-c", "import json, sys; print(sorted(m for m in sys.modules if m.startswith('ferry')))")
    assert plain.stdout.strip() == "[]", "the hook loads nothing of Ferry until mooncake is imported"

    # Ferry's Mooncake interop peer, written for the wheel, unmodified, served by Ferry and read
    # by the real wheel.
    target = child_factory(Child([str(python), str(MOONCAKE_PEER), "target", str(1 << 20), "41"]))
    info = target.read_json()
    assert info["first"] == info["addr"]
    mc = child_factory(
        Child(
            [str(mooncake_python()), str(MOONCAKE_PEER), "initiator", info["segment"], str(info["addr"]), "41",
             str(1 << 19), "43", "4096", str(1 << 16)]
        )
    )
    result = mc.read_json(timeout=120)
    assert all(r["rc"] == 0 and r["ok"] for r in result["reads"]), result
    assert all(w["rc"] == 0 for w in result["writes"]), result
    assert target.ask(f"check {1 << 19} {1 << 16} 43") == "ok"
    assert target.ask(f"check {1 << 19} {1 << 16} 44") != "ok", "the check can fail"

    done = alias(python, "uninstall")
    assert done.returncode == 0, done.stderr
    after = run(python, "-c", "import mooncake.engine")
    assert after.returncode != 0 and "No module named 'mooncake'" in after.stderr
    st = alias(python, "status")
    assert "alias: not installed" in st.stdout and "nothing" in st.stdout, st.stdout
    assert alias(python, "uninstall").returncode == 0, "uninstalling twice is harmless"


def test_alias_refuses_to_shadow_a_real_mooncake(tmp_path):
    wheel_site = Path(run(mooncake_python(), "-c", "import mooncake, pathlib; print(pathlib.Path(mooncake.__file__).parent.parent)").stdout.strip())
    python = make_venv(tmp_path / "venv", ferry_site(), wheel_site)
    done = alias(python, "install")
    assert done.returncode == 1
    assert "refusing to install: the real Mooncake is installed" in done.stderr, done.stderr
    st = alias(python, "status")
    assert "alias: not installed" in st.stdout and "the real Mooncake" in st.stdout, st.stdout
    real = run(python, "-c", "import mooncake.engine as m; print(hasattr(m, 'InnerTransferEngine'))")
    assert real.stdout.strip() == "True", "the wheel's own module, untouched"


def test_a_real_mooncake_installed_after_the_alias_wins(tmp_path):
    python = alias_python(tmp_path / "venv")
    wheel_site = Path(run(mooncake_python(), "-c", "import mooncake, pathlib; print(pathlib.Path(mooncake.__file__).parent.parent)").stdout.strip())
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "zz_later_mooncake.pth").write_text(f"{wheel_site}\n")
    real = run(python, "-c", "import mooncake.engine as m; print(hasattr(m, 'InnerTransferEngine'))")
    assert real.stdout.strip() == "True", real.stderr
    st = alias(python, "status")
    assert "alias: installed" in st.stdout and "the real Mooncake" in st.stdout, st.stdout
