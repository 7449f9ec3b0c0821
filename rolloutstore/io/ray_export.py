"""Export a store's rollouts with Ray Data, for a user with a Ray cluster (``lance_ray``).

    from rolloutstore.io.ray_export import export_ray
    export_ray(store, "s3://bucket/out/rollouts", where="reward > 0")            # Parquet files
    export_ray(store, "s3://bucket/copy.lance", format="lance")                 # a Lance dataset

The read is split by fragment into Ray Data tasks (``lance_ray.read_lance``, at the
store's version) and each block is written by the worker that read it, so an export of a
large store on object storage runs on the cluster, not through one process. Same rows as
:func:`rolloutstore.io.export.export` with ``as_="rollouts"`` (tests compare them), but as a
folder of Parquet files (one per block, row order per file) or a Lance dataset, and
``where`` is a Lance filter (SQL predicates over columns; no ``?`` parameters). The other
shapes (sft, dpo, messages) sort and group in DuckDB: use ``export``.

Ray's own ``Dataset.write_lance`` fails with pylance 14 (a removed keyword); the Lance
output goes through ``lance_ray.write_lance``. Ray is imported only when this runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import pyarrow as pa

from rolloutstore.schema.compat import ROLLOUTS_VIEW, stored_version
from rolloutstore.store.layout import ROLLOUTS, join

RayExportFormat = Literal["parquet", "lance"]


def _imports() -> tuple[Any, Any]:
    try:
        import lance_ray
        import ray
    except ImportError as exc:
        raise ImportError(
            f'export_ray needs Ray and lance-ray: pip install "rolloutstore[ray]"; {exc}'
        ) from exc
    return ray, lance_ray


def export_ray(
    store: Any,
    out: str | os.PathLike,
    *,
    format: RayExportFormat = "parquet",
    where: str | None = None,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, str] | None = None,
    num_cpus: float = 1.0,
) -> int:
    """Write ``store``'s rows (those ``where`` keeps; ``columns`` or all) to ``out`` with Ray
    Data; returns the rows written. Joins the running Ray session (``ray.init`` first to use
    a cluster; else Ray starts a local one). ``storage_options``: of a Lance ``out``
    (default: the store's). ``num_cpus``: per read/write task (actors holding every CPU would stall them).
    """
    if format not in ("parquet", "lance"):
        raise ValueError(f"format must be 'parquet' or 'lance', got {format!r}")
    ray, lance_ray = _imports()
    out = os.fspath(out)
    options = storage_options if storage_options is not None else store.storage_options
    view = ROLLOUTS_VIEW[stored_version(store.dataset().schema)]
    data = lance_ray.read_lance(
        join(store.uri, ROLLOUTS),
        filter=where,
        storage_options=store.storage_options,
        dataset_options={"version": store.version},
        ray_remote_args={"num_cpus": num_cpus},
    )
    # Each block as the local export reads it: through the store's `rollouts` view (older
    # schema versions and unset defaults filled), in the current schema.
    schema = store.schema
    if columns:
        schema = pa.schema([schema.field(c) for c in columns])
    data = data.map_batches(
        _through_view, fn_args=(view, schema), batch_format="pyarrow", num_cpus=num_cpus
    )
    rows = data.count()
    if format == "lance":
        lance_ray.write_lance(
            data, out, storage_options=options, ray_remote_args={"num_cpus": num_cpus}
        )
    else:
        # An object-store folder: Ray resolves it with the environment's credentials.
        data.write_parquet(out, ray_remote_args={"num_cpus": num_cpus})
    return rows


def _through_view(block: pa.Table, view: str, schema: pa.Schema) -> pa.Table:
    from rolloutstore.query.sql import connect  # the locked-down connection every query uses

    con = connect({"rollouts_stored": block}, rollouts_view=view)
    try:
        names = ", ".join(f'"{n}"' for n in schema.names)
        return con.sql(f"SELECT {names} FROM rollouts").to_arrow_table().cast(schema)
    finally:
        con.close()
