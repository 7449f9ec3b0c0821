"""Text rollouts from other frameworks (verl, TRL, OpenAI chat JSONL) as rollout rows.

    rolloutstore-train ingest STORE FILE --from verl|trl|openai --score-with MODEL_DIR
                       [--tokenizer DIR] [--chat-template] [--advantages grpo|drgrpo|none]
                       [--temperature T --top-p P --top-k K] [--ignore-unknown]

A preset maps one framework's row to a *text row* (prompt text or chat messages,
completion text, reward, advantage, step, extras). Grouping is done here: a row
without a ``group_id`` belongs to the group of its prompt (+ its step, when the
format has one), ``sample_index`` counts rows within a group in file order, and a
missing advantage is computed from the group's rewards (``advantages="grpo"`` or
``"drgrpo"``; ``"none"`` stores null, which the schema allows, and the ingest
reports how many rows train with a zero advantage). Groups must lie within one file.

Tokenizing and scoring need a tokenizer and a model, which rolloutstore does not
import: a *row transformer* does it, passed in by the caller (the trainer's is
``trainer.rollout.text_import.TextRowTransformer``, used by ``rolloutstore-train ingest``).
It fills ``prompt_ids``,
``completion_ids``, ``behavior_logprobs`` (recomputed teacher-forced with the given
sampling settings, ``logprobs_mode = "recomputed"``) and supplies the group advantage
function. The file is read twice: once for the groups, once to convert and append.

Multi-turn OpenAI chats (more messages after the first assistant turn: tool results, user
follow-ups, further assistant turns) become ONE multi-turn trajectory row (schema v2): the
prompt is the messages before the first assistant turn, the completion everything after
it, with ``loss_mask`` 1 on the assistant turns' tokens only and ``turns`` filled; the
transformer places the token boundaries (trainer/rollout/text_import.py documents how).
The completion's messages are kept in ``metadata.completion_messages`` (beside the prompt's
``metadata.messages``) for ``export --as messages``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import numpy as np

from rolloutstore.errors import ValidationError

Source = Literal["verl", "trl", "openai"]
AdvantageMode = Literal["grpo", "drgrpo", "none"]
SOURCES: tuple[str, ...] = get_args(Source)
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)


@dataclass(frozen=True)
class TextImportOptions:
    """How text rows become trainable rows; the CLI's ``ingest --from`` options."""

    source: Source
    tokenizer: str | None = None  # folder; default: score_with
    score_with: str | None = None  # model folder for teacher-forced behaviour log-probs
    chat_template: bool = False  # render text prompts as one user turn (messages always are)
    advantages: AdvantageMode = "grpo"
    ignore_unknown: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    policy_version: int | None = None  # None: from the file's step (else 0)
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"--from must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.advantages not in ADVANTAGE_MODES:
            raise ValueError(
                f"--advantages must be one of {', '.join(ADVANTAGE_MODES)}, got {self.advantages!r}"
            )
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(
                f"sampling settings out of range: temperature {self.temperature} (> 0), "
                f"top_p {self.top_p} (in (0, 1]), top_k {self.top_k} (>= 0)"
            )


class RowTransformer(Protocol):
    """Fills token ids and behaviour log-probs of text rows (see the module docstring)."""

    def __call__(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]: ...

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, mode: str) -> np.ndarray: ...


# -- presets: one framework row -> a text row -------------------------------------------------
# Text-row keys: prompt (str) | prompt_messages (list of {"role", "content"}), completion (str)
# | completion_messages (a multi-turn trajectory's messages, from the first assistant turn),
# reward, advantage, step, reward_info (dict), metadata (dict), and schema columns kept as is.
KEEP = ("rollout_id", "run_id", "group_id", "sample_index", "policy_version", "finish_reason")


def _verl(row: dict[str, Any], ignore_unknown: bool) -> dict[str, Any]:
    # verl/trainer/ppo/ray_trainer.py (volcengine/verl), RayPPOTrainer._dump_generations:
    # one JSONL per step in trainer.rollout_data_dir with keys input (prompt decoded with
    # skip_special_tokens=True, i.e. verl's rendered chat text minus special tokens),
    # output, gts (reward_model.ground_truth), score (sum of token_level_scores), step, and
    # every reward_extra_infos_dict key of the same length (e.g. acc, request_id).
    out = {
        "prompt": _text(row, "input"),
        "completion": _text(row, "output"),
        "reward": row.get("score"),
        "step": row.get("step"),
    }
    if row.get("step") is not None:  # global_steps starts at 1; step s samples weights s-1
        out["policy_version"] = _int(row, "step") - 1
    if row.get("gts") is not None:
        out["metadata"] = {"answer": row["gts"]}  # as trainer-written rows keep it
    known = {"input", "output", "score", "step", "gts", *KEEP}
    extras = {k: v for k, v in row.items() if k not in known}
    if extras:
        out["reward_info"] = extras
    out.update({k: row[k] for k in KEEP if k in row})
    return out


