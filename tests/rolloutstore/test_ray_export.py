"""Export through Ray Data (lance_ray) gives the rows the local export gives."""

from __future__ import annotations

import lance
import pyarrow.parquet as pq
import pytest

from rolloutstore.io.proxy import proxy_batches

ray = pytest.importorskip("ray", reason="the Ray tests need the dev extras (ray)")
from rolloutstore.io.ray_export import export_ray  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _filled(store):
    for v in range(3):  # three appends: three fragments, read by separate Ray tasks
        store.append(proxy_batches(40, seed=v, start_index=40 * v, rollouts_per_version=40,
                                   mean_completion_tokens=10, batch_rollouts=40))  # fmt: skip
    return store


@pytest.mark.parametrize("fmt", ["parquet", "lance"])
def test_ray_export_matches_the_local_export(ray_session, store, tmp_path, fmt):
    _filled(store)
    where = "reward > 0"
    local = store.export(tmp_path / "local.parquet", where=where, progress=False)
    expected = pq.read_table(local.path).sort_by("rollout_id")
    out = tmp_path / f"ray.{fmt}"
    rows = export_ray(store, out, format=fmt, where=where)
    got = pq.read_table(out) if fmt == "parquet" else lance.dataset(str(out)).to_table()
    got = got.sort_by("rollout_id")
    assert rows == expected.num_rows == got.num_rows > 0
    assert got.schema.names == expected.schema.names
    for name in expected.schema.names:
        assert got[name].to_pylist() == expected[name].to_pylist(), name
