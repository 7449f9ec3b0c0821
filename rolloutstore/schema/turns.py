"""Checks and derived columns of multi-turn rows (schema v2), for :func:`validate.prepare`.

A row's completion may interleave model tokens with tool / environment tokens:

- ``loss_mask`` (one 0/1 per completion token, at least one 1; omitted: all ones; stored
  null when all ones, which every read shows as ones: see rolloutstore.schema_compat);
- ``turns`` (null: one assistant turn over the whole completion; else sorted, contiguous
  ``{role, start, end, tool_name}`` covering ``[0, len(completion_ids))``, known roles,
  ``tool_name`` only on tool turns), with ``loss_mask`` 1 only inside assistant turns;
- ``behavior_logprobs`` finite and <= 0 on mask-1 tokens, exactly 0.0 (or null on input,
  stored 0.0) on mask-0 tokens: no log-prob on environment tokens;
- derived by the store, like the token counts: ``num_turns``, ``num_model_tokens``,
  ``num_tool_calls``, ``tools`` (a given value that differs is refused).

Every check is vectorised over the batch (numpy over the flattened Arrow lists); only the
error path and the (rare) tool names walk rows. Errors name the row and the field.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.errors import ValidationError

ROLES = ("assistant", "tool", "user", "system")
TURN_DERIVED = ("num_turns", "num_model_tokens", "num_tool_calls", "tools")
MASK_TYPE = pa.list_(pa.int8())


def _first(mask: np.ndarray) -> int | None:
    """Index of the first true entry (the row an error names), or None."""
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _flat(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(values, row of each value) of a list column (null rows contribute nothing)."""
    return pc.list_flatten(col), pc.list_parent_indices(col).to_numpy(zero_copy_only=False)


def _lengths(col: pa.Array) -> np.ndarray:
    return pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _ones(lengths: np.ndarray, type_: pa.DataType = MASK_TYPE) -> pa.Array:
    values = pa.array(np.ones(int(lengths.sum()), np.int8), type_.value_type)
    return pa.ListArray.from_arrays(pa.array(_offsets(lengths).astype(np.int32)), values, type_)


def _loss_mask(given: pa.Array | None, c_len: np.ndarray) -> pa.Array:
    """The loss mask: given rows checked, omitted ones (column or row null) all ones."""
    n = len(c_len)
    if given is None or given.null_count == n:
        return _ones(c_len)
    if given.null_count:
        fill = _ones(c_len).to_pylist()
        given = pa.array(
            [f if v is None else v for v, f in zip(given.to_pylist(), fill)], MASK_TYPE
        )
    m_len = _lengths(given)
    row = _first(m_len != c_len)
    if row is not None:
        raise ValidationError(
            f"expected one value per completion token: {c_len[row]} completion_ids but "
            f"{m_len[row]} loss_mask values",
            row=row,
            field="loss_mask",
        )
    flat, parent = _flat(given)
    if flat.null_count:
        pos = _first(flat.is_null().to_numpy(zero_copy_only=False))
        raise ValidationError(
            f"null element in list at position {pos - _offsets(c_len)[parent[pos]]}",
            row=int(parent[pos]),
            field="loss_mask",
        )
    v = flat.to_numpy(zero_copy_only=False)
    pos = _first((v != 0) & (v != 1))
    if pos is not None:
        raise ValidationError(
            f"expected 0 or 1, found {int(v[pos])} at position "
            f"{pos - _offsets(c_len)[parent[pos]]}",
            row=int(parent[pos]),
            field="loss_mask",
        )
    ones = np.bincount(parent, weights=v, minlength=n)
    row = _first(ones == 0)
    if row is not None:
        raise ValidationError(
            "expected at least one 1 (a token the policy sampled, to train on), found none; "
            "drop rows without a model token before appending",
            row=row,
            field="loss_mask",
        )
    return given


