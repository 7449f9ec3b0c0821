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
``metadata.messages``) for ``export --as messages``. A TRL conversational completion with tool
turns takes the same path.

Every field a preset reads is checked before use (pass 1 refuses before anything is written):
rewards and advantages are null or finite float32 numbers, steps integers, prompts non-empty
text, message roles one of :data:`ROLES`, message content text (a string, or OpenAI content
parts that are all text), group ids strings or integers, every string valid Unicode; and text
that will be tokenized must not hold one of the tokenizer's control tokens (the transformer's
``control_token_in``). Rows without a ``rollout_id`` get one from their content
(:meth:`TextImporter.content_id`), so ``--on-duplicate skip`` makes a re-import a no-op.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import numpy as np

from rolloutstore.errors import ValidationError
from rolloutstore.schema.ids import deterministic_uuid7

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

    def control_token_in(self, text: str) -> str | None:
        """The first of the tokenizer's control (special) tokens ``text`` holds, else None."""
        ...


# -- presets: one framework row -> a text row -------------------------------------------------
# Text-row keys: prompt (str) | prompt_messages (list of {"role", "content"}), completion (str)
# | completion_messages (a multi-turn trajectory's messages, from the first assistant turn),
# reward, advantage, step, reward_info (dict), metadata (dict), and schema columns kept as is.
# check(text, field): refuses text that holds a control token (see TextImporter.check_text).
Check = Callable[[str, str], None]
KEEP = ("rollout_id", "run_id", "group_id", "sample_index", "policy_version", "finish_reason")


def _verl(row: dict[str, Any], ignore_unknown: bool, check: Check) -> dict[str, Any]:
    # verl/trainer/ppo/ray_trainer.py (volcengine/verl), RayPPOTrainer._dump_generations:
    # one JSONL per step in trainer.rollout_data_dir with keys input (prompt decoded with
    # skip_special_tokens=True, i.e. verl's rendered chat text minus special tokens),
    # output, gts (reward_model.ground_truth), score (sum of token_level_scores), step, and
    # every reward_extra_infos_dict key of the same length (e.g. acc, request_id).
    out = {
        "prompt": _text(row, "input", check, nonempty=True),
        "completion": _text(row, "output", check),
        "reward": _number(row, "score"),
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


def _trl(row: dict[str, Any], ignore_unknown: bool, check: Check) -> dict[str, Any]:
    # trl/trainer/grpo_trainer.py (huggingface/trl 1.16), GRPOTrainer.log with
    # log_completions=True: OUTPUT_DIR/completions/completions_{global_step:05d}.parquet
    # with columns step, prompt, completion (strings, or lists of {"role", "content"}
    # for conversational data), one column per reward function (named by
    # reward_func_names), extra columns from log_extra, and advantage. TRL's reward is
    # the reward_weights-weighted sum of the function columns (weights 1.0 by default,
    # NaN where a function did not apply): summed here with weight 1.
    out: dict[str, Any] = {"step": row.get("step"), "advantage": _number(row, "advantage")}
    if row.get("step") is not None:
        out["policy_version"] = _int(row, "step")
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        out["prompt_messages"] = _messages(prompt, "prompt", check)
    else:
        out["prompt"] = _text(row, "prompt", check, nonempty=True)
    completion = row.get("completion")
    if isinstance(completion, list):
        # A tool-using completion (assistant / tool / assistant ...) is a multi-turn
        # trajectory, built by the same path as OpenAI chats: never one assistant turn
        # holding the tool's text as model output.
        done = _messages(completion, "completion", check)
        if not done or done[0]["role"] != "assistant":
            raise ValidationError(
                "expected the completion's messages to start with an assistant turn, found "
                + (repr(done[0]["role"]) if done else "none"),
                field="completion[0].role" if done else "completion",
            )
        if len(done) == 1:
            out["completion"] = done[0]["content"]
        elif "prompt_messages" not in out:
            raise ValidationError(
                "a multi-turn completion (tool or user turns after the assistant's) needs a "
                "conversational prompt (a list of messages), found text",
                field="prompt",
            )
        else:
            out["completion_messages"] = done
    else:
        out["completion"] = _text(row, "completion", check)
    known = {"step", "prompt", "completion", "advantage", *KEEP}
    rewards, unknown = {}, {}
    for k, v in row.items():
        if k in known:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) or v is None:
            # NaN: the function did not apply to this row (TRL's convention); inf is refused
            nan = isinstance(v, float) and math.isnan(v)
            rewards[k] = None if nan or _number(row, k) is None else v
        else:
            unknown[k] = v
    _refuse_unknown(unknown, ignore_unknown, "a TRL completions log")
    present = [float(v) for v in rewards.values() if v is not None]
    out["reward"] = _finite(math.fsum(present), "reward") if present else None
    if rewards:
        out["reward_info"] = rewards
    out.update({k: row[k] for k in KEEP if k in row})
    return out


