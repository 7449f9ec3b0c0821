"""Fuzz: random argv for `sql`, `sample`, `export`, `stats` (hostile `where` strings included)
never ends in a traceback: `main(argv)` returns 0 or prints one `error:` line and returns 2."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.cli import main

WHERES = st.one_of(
    st.sampled_from(["reward > ?", "true) OR (true", "reward > 0; SELECT 1", "1=1) UNION SELECT 1 FROM rollouts WHERE (1", "reward -- x", "getenv('x') = ''", "ALL reward", "nosuch = 1", "", "reward IN (SELECT 1)"]),
    st.text(alphabet="reward()';-*/ ?<>=1UNIONSELCT$\n", max_size=20),
)  # fmt: skip
VALUES = st.one_of(
    st.sampled_from(["0", "1", "-1", "x", "", "1e400", "nan", "--", "-q"]), st.text(max_size=6)
)
SQLS = st.one_of(
    st.sampled_from(["SELECT count(*) AS n FROM rollouts", "SELECT * FROM groups", "SELECT ?", "SELECT read_text('/etc/passwd')", "COPY rollouts TO 'x.csv'", "SET threads = 8", "INSTALL httpfs", "ATTACH 'x.db'", "SELECT 1; SELECT 2", "", "PRAGMA version"]),
    st.text(max_size=30),
)  # fmt: skip
FLAGS = {
    "sql": [("--param", VALUES), ("--format", st.sampled_from(["table", "csv", "json", "parquet", "xml"])), ("--version", VALUES), ("--timeout", VALUES)],
    "sample": [("--batch-size", VALUES), ("--learner-version", VALUES), ("--window", VALUES), ("--where", WHERES), ("--where-params", VALUES), ("--per-prompt-cap", VALUES), ("--priority", st.sampled_from(["uniform", "advantage", "x"])), ("--max-uses", VALUES), ("--explain", None)],
    "export": [("--where", WHERES), ("--param", VALUES), ("--columns", st.sampled_from(["reward", "rollout_id,reward", "nosuch", ",", ""])), ("--as", st.sampled_from(["rollouts", "sft", "dpo", "x"])), ("--min-reward", VALUES), ("--format", st.sampled_from(["parquet", "jsonl", "hf", "x"]))],
    "stats": [("--json", None)],
}  # fmt: skip
CASES = {"n": 0}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.open(tmp_path_factory.mktemp("fuzz") / "s", embedding_dim=8)
    s.append(make_rows(24))
    return s


@st.composite
def argvs(draw, store_uri: str, out_dir: str):
    cmd = draw(st.sampled_from(sorted(FLAGS)))
    argv = [cmd, draw(st.sampled_from([store_uri, out_dir + "/nope", out_dir]))]
    if cmd == "sql":
        argv.append(draw(SQLS))
    if cmd == "export":
        argv.append(
            draw(
                st.sampled_from(
                    [
                        out_dir + "/o.parquet",
                        out_dir + "/o.jsonl",
                        out_dir + "/o.bin",
                        store_uri + "/x.parquet",
                    ]
                )
            )
        )
        argv.append("-q")
    for flag, values in draw(st.lists(st.sampled_from(FLAGS[cmd]), max_size=4)):
        argv.append(flag)
        if values is not None:
            argv.append(draw(values))
    return argv


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_argv_never_gives_a_traceback(store, tmp_path_factory, data):
    out_dir = str(tmp_path_factory.getbasetemp() / "fuzz-out")
    argv = data.draw(argvs(store.uri, out_dir))
    CASES["n"] += 1
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:  # --help and the like
            rc = exc.code
    lines = err.getvalue().strip().splitlines()
    assert rc in (0, 2), (argv, rc, err.getvalue())
    if rc == 2:
        errors = [x for x in lines if x.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err.getvalue(), (argv, err.getvalue())
    assert RolloutStore.open(store.uri, create=False).count() == 24


def test_fuzz_ran_cases():
    print(f"cli fuzz cases: {CASES['n']}")
    assert CASES["n"] in (0, 150)  # 0 when run alone with -k
