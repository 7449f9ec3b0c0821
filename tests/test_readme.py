"""The README and the docs it points to: every command block and Python example run as
written, the config table's defaults, and every relative link."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI = DOCS / "cli.md"  # the CLI tour
TRAINING = DOCS / "training.md"  # Replay; Your own model and data
MULTITURN = DOCS / "multiturn.md"
IMPORT = DOCS / "import.md"  # bring your own rollouts


def _block(after: str, lang: str, doc: Path = README) -> str:
    """The first ```lang block after the text `after` in `doc`."""
    text = doc.read_text()
    start = text.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    return m.group(1)


def _env(*, repo_on_path: bool = False) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if repo_on_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_readme_opens_with_the_two_commands():
    first = _block("# rolloutstore", "bash").splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make demo", "make test"]


def test_readme_names_the_real_model_run_and_it_is_the_example():
    """`make demo-smollm2`, named under the two commands, trains the SmolLM2 example on the
    folder `make smollm2` builds, with the eval its results section reports."""
    from trainer.config import TrainConfig

    head = README.read_text().split("\n## ", 1)[0]
    assert "make demo-smollm2" in head and "docs/results_smollm2_seeds.png" in head
    dry = subprocess.run(["make", "-n", "demo-smollm2"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert "tools/make_smollm2.py" in dry
    assert "train examples/smollm2_arith.toml" in dry
    cfg = TrainConfig.load(ROOT / "examples/smollm2_arith.toml")
    assert cfg.model.path == ".cache/smollm2/fp32" and cfg.model.lora is not None
    assert cfg.run.steps == 12 and cfg.eval.every == 4 and cfg.eval.greedy
    results = (DOCS / "results.md").read_text()
    assert "examples/smollm2_arith.toml" in results and "results_smollm2_seeds.png" in results


def test_readme_is_a_front_door():
    """Short, and a map of docs/: every doc file is linked from the README's Docs section."""
    assert len(README.read_bytes()) < 12_000
    docs_section = README.read_text().split("\n## Docs\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", docs_section))
    assert linked == {p.name for p in DOCS.glob("*.md")}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _unfenced(text: str) -> str:
    """Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _unfenced(path.read_text()), flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n)}


def _run_all(commands: list[str], cwd: Path, env: dict) -> list[str]:
    """Run each shell command in order, each must succeed; their stdouts."""
    out = []
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
        out.append(p.stdout)
    return out


def test_relative_links_resolve():
    """Every relative link of the README and docs/ names a file that exists, and an anchor
    into a Markdown file names one of its headings."""
    broken = []
    for doc in [README, *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_cli_tour_runs_as_written(tmp_path):
    env = _env()
    commands = [c for c in _block("<!-- tour", "bash", CLI).splitlines() if c.strip()]
    assert len(commands) >= 10
    out = {}
    for cmd, stdout in zip(commands, _run_all(commands, tmp_path, env)):
        out.setdefault(" ".join(cmd.split()[:2]), []).append(stdout)
    assert "generated 64 rollouts" in out["rolloutstore-train generate"][0]
    assert "rollouts   2,000 in" in out["rolloutstore stats"][0]  # stats after the ingest
    assert '{"n": 2000}' in out["rolloutstore sql"][-1]  # the query of version 2
    assert "(8 rows)" in out["rolloutstore sample"][0]
    assert "ORDER BY policy_version DESC" in out["rolloutstore sample"][1]
    assert "exported 2000 rows" in out["rolloutstore export"][0]
    assert "ingested 2000 rollouts" in out["rolloutstore ingest"][1]
    assert "evicted 500 rollouts, 1500 left" in out["rolloutstore evict"][0]
    diverse = out["rolloutstore evict"][1]  # exactly --keep rows, plus the coverage report
    assert "evicted 500 rollouts, 1000 left" in diverse and "FIFO" in diverse
    assert (tmp_path / "runs/tour/positive.parquet").stat().st_size > 0


def test_python_examples_run(tmp_path, monkeypatch):
    """The README's Python example, the README's look-inside commands on the store it wrote,
    then the Replay example of docs/training.md on that store."""
    monkeypatch.chdir(tmp_path)
    exec(compile(_block("## Python", "python"), "README.md", "exec"), {})
    from rolloutstore import RolloutStore

    assert RolloutStore.open(tmp_path / "runs/demo/store").count() == 1
    env = _env()
    commands = [c for c in _block("<!-- look-inside", "bash").splitlines() if c.strip()]
    assert len(commands) == 3
    out = _run_all(commands, tmp_path, env)
    assert "rollouts   1 in 1 groups" in out[0]
    assert "policy_version" in out[1] and "(1 rows)" in out[1]
    assert "<rollout_id>" in out[2] and "(1 rows)" in out[2]  # the example's record_usage
    exec(compile(_block("\n## Replay\n", "python", TRAINING), "docs/training.md", "exec"), {})
    assert (
        RolloutStore.open(tmp_path / "runs/demo/store")
        .sql("SELECT count(*) AS n FROM usage")["n"][0]
        .as_py()
        >= 1
    )


def test_config_table_matches_defaults():
    """Each row of the README's config table names a real key and its default (an empty
    TOML file's value)."""
    from trainer.config import TrainConfig

    table = README.read_text().split("<!-- config-table", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `\[(\w+)\] (\w+)` \| (.+?) \|", table, flags=re.M)
    assert len(rows) >= 10
    defaults = TrainConfig.from_dict({})
    for section, key, cell in rows:
        want = None if cell == "unset" else tomllib.loads(f"v = {cell.strip('`')}")["v"]
        assert getattr(getattr(defaults, section), key) == want, f"[{section}] {key}"


