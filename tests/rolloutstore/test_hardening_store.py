"""Issue #31 hardening of the store and its CLI: outputs into devices, FIFOs and long names, full
disks, odd stores, racing writers and query time limits. Every CLI refusal is one
``error: ...`` line and exit 2, with nothing written.

No test writes to the real /dev/null or /dev/full: devices and FIFOs are made in tmp_path."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.cli.main import main
from rolloutstore.errors import OutputDiskFullError, SchemaError
from rolloutstore.store.layout import COMMIT_ATTEMPTS


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    s = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    s.append(make_rows(12))
    return s


def _one_error_line(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _no_temps(folder: Path) -> bool:
    return not [p for p in os.listdir(folder) if ".tmp-" in p]


# -- outputs into devices and FIFOs (item 1) ----------------------------------------------
class _FifoReader:
    """Reads a FIFO to its end in a thread; ``close()`` unblocks it if nobody ever wrote."""

    def __init__(self, fifo: Path):
        self.fifo, self.data = fifo, None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with open(self.fifo, "rb") as f:
            self.data = f.read()

    def close(self) -> bytes | None:
        self.thread.join(timeout=5)
        for _ in range(50):  # the writer never opened the FIFO (it renamed over it)
            if not self.thread.is_alive():
                break
            with contextlib.suppress(OSError):
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            self.thread.join(timeout=0.1)
        return self.data


def _fifo_and_link(tmp_path: Path, name: str) -> tuple[Path, Path]:
    fifo = tmp_path / f"{name}.fifo"
    os.mkfifo(fifo)
    link = tmp_path / name
    link.symlink_to(fifo)
    return fifo, link


def _mknod(path: Path, minor: int) -> Path:
    """A character device node of the memory driver (1, minor) at ``path`` (ours, in tmp)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("cannot create device nodes here")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_into_a_symlink_to_a_fifo_writes_through_it(store, tmp_path, capsys, fmt):
    fifo, link = _fifo_and_link(tmp_path, f"pipe.{fmt}")
    reader = _FifoReader(fifo)
    rc = main(["export", store.uri, str(link), "-q"])
    data = reader.close()
    assert rc == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert data is not None
    if fmt == "jsonl":
        assert len(data.decode().splitlines()) == 12
    else:
        assert pq.read_table(io.BytesIO(data)).num_rows == 12
    assert _no_temps(tmp_path)


def test_sql_out_into_a_symlink_to_a_fifo_writes_through_it(store, tmp_path, capsys):
    fifo, link = _fifo_and_link(tmp_path, "result.csv")
    reader = _FifoReader(fifo)
    rc = main(["sql", store.uri, "SELECT 1 AS x", "--format", "csv", "--out", str(link)])
    data = reader.close()
    assert rc == 0, capsys.readouterr().err
    assert link.is_symlink() and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert data == b'"x"\n1\n'


def test_a_null_device_is_written_in_place_never_replaced(store, tmp_path, capsys):
    null = _mknod(tmp_path / "null", 3)
    link = tmp_path / "null-link"
    link.symlink_to(null)
    for argv in (
        ["sql", store.uri, "SELECT 1 AS x", "--format", "csv", "--out", str(null)],
        ["sql", store.uri, "SELECT 1 AS x", "--format", "parquet", "--out", str(link)],
        ["export", store.uri, str(null), "--format", "jsonl", "-q"],
        ["export", store.uri, str(link), "--format", "parquet", "-q"],
    ):
        assert main(argv) == 0, capsys.readouterr().err
        assert stat.S_ISCHR(os.stat(null).st_mode), argv
        assert link.is_symlink(), argv
    assert _no_temps(tmp_path)


def test_a_full_device_is_one_error_line_and_stays_a_device(store, tmp_path, capsys):
    full = _mknod(tmp_path / "full", 7)
    for argv in (
        ["export", store.uri, str(full), "--format", "jsonl", "-q"],
        ["export", store.uri, str(full), "--format", "parquet", "-q"],
        ["sql", store.uri, "SELECT 1 AS x", "--format", "json", "--out", str(full)],
        ["sql", store.uri, "SELECT 1 AS x", "--format", "parquet", "--out", str(full)],
    ):
        rc = main(argv)
        _one_error_line(rc, capsys.readouterr().err, "no space left on device", str(full))
        assert stat.S_ISCHR(os.stat(full).st_mode), argv
    assert _no_temps(tmp_path)


