"""Named rewards for prompt datasets: ``math``, ``exact``, ``contains``, ``last_number``,
``regex:PATTERN`` or a user's ``module.path:function``.

:func:`get_reward` turns a spec string into a :class:`Reward`: a pure function
``reward(prompt_text, completion_text, answer) -> RewardResult`` plus the ``name`` and
``version`` that every rollout records (in ``reward_info`` and the row's metadata), so a later
re-scoring can tell which reward, and which revision of it, scored what:

* ``math``        -- answer equivalence: the last ``\\boxed{}`` (else the last number or
  expression) of the completion equals the reference as a number or expression: ``3/4``,
  ``\\frac{3}{4}`` and ``0.75`` agree. Uses math-verify (``pip install
  'rolloutstore[math]'``) when installed, else a built-in comparison of rational numbers;
  the version names which (``math-verify/0.9.0`` or ``builtin/1``).
* ``exact``       -- the ``<answer>`` block (or the whole completion) equals the answer, stripped.
* ``contains``    -- the answer occurs somewhere in the completion (an empty answer never does).
* ``last_number`` -- the last number (integer, decimal or ``a/b``) of the ``<answer>`` block
  (or the completion) equals the answer's last number, exactly as rationals.
* ``last_int``    -- the last integer of the ``<answer>`` block (or completion) equals the
  answer's (the ``file`` task's original reward).
* ``regex:PATTERN`` -- the last match of PATTERN in the completion (its first group if it has
  one) equals the answer, stripped.
* ``module.path:function`` or ``path/to/file.py:function`` -- a user function
  ``(prompt, completion, answer) -> float | RewardResult``; ``prompt`` is the text the model saw
  (chat-rendered if the template is on). Its version is ``__version__`` if the function has
  one, else a hash of its source, so editing the function changes the recorded version.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from trainer.errors import TaskError
from trainer.tasks.base import RewardResult
from trainer.tasks.parsing import MAX_INT_DIGITS, extract_tagged, last_int

RewardFn = Callable[[str, str, str], RewardResult]


@dataclass(frozen=True)
class Reward:
    """A named, versioned reward function (see the module docstring)."""

    name: str
    version: str
    fn: RewardFn

    def __call__(self, prompt_text: str, completion_text: str, answer: str) -> RewardResult:
        result = self.fn(prompt_text, completion_text, answer)
        if isinstance(result, RewardResult):
            value, info = result.reward, dict(result.info)
        elif isinstance(result, (int, float)) and not isinstance(result, bool):
            value, info = result, {}
        elif isinstance(result, bool):
            value, info = float(result), {}
        else:
            raise TaskError(
                f"reward {self.name!r} returned {type(result).__name__}; it must return a "
                "float or a trainer.tasks.RewardResult"
            )
        value = float(value)
        if not math.isfinite(value):
            raise TaskError(f"reward {self.name!r} returned {value}; rewards must be finite")
        info.update(reward_fn=self.name, reward_fn_version=self.version)
        return RewardResult(value, info)

    @property
    def spec(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}


def _candidate(completion_text: str) -> str:
    tagged = extract_tagged(completion_text)
    return tagged if tagged is not None else completion_text


def _exact(_prompt: str, completion: str, answer: str) -> RewardResult:
    candidate = _candidate(completion).strip()
    correct = candidate == answer.strip()
    return RewardResult(float(correct), {"parsed": candidate, "correct": correct})


def _contains(_prompt: str, completion: str, answer: str) -> RewardResult:
    needle = answer.strip()
    # An empty answer is "contained" in everything; treat it as unverifiable, not free reward.
    correct = bool(needle) and needle in completion
    return RewardResult(float(correct), {"correct": correct})


def _last_int(_prompt: str, completion: str, answer: str) -> RewardResult:
    parsed, expected = last_int(_candidate(completion)), last_int(answer)
    correct = parsed is not None and expected is not None and parsed == expected
    return RewardResult(float(correct), {"parsed": parsed, "correct": correct})


# A number: -12, 3.5, 1,000 (thousands commas), or a fraction 3/4 of two such integers.
_NUMBER_RE = re.compile(
    r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])-?\d+(?:\.\d+)?(?:/\d+)?"
)
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")


def to_fraction(text: str) -> Fraction | None:
    """``text`` (``7``, ``-1.5``, ``1,000``, ``3/4``, ``\\frac{3}{4}``) as a Fraction, or None."""
    s = text.strip().strip("$").strip().rstrip(".").replace(",", "")
    m = _FRAC_RE.fullmatch(s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    if len(s) > 2 * MAX_INT_DIGITS + 1:
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def last_number(text: str) -> Fraction | None:
    """The last number of ``text`` (``\\frac{a}{b}`` counts) as a Fraction, or None."""
    text = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    for match in reversed(_NUMBER_RE.findall(text)):
        value = to_fraction(match)
        if value is not None:
            return value
    return None


def _last_number(_prompt: str, completion: str, answer: str) -> RewardResult:
    parsed, expected = last_number(_candidate(completion)), last_number(answer)
    correct = parsed is not None and expected is not None and parsed == expected
    return RewardResult(
        float(correct), {"parsed": None if parsed is None else str(parsed), "correct": correct}
    )


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _math_builtin(_prompt: str, completion: str, answer: str) -> RewardResult:
    """Rational-number equivalence: boxed content first, else the last number."""
    boxed = last_boxed(completion)
    parsed = (to_fraction(boxed) or last_number(boxed)) if boxed is not None else None
    if parsed is None:
        parsed = last_number(_candidate(completion))
    gold_text = last_boxed(answer) or answer
    expected = to_fraction(gold_text) or last_number(gold_text)
    correct = parsed is not None and expected is not None and parsed == expected
    return RewardResult(
        float(correct),
        {"parsed": None if parsed is None else str(parsed), "correct": correct},
    )


def _math_verify(_prompt: str, completion: str, answer: str) -> RewardResult:
    from math_verify import parse, verify

    # math-verify bounds its work with signal.alarm, which only the main thread may use.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=limit)
    if not gold:
        # A bare "3/4" or "1.5" always parses; anything else is the dataset's problem.
        gold = parse(f"${answer}$", parsing_timeout=limit)
    pred = parse(completion, parsing_timeout=limit)
    try:
        correct = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=limit)
    except Exception as exc:  # a sympy failure on odd model output is a wrong answer
        return RewardResult(0.0, {"parsed": None, "correct": False, "error": str(exc)[:200]})
    parsed = str(pred[-1]) if pred else None
    return RewardResult(float(correct), {"parsed": parsed, "correct": correct})


def _math_reward() -> Reward:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return Reward("math", "builtin/1", _math_builtin)
    from importlib.metadata import version

    return Reward("math", f"math-verify/{version('math-verify')}", _math_verify)


BUILTIN_REWARDS: dict[str, Callable[[], Reward]] = {
    "math": _math_reward,
    "exact": lambda: Reward("exact", "1", _exact),
    "contains": lambda: Reward("contains", "1", _contains),
    "last_number": lambda: Reward("last_number", "1", _last_number),
    "last_int": lambda: Reward("last_int", "1", _last_int),
}


def _regex_reward(spec: str) -> Reward:
    pattern = spec.removeprefix("regex:")
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise TaskError(f"reward {spec!r}: not a valid regular expression ({exc})") from None
    if not pattern:
        raise TaskError("reward 'regex:' needs a pattern, e.g. 'regex:answer is (\\d+)'")

    def score(_prompt: str, completion: str, answer: str) -> RewardResult:
        matches = list(rx.finditer(completion))
        if not matches:
            return RewardResult(0.0, {"parsed": None, "correct": False})
        last = matches[-1]
        found = (last.group(1) if rx.groups else last.group(0)) or ""
        correct = found.strip() == answer.strip()
        return RewardResult(float(correct), {"parsed": found, "correct": correct})

    return Reward(spec, "1", score)


def _load_module(module: str, spec: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise TaskError(f"reward {spec!r}: no such file {str(path)!r}")
        name = f"_rolloutstore_reward_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(mod)
        except Exception as exc:
            raise TaskError(f"reward {spec!r}: {path} failed to import: {exc!r}") from exc
        return mod
    # Console scripts do not put the working folder on sys.path; a user's module lives there.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise TaskError(
            f"reward {spec!r}: module {module!r} does not import ({exc!r}); give an importable "
            "module (on PYTHONPATH or in the working folder) or a path/to/file.py:function"
        ) from exc


def _function_version(fn: Callable) -> str:
    declared = getattr(fn, "__version__", None)
    if declared is not None:
        return str(declared)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return "unknown"
    return "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]


def _function_reward(spec: str) -> Reward:
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise TaskError(f"reward {spec!r}: expected module.path:function")
    mod = _load_module(module, spec)
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise TaskError(f"reward {spec!r}: {module!r} has no function {attr!r}")

    def score(prompt: str, completion: str, answer: str) -> RewardResult:
        return fn(prompt, completion, answer)

    return Reward(spec, _function_version(fn), score)


def get_reward(spec: str) -> Reward:
    """The :class:`Reward` named by ``spec`` (see the module docstring); TaskError if unknown."""
    if not isinstance(spec, str) or not spec:
        raise TaskError(f"reward must be a non-empty str, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]()
    if spec.startswith("regex:"):
        return _regex_reward(spec)
    if ":" in spec:
        return _function_reward(spec)
    raise TaskError(
        f"unknown reward {spec!r}; choose one of {sorted(BUILTIN_REWARDS)}, 'regex:PATTERN' "
        "or 'module.path:function'"
    )