ROLES = ("system", "user", "assistant", "tool")
TURN_ROLES = ROLES  # roles allowed after the first assistant turn: the same set


def _openai(row: dict[str, Any], ignore_unknown: bool, check: Check) -> dict[str, Any]:
    # OpenAI chat fine-tuning JSONL: {"messages": [{"role": "system"|"user"|"assistant",
    # "content": ...}, ...]} per line. The turns before the first assistant turn are the
    # prompt; the assistant turn is the completion when it is the last message, else the
    # completion is a multi-turn trajectory of every message from it on (assistant, tool,
    # user, system turns). The format has no reward: a top-level "reward" (and "advantage")
    # is read when present (our extension).
    msgs = _messages(row.get("messages"), "messages", check)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValidationError(
            "expected an assistant turn (the completion) after at least one prompt turn",
            field="messages",
        )
    out = {
        "prompt_messages": msgs[:first],
        "reward": _number(row, "reward"),
        "advantage": _number(row, "advantage"),
    }
    if first == len(msgs) - 1:
        out["completion"] = msgs[-1]["content"]
    else:
        out["completion_messages"] = msgs[first:]
    known = {"messages", "reward", "advantage", *KEEP}
    _refuse_unknown(
        {k: v for k, v in row.items() if k not in known}, ignore_unknown, "OpenAI chat JSONL"
    )
    out.update({k: row[k] for k in KEEP if k in row})
    return out


PRESETS: dict[str, Callable[[dict[str, Any], bool, Check], dict[str, Any]]] = {
    "verl": _verl,
    "trl": _trl,
    "openai": _openai,
}


def _show(v: Any) -> str:
    """A short one-line picture of a bad value for an error message (never a deep repr)."""
    if isinstance(v, (dict, list, tuple)):
        return f"a {'JSON object' if isinstance(v, dict) else 'list'}"
    try:  # as the file spells it: true, NaN, "abc"
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):  # a Parquet value JSON has no spelling for
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(row: Mapping[str, Any], key: str, check: Check, nonempty: bool = False) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValidationError(f"expected a string, found {type(v).__name__}", field=key)
    if nonempty and not v:
        raise ValidationError("expected a non-empty prompt, found an empty string", field=key)
    check(v, key)
    return v


FLOAT32_MAX = 3.4028234663852886e38  # rewards and advantages are stored as float32


def _finite(v: float, key: str, shown: Any = None) -> float:
    if not abs(v) <= FLOAT32_MAX:  # also NaN
        raise ValidationError(
            f"expected a finite number (|x| <= 3.4e38, float32), found {_show(shown or v)}",
            field=key,
        )
    return v


def _number(row: Mapping[str, Any], key: str) -> float | None:
    """A reward or advantage: null, or a finite number (NaN, inf and 1e400 are refused
    here, before any group advantage is computed from them)."""
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValidationError(f"expected a number or null, found {_show(v)}", field=key)
    try:
        return _finite(float(v), key)
    except OverflowError:  # an integer beyond float range
        return _finite(math.inf, key, shown=v)


INT64 = 2**63


def _int(row: Mapping[str, Any], key: str) -> int:
    v = row[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not v.is_integer())  # also NaN and inf
        or not -INT64 <= v < INT64
    ):
        raise ValidationError(f"expected an integer, found {_show(v)}", field=key)
    return int(v)