class _Turns:
    """The flattened turns of a batch: one entry per turn, with its row."""

    def __init__(self, turns: pa.Array | None, n: int):
        self.null = (
            np.ones(n, bool) if turns is None else turns.is_null().to_numpy(zero_copy_only=False)
        )
        if turns is None or self.null.all():
            self.row = np.zeros(0, np.int64)
            self.role = np.zeros(0, object)
            self.start = self.end = np.zeros(0, np.int64)
            self.tool = np.zeros(0, object)
            self.count = np.zeros(n, np.int64)
            return
        self.count = _lengths(turns)
        flat, parent = _flat(turns)
        self.row = parent.astype(np.int64)
        self._refuse_nulls(flat, parent)
        self.role = np.asarray(flat.field("role").to_pylist(), dtype=object)
        self.start = flat.field("start").to_numpy(zero_copy_only=False).astype(np.int64)
        self.end = flat.field("end").to_numpy(zero_copy_only=False).astype(np.int64)
        self.tool = np.asarray(flat.field("tool_name").to_pylist(), dtype=object)

    @staticmethod
    def _refuse_nulls(flat: pa.StructArray, parent: np.ndarray) -> None:
        bad = flat.is_null().to_numpy(zero_copy_only=False)
        what = "a null turn"
        for name in ("role", "start", "end"):
            if bad.any():
                break
            bad = flat.field(name).is_null().to_numpy(zero_copy_only=False)
            what = f"a turn without {name}"
        pos = _first(bad)
        if pos is not None:
            k = pos - _first(parent == parent[pos])
            raise ValidationError(
                f"turn {k} is {what}; expected {{role, start, end, tool_name}}",
                row=int(parent[pos]),
                field="turns",
            )

    def index(self) -> np.ndarray:
        """Each turn's index within its row."""
        starts = _offsets(self.count)
        return np.arange(len(self.row)) - starts[self.row]

    def check(self, c_len: np.ndarray) -> None:
        """Roles, tool names, bounds, order, contiguity and coverage; raises on the first bad."""
        row = _first(~self.null & (self.count == 0))
        if row is not None:
            raise ValidationError(
                "expected at least one turn, found an empty list (null: one assistant turn "
                "over the whole completion)",
                row=row,
                field="turns",
            )
        if not len(self.row):
            return
        k = self.index()
        first = k == 0
        last = np.r_[self.row[1:] != self.row[:-1], True]
        prev_end = np.r_[0, self.end[:-1]]
        role_known = np.isin(self.role, ROLES)
        checks: list[tuple[np.ndarray, Callable[[int], str]]] = [
            (~role_known, lambda i: f"unknown role {self.role[i]!r}; expected one of {ROLES}"),
            (
                (self.role != "tool") & (self.tool != None),  # noqa: E711  (elementwise)
                lambda i: (
                    f"tool_name {self.tool[i]!r} on a {self.role[i]!r} turn; "
                    "tool_name belongs to tool turns only"
                ),
            ),
            (
                (self.start < 0) | (self.end < self.start) | (self.end > c_len[self.row]),
                lambda i: (
                    f"[{self.start[i]}, {self.end[i]}) is outside the completion's "
                    f"{c_len[self.row[i]]} tokens (or ends before it starts)"
                ),
            ),
            (first & (self.start != 0), lambda i: f"starts at {self.start[i]}, expected 0"),
            (
                ~first & (self.start != prev_end),
                lambda i: (
                    f"starts at {self.start[i]} but the turn before ends at "
                    f"{prev_end[i]}; expected sorted, contiguous turns"
                ),
            ),
            (
                last & (self.end != c_len[self.row]),
                lambda i: (
                    f"the last turn ends at {self.end[i]}, expected the completion's end "
                    f"{c_len[self.row[i]]}: turns must cover every completion token"
                ),
            ),
        ]
        bad_at = [(_first(bad), msg) for bad, msg in checks]
        found = [(i, msg) for i, msg in bad_at if i is not None]
        if found:
            i, msg = min(found, key=lambda x: (self.row[x[0]], x[0]))
            raise ValidationError(f"turn {k[i]}: {msg(i)}", row=int(self.row[i]), field="turns")

    def assistant_tokens(self, c_len: np.ndarray) -> np.ndarray:
        """Per completion token (flattened in row order): whether it lies in an assistant turn."""
        null_rows = np.flatnonzero(self.null)
        seg_row = np.concatenate([null_rows, self.row])
        seg_pos = np.concatenate([np.zeros(len(null_rows), np.int64), self.index()])
        seg_flag = np.concatenate([np.ones(len(null_rows), bool), self.role == "assistant"])
        seg_len = np.concatenate([c_len[null_rows], self.end - self.start])
        order = np.lexsort((seg_pos, seg_row))
        return np.repeat(seg_flag[order], seg_len[order])