def test_own_model_and_data_runs_as_written(tmp_path):
    """The "Your own model and data" commands of docs/training.md, from a folder that has the
    repository's tools."""
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    (tmp_path / "my-run.toml").write_text(_block("<!-- own-data", "toml", TRAINING))
    env = _env(repo_on_path=True)
    commands = [c for c in _block("<!-- own-data", "bash", TRAINING).splitlines() if c.strip()]
    assert len(commands) == 4
    last = _run_all(commands, tmp_path, env)[-1]
    rows = [json.loads(line) for line in last.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["prompt_text"].startswith("<|user|>\n")  # the tiny model's chat template
        assert row["prompt_text"].endswith("<|assistant|>\n")
        info = json.loads(row["reward_info"])
        assert info["reward_fn"] == "math" and info["reward_fn_version"].startswith("math-verify/")


def test_multiturn_commands_run_as_written(tmp_path):
    """The commands of docs/multiturn.md, from a folder with the repository's tools and test
    data."""
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    env = _env(repo_on_path=True)
    commands = [c for c in _block("<!-- multiturn", "bash", MULTITURN).splitlines() if c.strip()]
    assert len(commands) == 7
    out = _run_all(commands, tmp_path, env)
    assert "ingested 4 rollouts" in out[1]
    assert "calculator" in out[2] and "(4 rows)" in out[2]
    assert "tool" in out[3] and "user" in out[3]
    assert "(2 rows)" in out[4]
    assert "exported 4 rows (messages, jsonl)" in out[5]
    assert "already rollout schema v2; nothing to do" in out[6]
    chats = [json.loads(line) for line in (tmp_path / "runs/agent/chats.jsonl").open()]
    assert {m["role"] for c in chats for m in c["messages"]} == {"system", "user", "assistant",
                                                                  "tool"}  # fmt: skip


def test_import_guide_runs_as_written(tmp_path, monkeypatch, capsys):
    """The commands, the run config and the Python example of docs/import.md, from a folder
    with the repository's tools and test data."""
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    (tmp_path / "imp.toml").write_text(_block("<!-- import", "toml", IMPORT))
    env = _env(repo_on_path=True)
    commands = [c for c in _block("<!-- import", "bash", IMPORT).splitlines() if c.strip()]
    assert len(commands) == 10
    out = _run_all(commands, tmp_path, env)
    assert all(n in out[i] for i, n in ((1, "ingested 5"), (2, "ingested 4"), (3, "ingested 4")))
    assert all(s in out[4] for s in ("import:verl", "import:trl", "import:openai", "recomputed"))
    assert "replaying 13 rollouts of run 'default'" in out[5]
    assert re.search(r"^default\s+13\s+\d+", out[6], flags=re.M) and "(2 rows)" in out[6]
    assert "exported 8 rows (sft" in out[7] and "exported 5 rows (dpo" in out[8]
    assert "exported 13 rows (messages" in out[9]
    monkeypatch.chdir(tmp_path)
    code = _block("**Train on the store directly**", "python", IMPORT)
    exec(compile(code, "docs/import.md", "exec"), {})
    steps = re.findall(
        r"^step (\d): loss (\S+), approx_kl ([^,\s]+)", capsys.readouterr().out, re.M
    )
    assert [s[0] for s in steps] == ["0", "1", "2"]
    assert float(steps[0][2]) == 0.0  # scored by the weights it trains: its own log-probs
