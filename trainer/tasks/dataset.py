"""``dataset``: prompts from a user's dataset (JSONL, JSONL.zst, Parquet or a ``datasets`` folder)
scored by a named reward; ``file`` is the same task under its original name.

Each record needs a prompt (``prompt_field``, plain text, or ``messages_field``, a list of
``{"role", "content"}`` chat turns) and a reference answer (``answer_field``); every other
field is kept in ``Prompt.meta``. ``reward`` is any spec :func:`trainer.tasks.rewards.get_reward`
accepts: ``math``, ``exact``, ``contains``, ``last_number``, ``regex:PATTERN`` or
``module.path:function``. Its name and version go into each reward's info and the task's
``reward_spec`` (recorded in every rollout's metadata).

Held-out prompts for evaluation (:meth:`DatasetTask.make_eval_prompts`) come from, in this
order: ``eval_path`` (another file or folder, same fields), ``eval_split`` (a named split of a
``DatasetDict`` folder), or ``eval_fraction`` of the records, picked by ``split_seed`` (the same
records for the same file and seed, and never trained on). With none of them, evaluation draws
from the training prompts.

Use it as ``get_task("dataset", path="math.jsonl", reward="math", eval_fraction=0.1)`` or, in a
run config::

    [task]
    name = "dataset"
    chat_template = true
    options = { path = "data/math.jsonl", prompt_field = "question", reward = "math" }
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from trainer.errors import TaskError, TaskFileError
from trainer.tasks.base import Prompt, RewardResult, Task, check_count
from trainer.tasks.rewards import get_reward

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _read_jsonl(path: Path, fh: io.TextIOBase) -> list[dict[str, Any]]:
    records = []
    for lineno, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TaskError(f"{path}:{lineno}: expected a JSON object per line")
        records.append(record)
    return records


def _read_hf_folder(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as exc:
        raise TaskError(
            f"{path} is a folder: reading a `datasets` save_to_disk folder needs the "
            f"datasets package (pip install datasets) ({exc})"
        ) from exc
    try:
        ds = load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise TaskError(
            f"{path} is a folder but not a `datasets` save_to_disk folder ({exc}); give a "
            ".jsonl, .jsonl.zst or .parquet file or a save_to_disk folder"
        ) from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise TaskError(f"{path}: no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    return ds.to_list()


def read_records(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """Records of a JSONL, JSONL.zst, Parquet file or ``datasets`` folder (its ``split``)."""
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"prompt dataset {str(path)!r}: no such file or folder")
    if path.is_dir():
        return _read_hf_folder(path, split)
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        with path.open(encoding="utf-8") as fh:
            return _read_jsonl(path, fh)
    if name.endswith(tuple(s + ".zst" for s in JSONL_SUFFIXES)):
        import zstandard

        with path.open("rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            return _read_jsonl(path, io.TextIOWrapper(reader, encoding="utf-8"))
    if name.endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise TaskError(
        f"unsupported prompt file type {path.suffix!r} for {path}; use .jsonl, .jsonl.zst, "
        ".parquet or a `datasets` save_to_disk folder"
    )


class DatasetTask(Task):
    """Prompts from a dataset with a named, versioned reward; see the module docstring."""

    name = "dataset"

    def __init__(
        self,
        path: str | Path,
        *,
        reward: str = "exact",
        prompt_field: str = "prompt",
        messages_field: str = "",
        answer_field: str = "answer",
        system_prompt: str = "",
        split: str = "train",
        eval_path: str | Path = "",
        eval_split: str = "",
        eval_fraction: float = 0.0,
        split_seed: int = 0,
    ) -> None:
        if not 0.0 <= eval_fraction < 1.0:
            raise TaskError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if sum(bool(x) for x in (eval_path, eval_split, eval_fraction)) > 1:
            raise TaskError("give at most one of eval_path, eval_split and eval_fraction")
        self._reward = get_reward(reward)
        self.reward_name = self._reward.name
        self.reward_spec = self._reward.spec
        self.path = Path(path)
        self._fields = (prompt_field, messages_field, answer_field)
        self._system = system_prompt
        prompts = self._prompts_of(self.path, read_records(self.path, split))
        if eval_path:
            self._eval = self._prompts_of(Path(eval_path), read_records(eval_path, split))
        elif eval_split:
            self._eval = self._prompts_of(self.path, read_records(self.path, eval_split))
        elif eval_fraction:
            order = list(range(len(prompts)))
            random.Random(f"dataset-split:{split_seed}").shuffle(order)
            k = max(1, round(eval_fraction * len(prompts)))
            if k >= len(prompts):
                raise TaskError(
                    f"eval_fraction {eval_fraction} of {len(prompts)} records leaves none to train on"
                )
            held = set(order[:k])
            self._eval = [prompts[i] for i in sorted(held)]
            prompts = [p for i, p in enumerate(prompts) if i not in held]
        else:
            self._eval = None
        self._prompts = prompts

    def _prompts_of(self, path: Path, records: list[dict[str, Any]]) -> list[Prompt]:
        if not records:
            raise TaskError(f"prompt dataset {path} has no records")
        prompt_field, messages_field, answer_field = self._fields
        source = messages_field or prompt_field
        out = []
        for i, record in enumerate(records):
            missing = [f for f in (source, answer_field) if f not in record]
            if missing:
                raise TaskError(
                    f"{path}: record {i} lacks field(s) {missing}; it has {sorted(record)} "
                    "(set prompt_field / messages_field / answer_field to map them)"
                )
            if record[source] is None or record[answer_field] is None:
                raise TaskError(f"{path}: record {i} has a null {source!r} or {answer_field!r}")
            meta = {k: v for k, v in record.items() if k not in (source, answer_field)}
            answer = str(record[answer_field])
            if messages_field:
                messages = record[messages_field]
                try:
                    out.append(self._chat_prompt(messages, answer, meta))
                except ValueError as exc:
                    raise TaskError(
                        f"{path}: record {i}, field {messages_field!r}: {exc}"
                    ) from None
            elif self._system:
                text = str(record[prompt_field])
                turns = (
                    {"role": "system", "content": self._system},
                    {"role": "user", "content": text},
                )
                out.append(Prompt(text, answer, meta, messages=turns))
            else:
                out.append(Prompt(str(record[prompt_field]), answer, meta))
        return out

    def _chat_prompt(self, messages: Any, answer: str, meta: dict[str, Any]) -> Prompt:
        if isinstance(messages, str):
            messages = json.loads(messages)
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"expected a non-empty list of {{role, content}}, got {messages!r}")
        if self._system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self._system}, *messages]
        users = [
            m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"
        ]
        text = users[-1] if users and isinstance(users[-1], str) else ""
        return Prompt(text, answer, meta, messages=tuple(messages))

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def eval_size(self) -> int | None:
        """Held-out prompts available, or None when evaluation draws training prompts."""
        return None if self._eval is None else len(self._eval)

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

    def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        """The first ``n`` held-out prompts (all of them if fewer), the same at every call."""
        if self._eval is None:
            return self.make_prompts(n, seed)
        check_count(n)
        return self._eval[:n]

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        return self._reward(prompt.prompt_text, completion_text, prompt.answer)


class FileTask(DatasetTask):
    """The ``file`` task: :class:`DatasetTask` under its original name."""

    name = "file"