def test_block_devices_sockets_and_folders_are_refused(store, tmp_path, capsys):
    import socket

    targets = {"a folder": tmp_path / "folder"}
    (tmp_path / "folder").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    targets["a socket"] = tmp_path / "sock"
    try:  # a device number no driver answers: nothing could be written even by mistake
        os.mknod(tmp_path / "blk", 0o600 | stat.S_IFBLK, os.makedev(240, 0))
        targets["a block device"] = tmp_path / "blk"
    except PermissionError:
        pass
    try:
        for found, target in targets.items():
            before = os.lstat(target)
            for argv in (
                ["export", store.uri, str(target), "--format", "jsonl", "-q"],
                ["sql", store.uri, "SELECT 1 AS x", "--format", "csv", "--out", str(target)],
            ):
                _one_error_line(main(argv), capsys.readouterr().err, f"found {found}")
                after = os.lstat(target)
                assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    finally:
        sock.close()
    assert _no_temps(tmp_path)


def test_a_symlink_to_a_file_is_followed_and_stays_a_symlink(store, tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert store.export(link, progress=False).rows == 12
    assert link.is_symlink() and len(real.read_text().splitlines()) == 12


# -- a full disk (item 14) ----------------------------------------------------------------
def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: No space left on device")


def test_export_to_a_full_disk_is_one_line_and_keeps_the_old_file(
    store, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "o.parquet"
    out.write_bytes(b"the previous export")
    monkeypatch.setattr(pq.ParquetWriter, "write_batch", _enospc)  # the fault: a full disk
    rc = main(["export", store.uri, str(out), "-q"])
    _one_error_line(rc, capsys.readouterr().err, "no space left on device", "nothing of it")
    assert out.read_bytes() == b"the previous export" and _no_temps(tmp_path)
    with pytest.raises(OutputDiskFullError) as info:
        store.export(out, progress=False)
    assert isinstance(info.value, OSError)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json", "table"])
def test_sql_out_to_a_full_disk_is_one_line(store, tmp_path, capsys, monkeypatch, fmt):
    out = tmp_path / "result"
    monkeypatch.setattr(pq, "write_table", _enospc)  # the fault: a full disk

    class Full:  # the fault for text formats: every write fails
        def __init__(self, f):
            self.f = f

        def write(self, data):
            _enospc()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    if fmt != "parquet":
        import rolloutstore.io.outputs as outputs

        monkeypatch.setattr(outputs, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)  # noqa: SIM115
    rc = main(["sql", store.uri, "SELECT 1 AS x", "--format", fmt, "--out", str(out)])
    _one_error_line(rc, capsys.readouterr().err, "no space left on device")
    assert not out.exists() and _no_temps(tmp_path)


# -- long output names (item 20) ----------------------------------------------------------
_NAME_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0")
_NAMES = st.text(_NAME_CHARS, min_size=1, max_size=255).filter(
    lambda n: (
        n not in (".", "..") and len(os.fsencode(n)) <= 255 and not n.lower().endswith(".lance")
    )
)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> RolloutStore:
    s = RolloutStore.open(tmp_path_factory.mktemp("names") / "s", embedding_dim=8)
    s.append(make_rows(4))
    return s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=_NAMES, length=st.sampled_from([None, 240, 249, 255]))
def test_any_name_the_filesystem_takes_is_a_valid_output(small_store, name, length):
    if length is not None:  # names at the limit, where the temp name used to overflow
        name = (name * 255).encode()[:length].decode("utf-8", "ignore") or "x"
        if name in (".", "..") or name.lower().endswith(".lance"):
            return
    with tempfile.TemporaryDirectory(dir=small_store.uri + "/..") as d:
        out = Path(d) / name
        r = small_store.export(out, progress=False)  # the format OUT's extension names
        assert r.rows == 4 and out.is_file() and os.listdir(d) == [name]


def test_sql_out_with_a_255_byte_name(store, tmp_path, capsys):
    out = tmp_path / ("é" * 127 + ".")  # 255 bytes
    assert len(os.fsencode(out.name)) == 255
    rc = main(["sql", store.uri, "SELECT 2 AS y", "--format", "json", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(out.read_text()) == {"y": 2} and _no_temps(tmp_path)


# -- odd stores (item 16) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def marked(tmp_path_factory) -> RolloutStore:
    """A store whose schema metadata the tests below overwrite."""
    s = RolloutStore.open(tmp_path_factory.mktemp("marked") / "s", embedding_dim=8)
    s.append(make_rows(4))
    return s


def _mark(store: RolloutStore, key: str, value: str) -> None:
    store.dataset().update_schema_metadata({f"rolloutstore.{key}": value})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.text(max_size=12) | st.integers(-5, 5).map(str))
def test_any_recorded_schema_version_opens_or_is_one_schema_error(marked, value):
    _mark(marked, "schema_version", value)
    try:
        opened = RolloutStore.open(marked.uri, create=False)
    except SchemaError as exc:
        assert "\n" not in str(exc) and "schema" in str(exc)
        # only ASCII digits naming a readable version open ("1\r" or " 2" are damaged marks)
        assert not (value.isascii() and value.isdigit() and int(value) in (1, 2))
    else:
        assert opened.schema_version == int(value) and int(value) in (1, 2)
    finally:
        _mark(marked, "schema_version", "2")


@pytest.mark.parametrize(
    ("key", "value"), [("schema_version", "abc"), ("embedding_dim", "abc"), ("embedding_dim", "0")]
)
def test_a_damaged_schema_mark_is_one_error_line(marked, capsys, key, value):
    _mark(marked, key, value)
    try:
        for argv in (["stats", marked.uri], ["sql", marked.uri, "SELECT 1 AS x"]):
            rc = main(argv)
            _one_error_line(rc, capsys.readouterr().err, f"rolloutstore.{key} = {value!r}")
    finally:
        _mark(marked, key, {"schema_version": "2", "embedding_dim": "8"}[key])
    assert RolloutStore.open(marked.uri, create=False).count() == 4


def _data_files(store: RolloutStore) -> list[str]:
    return sorted(os.listdir(Path(store.uri) / "rollouts.lance" / "data"))


@pytest.mark.parametrize("change", ["add", "drop"])
def test_append_to_a_store_whose_columns_changed_is_refused(store, tmp_path, capsys, change):
    ds = store.dataset()
    if change == "add":
        ds.add_columns({"extra": "1"})
    else:
        ds.drop_columns(["tags"])
    before = (store.count(), store.version, _data_files(store))
    with pytest.raises(SchemaError, match="changed outside rolloutstore"):
        store.append(make_rows(3, seed=7))
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in make_rows(3, seed=8)))
    rc = main(["ingest", store.uri, str(f), "-q"])
    found = "extra ['extra']" if change == "add" else "missing ['tags']"
    _one_error_line(rc, capsys.readouterr().err, found, "nothing was written")
    assert (store.count(), store.version, _data_files(store)) == before


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dim=st.integers(max_value=0))
def test_a_bad_embedding_dim_creates_nothing(tmp_path_factory, dim):
    where = tmp_path_factory.mktemp("dim") / "s"
    with pytest.raises(SchemaError, match="embedding_dim must be a positive int"):
        RolloutStore.open(where, embedding_dim=dim)
    assert not where.exists()