def _content(m: Mapping[str, Any], where: str) -> str:
    """A message's content as text: a string, or OpenAI content parts that are all text
    (joined with newlines, as vLLM's chat parser joins them); null only for an assistant
    turn (one that only calls tools). Numbers and objects are refused, as verl refuses them."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m["role"] == "assistant":
        return ""
    if isinstance(c, list) and c:
        for k, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                found = repr(kind) if isinstance(kind, str) else _show(part)
                raise ValidationError(
                    f"expected a text content part, found {found}; only text can be imported",
                    field=f"{where}.content[{k}]",
                )
        return "\n".join(part["text"] for part in c)
    raise ValidationError(
        f"expected text (a string or a list of text parts), found {_show(c)}",
        field=f"{where}.content",
    )


def _messages(v: Any, key: str, check: Check) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise ValidationError('expected a list of {"role", "content"} messages', field=key)
    out = []
    for k, m in enumerate(v):
        where = f"{key}[{k}]"
        if not isinstance(m, dict):
            raise ValidationError(f'expected a {{"role", "content"}} message, found {_show(m)}',
                                  field=where)  # fmt: skip
        if m.get("role") not in ROLES:
            # Every role, before the first assistant turn too: a role is template text,
            # and "user<|im_end|>..." would forge a turn.
            raise ValidationError(
                f"expected a role in {', '.join(ROLES)}, found {_show(m.get('role'))}",
                field=f"{where}.role",
            )
        m = {**m, "content": _content(m, where)}
        for name, text in _strings(m):  # everything the chat template may render
            check(text, f"{where}.{name}")
        out.append(m)
    return out


def _strings(value: Any) -> Iterator[tuple[str, str]]:
    """(top-level key, string) for every string (keys too) in a JSON value, iteratively: the
    reader admits nesting a recursive walk would not survive."""
    if not isinstance(value, dict):
        return
    stack: list[tuple[str, Any]] = [(k, v) for k, v in value.items()]
    stack += [(k, k) for k in value]
    while stack:
        top, v = stack.pop()
        if isinstance(v, str):
            yield top, v
        elif isinstance(v, dict):
            stack.extend((top, x) for x in v.values())
            stack.extend((top, x) for x in v)
        elif isinstance(v, (list, tuple)):
            stack.extend((top, x) for x in v)


def _check_unicode(row: Mapping[str, Any]) -> None:
    """Refuse lone surrogates (JSON "\\ud800" escapes): text that is not valid Unicode
    cannot be tokenized or stored."""
    for top, text in _strings(row):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(text[exc.start])
            raise ValidationError(
                f"expected valid Unicode text, found a lone surrogate \\u{code:04x} at "
                f"character {exc.start}; fix the text's escapes",
                field=str(top).encode("utf-8", "backslashreplace").decode(),
            ) from None


def _group_id(v: Any) -> str:
    if isinstance(v, str) and v:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    raise ValidationError(
        f"expected a non-empty string or an integer, found {_show(v)}", field="group_id"
    )


def _refuse_unknown(unknown: Mapping[str, Any], ignore: bool, what: str) -> None:
    if unknown and not ignore:
        names = ", ".join(sorted(unknown))
        raise ValidationError(
            f"unknown field(s) for {what}: {names}; drop them with --ignore-unknown "
            "or rename them with --map SRC=DEST",
            field=sorted(unknown)[0],
        )


def _dumps(value: Any, ordinal: int, **kw: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, **kw)
    except RecursionError:  # a JSON reader admits nesting the encoder cannot take
        raise ValidationError("JSON nested too deeply to store", row=ordinal) from None


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

    rollout_ids: list[str] = field(default_factory=list)

    def check_text(self, text: str, field: str) -> None:
        """Refuse text that holds one of the tokenizer's control tokens (``<|im_end|>``,
        ``<|endoftext|>``, ...). Refused rather than tokenized literally: such text is
        either a forged turn or end of sequence (``user<|im_end|>...``) or a rendering
        that kept special tokens, and storing it either way would train on a lie."""
        token = self.transformer.control_token_in(text)
        if token is not None:
            raise ValidationError(
                f"the text holds {token!r}, a control token of the tokenizer; imported text "
                "never becomes control tokens (the chat template writes the real ones): "
                "remove it from the text",
                field=field,
            )

    def normalize(self, row: dict[str, Any], ordinal: int) -> dict[str, Any]:
        try:
            _check_unicode(row)
            t = PRESETS[self.options.source](row, self.options.ignore_unknown, self.check_text)
            if t.get("group_id") is not None:
                t["group_id"] = _group_id(t["group_id"])
            return t
        except ValidationError as exc:
            raise ValidationError(exc.reason, row=ordinal, field=exc.field) from exc

    def content_id(self, row: dict[str, Any], occurrence: int, ordinal: int) -> str:
        """The rollout id of a row without one: a UUIDv7-shaped hash of the source format,
        the row's canonical JSON and ``occurrence``, how many identical rows came before it
        in the file. Re-importing a file (``--on-duplicate skip``) is then a no-op, and two
        identical rows of one file are still two rollouts. The time field is 0: the
        sampling time of an imported rollout is unknown."""
        blob = _dumps(row, ordinal, sort_keys=True, separators=(",", ":"), default=repr)
        digest = hashlib.blake2b(blob.encode("utf-8"), digest_size=16).hexdigest()
        return deterministic_uuid7(f"import/{self.options.source}/{digest}/{occurrence}", 0)

    def scan(self, rows: Iterable[dict[str, Any]]) -> None:
        counts: dict[str, int] = {}
        copies: dict[str, int] = {}
        rewards, given = [], []
        self.group_ids, self.sample_index, self.rollout_ids = [], [], []
        for i, raw in enumerate(rows):
            t = self.normalize(raw, i)
            gid = t["group_id"] if t.get("group_id") is not None else group_key(t)
            self.group_ids.append(gid)
            self.sample_index.append(counts.get(gid, 0))
            counts[gid] = counts.get(gid, 0) + 1
            first = self.content_id(raw, 0, i)  # the same for identical rows
            n = copies.get(first, 0)
            self.rollout_ids.append(self.content_id(raw, n, i) if n else first)
            copies[first] = n + 1
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
            if t.get("rollout_id") is None:
                t["rollout_id"] = self.rollout_ids[i]
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
                    t[name] = _dumps(t[name], i)
            t.pop("step", None)
            text_rows.append(t)
        try:
            return self.transformer(text_rows)
        except ValidationError as exc:
            row = None if exc.row is None else start + exc.row
            raise ValidationError(exc.reason, row=row, field=exc.field) from exc
