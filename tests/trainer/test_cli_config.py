"""``--set`` reaches nested keys; ``rolloutstore-train config --defaults`` prints every key of
every table with its default and help, as TOML that loads to the default config."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from trainer.cli import _apply_sets, main
from trainer.config import TABLES, TrainConfig
from trainer.errors import ConfigError


def test_set_reaches_nested_keys():
    data = {"task": {"name": "arith", "options": {"max_digits": 2}}}
    sets = [
        "task.options.max_digits=1",
        "task.options.ops=['+']",
        "replay.control.enabled=true",
        "model.lora.rank=4",
        "run.steps=3",
    ]
    cfg = TrainConfig.from_dict(_apply_sets(data, sets))
    assert cfg.task.options == {"max_digits": 1, "ops": ["+"]}
    assert cfg.control.enabled and cfg.model.lora.rank == 4 and cfg.run.steps == 3
    # A run.json holds [model.lora] off as null: --set on resume turns it on.
    assert _apply_sets({"model": {"lora": None}}, ["model.lora.rank=8"]) == {
        "model": {"lora": {"rank": 8}}
    }
    # The case: a bare string into the dataset task's options.
    assert _apply_sets({}, ["task.options.reward=math"]) == {
        "task": {"options": {"reward": "math"}}
    }


@pytest.mark.parametrize(
    ("item", "match"),
    [("run.steps.x=1", "run.steps is 3, not a table"), ("steps=1", "SECTION.KEY=VALUE"),
     ("run..x=1", "SECTION.KEY=VALUE")],
)  # fmt: skip
def test_set_refusals_name_the_key(item, match):
    with pytest.raises(ConfigError, match=match):
        _apply_sets({"run": {"steps": 3}}, [item])


def test_config_defaults_prints_every_key_with_its_default_and_help(capsys):
    assert main(["config", "--defaults"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for table, cls in TABLES.items():
        header = f"# [{table}]" if table == "model.lora" else f"[{table}]"
        start = lines.index(header)
        for f in dataclasses.fields(cls):
            if (table, f.name) in (("model", "lora"), ("run", "ray")):
                continue  # its own table
            key = [i for i, x in enumerate(lines[start:], start) if x.lstrip("# ").startswith(
                f"{f.name} = ")][0]  # fmt: skip
            help_first = " ".join(str(f.metadata["help"]).split()[:3])
            assert help_first in " ".join(lines[start:key]), (table, f.name)
    # Uncommented, it is a config: the defaults (keys that follow [run] left unset).
    assert TrainConfig.from_dict(tomllib.loads(out)) == TrainConfig()
    assert 'path = "tiny"' in lines and "batch_size = 64" in lines