def _trl(row: dict[str, Any], ignore_unknown: bool) -> dict[str, Any]:
    # trl/trainer/grpo_trainer.py (huggingface/trl 1.16), GRPOTrainer.log with
    # log_completions=True: OUTPUT_DIR/completions/completions_{global_step:05d}.parquet
    # with columns step, prompt, completion (strings, or lists of {"role", "content"}
    # for conversational data), one column per reward function (named by
    # reward_func_names), extra columns from log_extra, and advantage. TRL's reward is
    # the reward_weights-weighted sum of the function columns (weights 1.0 by default,
    # NaN where a function did not apply): summed here with weight 1.
    out: dict[str, Any] = {"step": row.get("step"), "advantage": row.get("advantage")}
    if row.get("step") is not None:
        out["policy_version"] = _int(row, "step")
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        out["prompt_messages"] = _messages(prompt, "prompt")
    else:
        out["prompt"] = _text(row, "prompt")
    completion = row.get("completion")
    if isinstance(completion, list):
        out["completion"] = "".join(
            str(m.get("content") or "") for m in _messages(completion, "completion")
        )
    else:
        out["completion"] = _text(row, "completion")
    known = {"step", "prompt", "completion", "advantage", *KEEP}
    rewards, unknown = {}, {}
    for k, v in row.items():
        if k in known:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) or v is None:
            rewards[k] = v
        else:
            unknown[k] = v
    _refuse_unknown(unknown, ignore_unknown, "a TRL completions log")
    present = [float(v) for v in rewards.values() if v is not None and not math.isnan(v)]
    out["reward"] = sum(present) if present else None
    if rewards:
        out["reward_info"] = {
            k: (None if v is None or math.isnan(v) else v) for k, v in rewards.items()
        }
    out.update({k: row[k] for k in KEEP if k in row})
    return out


TURN_ROLES = ("assistant", "tool", "user", "system")


def _openai(row: dict[str, Any], ignore_unknown: bool) -> dict[str, Any]:
    # OpenAI chat fine-tuning JSONL: {"messages": [{"role": "system"|"user"|"assistant",
    # "content": ...}, ...]} per line. The turns before the first assistant turn are the
    # prompt; the assistant turn is the completion when it is the last message, else the
    # completion is a multi-turn trajectory of every message from it on (assistant, tool,
    # user, system turns). The format has no reward: a top-level "reward" (and "advantage")
    # is read when present (our extension).
    msgs = _messages(row.get("messages"), "messages")
    first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValidationError(
            "expected an assistant turn (the completion) after at least one prompt turn",
            field="messages",
        )
    out = {
        "prompt_messages": msgs[:first],
        "reward": row.get("reward"),
        "advantage": row.get("advantage"),
    }
    if first == len(msgs) - 1:
        out["completion"] = str(msgs[-1].get("content") or "")
    else:
        bad = next((m["role"] for m in msgs[first:] if m["role"] not in TURN_ROLES), None)
        if bad is not None:
            raise ValidationError(
                f"unknown role {bad!r} after the first assistant turn; expected one of "
                f"{', '.join(TURN_ROLES)}",
                field="messages",
            )
        out["completion_messages"] = msgs[first:]
    known = {"messages", "reward", "advantage", *KEEP}
    _refuse_unknown(
        {k: v for k, v in row.items() if k not in known}, ignore_unknown, "OpenAI chat JSONL"
    )
    out.update({k: row[k] for k in KEEP if k in row})
    return out


PRESETS: dict[str, Callable[[dict[str, Any], bool], dict[str, Any]]] = {
    "verl": _verl,
    "trl": _trl,
    "openai": _openai,
}