def _check_mask_in_assistant(mask: pa.Array, turns: _Turns, c_len: np.ndarray) -> None:
    flat, parent = _flat(mask)
    v = flat.to_numpy(zero_copy_only=False)
    bad = (v == 1) & ~turns.assistant_tokens(c_len)
    pos = _first(bad)
    if pos is not None:
        row = int(parent[pos])
        p = int(pos - _offsets(c_len)[row])
        sel = np.flatnonzero((turns.row == row) & (turns.start <= p) & (turns.end > p))
        role = turns.role[sel[0]] if sel.size else "?"
        raise ValidationError(
            f"loss_mask is 1 at position {p}, inside a {role!r} turn; only tokens of "
            "assistant turns (sampled by the policy) may carry loss",
            row=row,
            field="loss_mask",
        )


def _logprobs(lp: pa.Array, mask: pa.Array, c_len: np.ndarray) -> pa.Array:
    """Log-probs checked against the mask; nulls on mask-0 tokens become 0.0."""
    flat, parent = _flat(lp)
    m = pc.list_flatten(mask).to_numpy(zero_copy_only=False) == 1
    null = flat.is_null().to_numpy(zero_copy_only=False)
    v = flat.fill_null(0.0).to_numpy(zero_copy_only=False)
    starts = _offsets(c_len)
    checks = [
        (m & null, "null log-prob on a loss_mask-1 token; log-probs must be finite and <= 0"),
        (m & ~(np.isfinite(v) & (v <= 0)), "log-probs must be finite and <= 0"),
        (
            ~m & ~null & (v != 0),
            "no log-prob on environment tokens: loss_mask is 0 there, so expected 0.0 (or null)",
        ),
    ]
    for bad, what in checks:
        pos = _first(bad)
        if pos is not None:
            row = int(parent[pos])
            value = None if null[pos] else float(v[pos])
            raise ValidationError(
                f"{what}; found {value!r} at position {pos - starts[row]}",
                row=row,
                field="behavior_logprobs",
            )
    if not flat.null_count:
        return lp
    return pa.ListArray.from_arrays(
        pa.array(starts.astype(np.int32)), pa.array(v, lp.type.value_type), lp.type
    )


def _tools(turns: _Turns, n: int) -> pa.Array:
    names: dict[int, set[str]] = {}
    for r, role, tool in zip(turns.row, turns.role, turns.tool):
        if role == "tool" and tool is not None:
            names.setdefault(int(r), set()).add(tool)
    lengths = np.zeros(n, np.int64)
    values: list[str] = []
    for r in sorted(names):
        lengths[r] = len(names[r])
        values += sorted(names[r])
    offsets = pa.array(_offsets(lengths).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values, pa.string()))


