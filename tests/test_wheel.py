"""The package as users install it: a built wheel (and an editable install) opens a store.

Builds from a copy of the source tree (no build/ or egg-info left in the checkout),
installs with ``--no-deps`` into a fresh venv that sees this interpreter's third-party
packages through a ``.pth`` file, and runs from a scratch working directory.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SOURCES = ["pyproject.toml", "README.md", "rolloutstore", "trainer", "schemas"]

SCRIPT = """
import json, sys
import rolloutstore
from rolloutstore import RolloutStore
from rolloutstore.schema import spec as S
store = RolloutStore.open("store")
store.append([{"prompt_ids": [1, 2], "completion_ids": [3], "behavior_logprobs": [-0.5],
               "policy_version": 4}])
again = RolloutStore.open("store", create=False)
row = again.sql("SELECT policy_version, completion_ids FROM rollouts").to_pylist()
print(json.dumps({"file": rolloutstore.__file__, "schema_dir": str(S.schema_dir()),
                  "rows": row, "count": again.count()}))
"""


def _run(*cmd, cwd=None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _fresh_venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", "--without-pip", str(path))
    python = path / "bin" / "python"
    purelib = Path(
        _run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    # Third-party packages of the interpreter running the tests; a plain path line adds the
    # folder without running its .pth files (so no editable finder of another checkout).
    shared = [
        p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if os.path.isdir(p)
    ]
    (purelib / "shared_site.pth").write_text("".join(p + "\n" for p in dict.fromkeys(shared)))
    return python


def _pip(python: Path, *args) -> None:
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        *args,
    )


def _check_store_opens(python: Path, tmp: Path, inside: Path) -> dict:
    import json

    work = tmp / "cwd"
    work.mkdir()
    out = json.loads(_run(str(python), "-c", SCRIPT, cwd=work).strip().splitlines()[-1])
    assert out["rows"] == [{"policy_version": 4, "completion_ids": [3]}] and out["count"] == 1
    assert Path(out["file"]).resolve().is_relative_to(inside.resolve()), out
    return out


@pytest.mark.slow
def test_wheel_ships_the_schema_and_opens_a_store(tmp_path):
    src = _copy_sources(tmp_path / "src")
    dist = tmp_path / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(dist),
        str(src),
    )
    (wheel,) = dist.glob("rolloutstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "rolloutstore/schemas/rollout.v1.json" in names
    # Every package folder of the checkout is in the wheel (pyproject lists them).
    for init in [*ROOT.glob("rolloutstore/**/__init__.py"), *ROOT.glob("trainer/**/__init__.py")]:
        assert init.relative_to(ROOT).as_posix() in names, init
    for name in ("rollout.v1.json", "rollout.v2.json"):  # v2 written, v1 still read
        packaged = zipfile.ZipFile(wheel).read(f"rolloutstore/schemas/{name}")
        assert packaged == (ROOT / "schemas" / name).read_bytes()
    venv = tmp_path / "venv"
    python = _fresh_venv(venv)
    _pip(python, str(wheel))
    out = _check_store_opens(python, tmp_path, venv)
    assert Path(out["schema_dir"]).resolve().is_relative_to(venv.resolve())
    # The console script reads the packaged schema too.
    assert "rollout schema v2" in _run(str(venv / "bin" / "rolloutstore"), "schema", cwd=tmp_path)


@pytest.mark.slow
def test_editable_install_reads_the_top_level_schemas(tmp_path):
    src = _copy_sources(tmp_path / "src")
    python = _fresh_venv(tmp_path / "venv")
    _pip(python, "-e", str(src))
    out = _check_store_opens(python, tmp_path, src)
    assert Path(out["schema_dir"]) == (src / "schemas").resolve()
