"""rolloutstore never imports the trainer; commands that need a model are rolloutstore-train's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import rolloutstore
from rolloutstore import errors

PACKAGE = Path(rolloutstore.__file__).parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return names


def test_no_rolloutstore_module_imports_trainer():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 15
    bad = {
        str(f.relative_to(PACKAGE)): [n for n in _imports(f) if n.split(".")[0] == "trainer"]
        for f in files
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_model_commands_are_the_trainers_and_the_store_cli_says_where_they_moved():
    for cmd in ("generate", "rescore", "ingest"):
        p = subprocess.run([sys.executable, "-m", "trainer", cmd, "--help"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 0 and f"usage: rolloutstore-train {cmd}" in p.stdout, p.stderr
    for cmd in ("generate", "rescore"):
        p = subprocess.run([sys.executable, "-m", "rolloutstore", cmd, "S", "--model", "tiny"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 2, p.stderr
        assert p.stderr.count("\n") == 1 and f"rolloutstore-train {cmd}" in p.stderr


def test_pyproject_declares_no_plugin_entry_points():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    assert "entry-points" not in text and not (PACKAGE / "plugins.py").exists()


def test_importing_the_cli_does_not_import_the_trainer():
    code = "import sys, rolloutstore.cli, rolloutstore.retention.rescore; print(any(m.split('.')[0] == 'trainer' for m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr


def test_errors_live_in_errors_and_are_re_exported():
    from rolloutstore.io.export import ExportError, MissingDependencyError
    from rolloutstore.replay.selector import EmptyBufferError, RewardVersionError
    from rolloutstore.retention.rescore import RescoreError

    assert (
        ExportError is errors.ExportError
        and MissingDependencyError is errors.MissingDependencyError
    )
    assert (
        EmptyBufferError is errors.EmptyBufferError
        and RewardVersionError is errors.RewardVersionError
    )
    assert RescoreError is errors.RescoreError
    for cls in (
        ExportError,
        EmptyBufferError,
        RewardVersionError,
        RescoreError,
        MissingDependencyError,
    ):
        assert issubclass(cls, errors.RolloutStoreError)


def test_rescore_takes_a_scorer_and_an_advantage_function(tmp_path):
    import numpy as np
    from helpers import make_rows

    store = rolloutstore.RolloutStore.open(tmp_path / "s", embedding_dim=8)
    rows = make_rows(8, group_size=4)
    for r in rows:
        r["task"] = "len"
        r["completion_text"] = "x" * (r["sample_index"] + 1)
    store.append(rows)

    def score(row):
        return float(len(row["completion_text"]))

    score.name = "len"
    r = store.rescore(score, advantage_fn=lambda rw, g: rw - rw.mean())
    assert (r.rows, r.reward_version) == (8, 1)
    t = store.sql("SELECT sample_index, reward, advantage FROM rollouts_scored ORDER BY rollout_id")
    assert t["reward"].to_pylist() == [float(i + 1) for i in t["sample_index"].to_pylist()]
    assert np.isclose(sum(t["advantage"].to_pylist()), 0.0, atol=1e-5)