def _refuse_different(cols: dict, name: str, derived: pa.Array, how: str) -> None:
    given = cols.get(name)
    if given is None or given.null_count == len(given):
        return
    valid = ~given.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_list(derived.type):
        g, d = given.to_pylist(), derived.to_pylist()
        diff = np.array([bool(ok) and a != b for a, b, ok in zip(g, d, valid)])
    else:
        gv = given.to_numpy(zero_copy_only=False)
        dv = derived.to_numpy(zero_copy_only=False)
        diff = valid & (np.where(valid, gv, 0) != dv)
    row = _first(diff)
    if row is not None:
        raise ValidationError(
            f"expected {how} = {derived[row].as_py()!r}, found {given[row].as_py()!r} "
            "(the store derives it; leave it out)",
            row=row,
            field=name,
        )


def _model_tokens(mask: pa.Array | None, c_len: np.ndarray) -> np.ndarray:
    """Each row's number of mask-1 tokens (``mask`` None: every token)."""
    if mask is None:
        return c_len.astype(np.int64)
    v = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = _offsets(c_len)
    sums = np.r_[0, np.cumsum(v)]
    return sums[starts[1:]] - sums[starts[:-1]]


def _stored_mask(mask: pa.Array | None, all_ones: np.ndarray) -> pa.Array:
    """Stored null when all ones (what every read shows it as): Lance stores a constant list
    at ~2 bytes per token, a null row at almost nothing."""
    if mask is None or all_ones.all():
        return pa.nulls(len(all_ones), MASK_TYPE)
    if not all_ones.any():
        return mask
    return pa.ListArray.from_arrays(mask.offsets, mask.values, MASK_TYPE, mask=pa.array(all_ones))


def prepare_turns(cols: dict[str, pa.Array], c_len: np.ndarray) -> None:
    """Check and complete ``cols``' multi-turn columns in place (see the module docstring).

    ``cols`` holds the batch's columns already converted to the schema types, with one
    log-prob per completion token (checked before); ``c_len`` the completion lengths.
    """
    n = len(c_len)
    given = cols.get("loss_mask")
    single = (given is None or given.null_count == n) and (
        cols.get("turns") is None or cols["turns"].null_count == n
    )  # single-turn rows only (the common case): every token is the model's
    mask = None if single else _loss_mask(given, c_len)
    turns = _Turns(cols.get("turns"), n)
    turns.check(c_len)
    if mask is not None:
        _check_mask_in_assistant(mask, turns, c_len)
    ones = _ones(c_len) if mask is None else mask
    cols["behavior_logprobs"] = _logprobs(cols["behavior_logprobs"], ones, c_len)
    model_tokens = _model_tokens(mask, c_len)
    derived = {
        "num_turns": (np.where(turns.null, 1, turns.count), "len(turns) (1 when null)"),
        "num_model_tokens": (model_tokens, "sum(loss_mask)"),
        "num_tool_calls": (
            np.bincount(turns.row[turns.role == "tool"], minlength=n),
            "the number of tool turns",
        ),
    }
    for name, (values, how) in derived.items():
        arr = pa.array(np.asarray(values).astype(np.int32))
        _refuse_different(cols, name, arr, how)
        cols[name] = arr
    cols["loss_mask"] = _stored_mask(mask, model_tokens == c_len)
    tools = _tools(turns, n)
    _refuse_different(cols, "tools", tools, "the sorted tool names of the tool turns")
    cols["tools"] = tools


def turns_from_mask(mask: list[int], env_role: str = "tool") -> list[dict]:
    """``turns`` for a completion known only by its loss mask (TRL's ``tool_mask``, verl's
    ``response_mask``): each run of 1s is an assistant turn, each run of 0s an ``env_role``
    turn (no tool name: the mask does not say which tool answered)."""
    if env_role not in ROLES or env_role == "assistant":
        raise ValueError(f"env_role must be one of {ROLES[1:]}, got {env_role!r}")
    turns: list[dict] = []
    for i, bit in enumerate(mask):
        role = "assistant" if bit else env_role
        if turns and turns[-1]["role"] == role:
            turns[-1]["end"] = i + 1
        else:
            turns.append({"role": role, "start": i, "end": i + 1, "tool_name": None})
    return turns
