"""Answer extraction and a safe arithmetic evaluator shared by the task verifiers.

Completions are untrusted model output, so nothing here ever calls ``eval``/``exec``: arithmetic
is parsed with :mod:`ast` and only a whitelist of nodes (binary ``+ - * /`` over integer literals)
is interpreted, with exact rational arithmetic. Tags are found with ``str.find`` scans whose work
is linear in the text: the regex ``<answer>(.*?)</answer>`` gave the same blocks but rescanned
to the end from every unclosed tag (quadratic: minutes on a megabyte of ``<answer>``).
Used via ``trainer.tasks``; no CLI.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

from trainer.errors import UnsafeExpressionError

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# The look-behind stops "37-45" from parsing as the negative number -45.
_INT_RE = re.compile(r"(?<![0-9])-?[0-9]+")
# Longer digit strings are never a legitimate answer here and int() on megabyte-long
# strings is a cheap denial of service.
MAX_INT_DIGITS = 40
# Bounds the parse cost and the size of intermediate values (no ``**``, so values stay small).
MAX_EXPR_CHARS = 256

_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def tagged_blocks(text: str, open_tag: str, close_tag: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each ``open_tag ... close_tag`` block's content, left to right: the
    blocks ``re.finditer(open + "(.*?)" + close, text, re.DOTALL)`` finds (each block ends at
    the first closing tag after its opening tag; the next starts after it), in linear time."""
    if not open_tag or not close_tag:
        raise ValueError("tags must be non-empty")
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:  # no later opening tag has a closing tag after it either
            return
        yield start + len(open_tag), end
        pos = end + len(close_tag)


def extract_tagged(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, stripped; ``None`` when absent."""
    last = deque(tagged_blocks(text, ANSWER_OPEN, ANSWER_CLOSE), maxlen=1)
    return text[last[0][0] : last[0][1]].strip() if last else None


def replace_blocks(text: str, tags: Sequence[tuple[str, str]], repl: str) -> str:
    """``text`` with each ``open ... close`` block of the ``(open, close)`` pairs ``tags``
    replaced by ``repl``: what ``re.sub`` does with the alternation ``open1.*?close1|...``
    (escaped, DOTALL; at each position the pairs are tried in order), in linear time."""
    if not all(o and c for o, c in tags):
        raise ValueError("tags must be non-empty")
    live = list(range(len(tags)))  # pairs that may still match
    nxt = [text.find(o) for o, _ in tags]  # each pair's next opening tag at or after pos
    close = [-1] * len(tags)  # the closing tag each pair found last
    out, pos = [], 0
    while live := [k for k in live if nxt[k] >= 0]:
        at = min(nxt[k] for k in live)
        end = None
        for k in [k for k in live if nxt[k] == at]:
            start = at + len(tags[k][0])
            if close[k] < start:
                close[k] = text.find(tags[k][1], start)
            if close[k] < 0:  # no closing tag after this opening tag, nor after any later one
                nxt[k] = -1
                continue
            end = close[k] + len(tags[k][1])
            break
        if end is None:  # no block starts here: the next opening tags after it
            for k in live:
                if nxt[k] == at:
                    nxt[k] = text.find(tags[k][0], at + 1)
            continue
        out += [text[pos:at], repl]
        pos = end
        for k in live:
            if 0 <= nxt[k] < pos:
                nxt[k] = text.find(tags[k][0], pos)
    out.append(text[pos:])
    return "".join(out)


def last_int(text: str) -> int | None:
    """The last integer literal in ``text`` (a leading ``-`` counts), or ``None``."""
    matches = _INT_RE.findall(text)
    if not matches:
        return None
    last = matches[-1]
    if len(last.lstrip("-")) > MAX_INT_DIGITS:
        return None
    return int(last)


def parse_arith(expr: str) -> ast.Expression:
    """Parse ``expr`` and check every node against the whitelist; raise UnsafeExpressionError."""
    if len(expr) > MAX_EXPR_CHARS:
        raise UnsafeExpressionError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeExpressionError(f"not a parsable expression: {exc}") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, *_BINOPS)):
            continue
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise UnsafeExpressionError(f"operator {type(node.op).__name__} is not allowed")
            continue
        # bool is an int subclass; True/False are not numbers a verifier should accept.
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        raise UnsafeExpressionError(f"{type(node).__name__} is not allowed in an expression")
    return tree


def arith_constants(tree: ast.Expression) -> list[int]:
    """Integer literals of a tree returned by :func:`parse_arith`, in source order."""
    consts = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    consts.sort(key=lambda n: (n.lineno, n.col_offset))
    return [int(n.value) for n in consts]


def eval_arith(tree: ast.Expression) -> Fraction:
    """Exact value of a tree returned by :func:`parse_arith`; ZeroDivisionError propagates."""

    def _eval(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
        raise UnsafeExpressionError(f"{type(node).__name__} is not allowed in an expression")

    return _eval(tree.body)


def safe_eval(expr: str) -> Fraction:
    """Parse and exactly evaluate whitelisted integer arithmetic; never executes code."""
    return eval_arith(parse_arith(expr))