def _text(row: Mapping[str, Any], key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValidationError(f"expected a string, found {type(v).__name__}", field=key)
    return v


def _int(row: Mapping[str, Any], key: str) -> int:
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ValidationError(f"expected an integer, found {v!r}", field=key)
    return int(v)


def _messages(v: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in v
    ):
        raise ValidationError('expected a list of {"role", "content"} messages', field=key)
    return [dict(m) for m in v]


def _refuse_unknown(unknown: Mapping[str, Any], ignore: bool, what: str) -> None:
    if unknown and not ignore:
        names = ", ".join(sorted(unknown))
        raise ValidationError(
            f"unknown field(s) for {what}: {names}; drop them with --ignore-unknown "
            "or rename them with --map SRC=DEST",
            field=sorted(unknown)[0],
        )


# -- the importer -------------------------------------------------------------------------------
def group_key(text_row: Mapping[str, Any]) -> str:
    """A stable group id from the prompt (+ step): 16 hex digits of BLAKE2b."""
    prompt = text_row.get("prompt_messages") or text_row.get("prompt")
    blob = json.dumps([prompt, text_row.get("step")], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(blob.encode("utf-8"), digest_size=8).hexdigest()


@dataclass
class TextImporter:
    """Two passes over one file: :meth:`scan` (groups, sample indices, advantages), then
    ``importer(chunk, start)`` per chunk (text rows -> schema rows via the transformer)."""

    options: TextImportOptions
    transformer: RowTransformer
    group_ids: list[str] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    advantage: list[float | None] = field(default_factory=list)
    null_advantages: int = 0

    def normalize(self, row: dict[str, Any], ordinal: int) -> dict[str, Any]:
        try:
            return PRESETS[self.options.source](row, self.options.ignore_unknown)
        except ValidationError as exc:
            raise ValidationError(exc.reason, row=ordinal, field=exc.field) from exc

    def scan(self, rows: Iterable[dict[str, Any]]) -> None:
        counts: dict[str, int] = {}
        rewards, given = [], []
        self.group_ids, self.sample_index = [], []
        for i, raw in enumerate(rows):
            t = self.normalize(raw, i)
            gid = str(t["group_id"]) if t.get("group_id") is not None else group_key(t)
            self.group_ids.append(gid)
            self.sample_index.append(counts.get(gid, 0))
            counts[gid] = counts.get(gid, 0) + 1
            rewards.append(t.get("reward"))
            given.append(t.get("advantage"))
        self.advantage = list(given)
        missing = [i for i, a in enumerate(given) if a is None]
        if not missing:
            return
        if self.options.advantages == "none":
            self.null_advantages = len(missing)
            return
        groups = {self.group_ids[i] for i in missing}
        rows_of = [i for i, g in enumerate(self.group_ids) if g in groups]
        unscored = next((i for i in rows_of if rewards[i] is None), None)
        if unscored is not None:
            raise ValidationError(
                f"expected a reward to compute {self.options.advantages} advantages from, found "
                "none; add a reward, or pass --advantages none to store the row's advantage as "
                "null",
                row=unscored,
                field="reward",
            )
        adv = self.transformer.advantages(
            np.asarray([rewards[i] for i in rows_of], np.float64),
            np.asarray([self.group_ids[i] for i in rows_of]),
            self.options.advantages,
        )
        for i, a in zip(rows_of, adv):
            if given[i] is None:
                self.advantage[i] = float(a)

    def __call__(self, chunk: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
        text_rows = []
        for k, raw in enumerate(chunk):
            i = start + k
            t = self.normalize(raw, i)
            t["group_id"] = self.group_ids[i]
            t["sample_index"] = (
                self.sample_index[i] if t.get("sample_index") is None else t["sample_index"]
            )
            t["advantage"] = self.advantage[i]
            if self.options.policy_version is not None or t.get("policy_version") is None:
                t["policy_version"] = self.options.policy_version or 0
            if self.options.run_id is not None:
                t["run_id"] = self.options.run_id
            if t.get("prompt_messages"):  # kept for `export --as sft|dpo` (TRL chat format)
                t["metadata"] = {**(t.get("metadata") or {}), "messages": t["prompt_messages"]}
            if t.get("completion_messages"):  # and a trajectory's turns, for --as messages
                t["metadata"] = {
                    **(t.get("metadata") or {}),
                    "completion_messages": t["completion_messages"],
                }
            for name in ("reward_info", "metadata"):
                if isinstance(t.get(name), (dict, list)):
                    t[name] = json.dumps(t[name], ensure_ascii=False)
            t.pop("step", None)
            text_rows.append(t)
        try:
            return self.transformer(text_rows)
        except ValidationError as exc:
            row = None if exc.row is None else start + exc.row
            raise ValidationError(exc.reason, row=row, field=exc.field) from exc