@pytest.mark.parametrize("dim", ["0", "-3"])
def test_init_with_a_bad_embedding_dim_is_one_line_and_creates_nothing(tmp_path, capsys, dim):
    rc = main(["init", str(tmp_path / "s"), "--embedding-dim", dim])
    _one_error_line(rc, capsys.readouterr().err, f"got {dim}")
    assert not (tmp_path / "s").exists()


# -- concurrent re-scorings (item 2) ------------------------------------------------------
def _rescore_worker(uri: str, tag: str, barrier, out) -> None:
    """One racing re-scoring (a spawned process): every row gets reward ``len(tag)``."""
    import time

    from rolloutstore import RolloutStore
    from rolloutstore.retention.rescore import Scorer

    def score(row: dict) -> float:
        time.sleep(0.02)  # slow enough that the racers overlap: each reads before any commits
        return float(len(tag))

    store = RolloutStore.open(uri, create=False)
    scorer = Scorer(score, name="race", advantage_fn=lambda r, g: r - r.mean())
    barrier.wait(timeout=120)
    try:
        out.put((tag, store.rescore(scorer, note=tag).reward_version))
    except Exception as exc:  # reported to the test, which fails on it
        out.put((tag, repr(exc)))


def _race(uri: str, tags: list[str]) -> dict[str, int]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(tags)), ctx.Queue()
    procs = [ctx.Process(target=_rescore_worker, args=(uri, t, barrier, out)) for t in tags]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=300) for _ in tags)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.parametrize("first", [True, False], ids=["first-rescoring", "table-exists"])
