"""Answer extraction and a safe arithmetic evaluator shared by the task verifiers.

Completions are untrusted model output, so nothing here ever calls ``eval``/``exec``: arithmetic
is parsed with :mod:`ast` and only a whitelist of nodes (binary ``+ - * /`` over integer literals)
is interpreted, with exact rational arithmetic. Used via ``trainer.tasks``; no CLI.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from fractions import Fraction

from trainer.errors import UnsafeExpressionError

ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
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


def extract_tagged(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, stripped; ``None`` when absent."""
    matches = ANSWER_TAG_RE.findall(text)
    return matches[-1].strip() if matches else None


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
