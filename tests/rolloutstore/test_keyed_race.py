"""No duplicate ever: writers of the same rollout ids at the same moment (an actor restarted
beside its zombie, two actors given one round) land each id once, whatever the launcher
(processes, or Ray actors) and wherever the store is (a local folder, or s3:// on moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from race_writer import BATCH, N, write_all

from rolloutstore import RolloutStore

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _check(uri: str, options: dict | None, results: list[tuple[int, int]]) -> None:
    store = RolloutStore.open(uri, storage_options=options, create=False)
    ids = store.sql("SELECT rollout_id FROM rollouts")["rollout_id"].to_pylist()
    assert len(ids) == len(set(ids)) == N  # every id once: 0 duplicates, nothing lost
    assert sum(r[0] for r in results) == N  # each append landed whole or not at all
    assert sum(r[1] for r in results) == 2 * N // BATCH - N // BATCH


def _location(request, tmp_path) -> tuple[str, dict | None]:
    if request.param == "s3":
        uri, options = request.getfixturevalue("s3_bucket")
        return f"{uri}/store", options
    return str(tmp_path / "store"), None


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    uri, options = _location(request, tmp_path)
    RolloutStore.open(uri, storage_options=options)  # created before the race
    return uri, options


def test_two_processes_writing_the_same_ids_land_each_once(location, tmp_path):
    uri, options = location
    go = tmp_path / "go"
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "race_writer.py"),
        uri,
        json.dumps(options),
        str(go),
    ]
    procs = [
        subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    go.touch()  # both start appending together (each opened the store first)
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    _check(uri, options, [tuple(map(int, out.split())) for out, _ in outs])


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module's Ray tests."""
    ray = pytest.importorskip("ray", reason="the Ray tests need the dev extras (ray)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ENV["PYTHONPATH"]}})  # fmt: skip
    yield ray
    ray.shutdown()


def test_two_ray_actors_writing_the_same_ids_land_each_once(ray_cluster, location):
    uri, options = location
    writer = ray_cluster.remote(num_cpus=0.1)(write_all)
    results = ray_cluster.get([writer.remote(uri, options) for _ in range(2)], timeout=240)
    _check(uri, options, results)