def test_racing_rescorings_get_distinct_versions_and_lose_no_row(tmp_path, first):
    store = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    rows = make_rows(24)
    for r in rows:
        r["task"] = "race"
    store.append(rows)
    from rolloutstore.retention.rescore import Scorer

    base = 0
    if not first:  # the rewards table exists: one re-scoring before the race
        store.rescore(Scorer(lambda row: 0.0, "race", lambda r, g: r - r.mean()), note="pre")
        base = 1
    tags = ["a", "bb", "ccc"]
    got = _race(store.uri, tags)
    assert all(isinstance(v, int) for v in got.values()), got
    assert sorted(got.values()) == [base + 1, base + 2, base + 3], got
    t = store.sql(
        "SELECT reward_version AS v, note, count(*) AS n, min(reward) AS lo, max(reward) AS hi "
        "FROM rewards GROUP BY 1, 2 ORDER BY 1"
    ).to_pylist()
    assert [(r["v"], r["n"]) for r in t] == [(v, 24) for v in range(1, base + 4)]
    for tag, version in got.items():  # each printed version holds that run's own rows
        (mine,) = [r for r in t if r["v"] == version]
        assert (mine["note"], mine["lo"], mine["hi"]) == (tag, len(tag), len(tag))
    newest = store.sql("SELECT DISTINCT reward FROM rollouts_scored")["reward"].to_pylist()
    winner = [tag for tag, v in got.items() if v == base + 3][0]
    assert newest == [float(len(winner))]


# -- compact and migrate losing commit races to appenders (item 15) -----------------------
def _unreferenced(store: RolloutStore) -> list[str]:
    return store.gc(min_age=timedelta(0), dry_run=True).removed


@pytest.mark.parametrize("losses", [2, COMMIT_ATTEMPTS])
def test_compact_losing_to_appenders_runs_again_or_is_one_line(store, capsys, monkeypatch, losses):
    from lance.dataset import DatasetOptimizer

    other = RolloutStore.open(store.uri)
    real = DatasetOptimizer.compact_files

    def conflicting(self, *a, **k):  # the fault: an appender commits first, Lance refuses ours
        if conflicting.calls < losses:
            conflicting.calls += 1
            other.append(make_rows(2, seed=100 + conflicting.calls))
            raise OSError(
                "Retryable commit conflict for version 9: This Rewrite transaction was "
                "preempted by concurrent transaction Append at version 9. Please retry."
            )
        return real(self, *a, **k)

    conflicting.calls = 0
    monkeypatch.setattr(DatasetOptimizer, "compact_files", conflicting)
    rc = main(["compact", store.uri])
    out, err = capsys.readouterr()
    if losses < COMMIT_ATTEMPTS:
        assert rc == 0, err
        assert json.loads(out)["rollouts"]["fragments_added"] >= 1
    else:
        _one_error_line(rc, err, "lost the commit race", "store is intact")
    assert store.count() == 12 + 2 * losses  # every appended row is there


def _v1_store(path: Path) -> RolloutStore:
    from rolloutstore.store import layout

    layout.create(str(path), 4, None, schema_version=1)
    store = RolloutStore.open(path)
    store.append(make_rows(12))
    return store


@pytest.mark.parametrize("losses", [1, 3, COMMIT_ATTEMPTS])
def test_migrate_losing_to_a_racing_append_runs_again_over_its_rows(
    tmp_path, capsys, monkeypatch, losses
):
    from rolloutstore.store import migrate as M

    store = _v1_store(tmp_path / "v1")
    other = RolloutStore.open(store.uri)
    real = M._commit

    def racing(*a, **k):  # a real append commits between the migration's read and its commit
        if racing.calls < losses:
            racing.calls += 1
            other.append(make_rows(3, seed=100 + racing.calls))
        return real(*a, **k)

    racing.calls = 0
    monkeypatch.setattr(M, "_commit", racing)
    rc = main(["migrate", store.uri])
    out, err = capsys.readouterr()
    store = RolloutStore.open(store.uri)
    assert store.count() == 12 + 3 * losses  # the racing appends are kept, never refused
    if losses < COMMIT_ATTEMPTS:
        assert rc == 0 and "migrated store" in out, err
        assert store.schema_version == 2
        t = store.sql("SELECT count(*) AS n FROM rollouts_stored WHERE num_turns = 1")
        assert t["n"][0].as_py() == store.count()  # the v2 columns written for every row
    else:
        _one_error_line(rc, err, "migration", "lost the commit race")
        assert store.schema_version == 1
    assert _unreferenced(store) == []  # each lost try removed the files it wrote
