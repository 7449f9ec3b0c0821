"""``file``: prompts from a user's JSONL or Parquet file, scored by a named reward function.

Each record needs a prompt field and an answer field (``prompt``/``answer`` by default, both
overridable); every other field is kept in ``Prompt.meta``. The reward is picked by name from
:data:`REWARD_FUNCTIONS`:

* ``exact``    -- the ``<answer>`` block (or the whole completion) equals the answer, whitespace-trimmed;
* ``contains`` -- the answer occurs somewhere in the completion;
* ``last_int`` -- the last integer in the ``<answer>`` block (or completion) equals the answer.

Use it as ``get_task("file", path="prompts.jsonl", reward="exact")``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.tasks.base import Prompt, RewardResult, Task, check_count
from trainer.tasks.parsing import extract_tagged, last_int

RewardFn = Callable[[str, str], RewardResult]


def _reward_exact(answer: str, completion_text: str) -> RewardResult:
    tagged = extract_tagged(completion_text)
    candidate = (tagged if tagged is not None else completion_text).strip()
    correct = candidate == answer.strip()
    return RewardResult(float(correct), {"parsed": candidate, "correct": correct})


def _reward_contains(answer: str, completion_text: str) -> RewardResult:
    needle = answer.strip()
    # An empty answer is "contained" in everything; treat it as unverifiable rather than free reward.
    correct = bool(needle) and needle in completion_text
    return RewardResult(float(correct), {"correct": correct})


def _reward_last_int(answer: str, completion_text: str) -> RewardResult:
    tagged = extract_tagged(completion_text)
    parsed = last_int(tagged if tagged is not None else completion_text)
    expected = last_int(answer)
    correct = parsed is not None and expected is not None and parsed == expected
    return RewardResult(float(correct), {"parsed": parsed, "correct": correct})


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact": _reward_exact,
    "contains": _reward_contains,
    "last_int": _reward_last_int,
}


def _read_records(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
                records.append(record)
        return records
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is a core dependency
            raise ImportError(
                "reading Parquet prompt files needs pyarrow (a core rolloutstore dependency)"
            ) from exc
        return pq.read_table(path).to_pylist()
    raise ValueError(f"unsupported prompt file type {suffix!r} for {path}; use .jsonl or .parquet")


class FileTask(Task):
    """Prompts loaded from a file with a registry-named reward; see the module docstring."""

    name = "file"

    def __init__(
        self,
        path: str | Path,
        *,
        reward: str = "exact",
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ) -> None:
        if reward not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward {reward!r}; choose one of {sorted(REWARD_FUNCTIONS)}")
        self.path = Path(path)
        self.reward_name = reward
        self._reward_fn = REWARD_FUNCTIONS[reward]
        records = _read_records(self.path)
        if not records:
            raise ValueError(f"prompt file {self.path} has no records")
        self._prompts = []
        for i, record in enumerate(records):
            missing = [f for f in (prompt_field, answer_field) if f not in record]
            if missing:
                raise ValueError(f"{self.path}: record {i} lacks field(s) {missing}")
            if record[prompt_field] is None or record[answer_field] is None:
                raise ValueError(f"{self.path}: record {i} has a null prompt or answer")
            meta = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
            self._prompts.append(
                Prompt(
                    prompt_text=str(record[prompt_field]),
                    answer=str(record[answer_field]),
                    meta=meta,
                )
            )

    def __len__(self) -> int:
        return len(self._prompts)

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts in a seeded order: whole shuffled passes over the file, then a partial one."""
        check_count(n)
        rng = random.Random(f"file:{seed}")
        out: list[Prompt] = []
        while len(out) < n:
            order = list(range(len(self._prompts)))
            rng.shuffle(order)
            out.extend(self._prompts[i] for i in order[: n - len(out)])
        return out

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        return self._reward_fn(prompt.answer, completion_text)
