"""Safe arithmetic: parse with `ast`, evaluate only numbers, + - * / and parentheses.

Never `eval` model output. Anything else (names, calls, powers, very long input) raises `ValueError`
with the reason, which the tool layer shows the agent as an observation.

Example:
    >>> evaluate("(3 + 4) * -2")
    -14
    >>> evaluate("7 / 2")
    3.5
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported syntax {type(node).__name__}; use numbers, + - * / and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of `expression`; an integral result is returned as int."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    value = _eval(tree.body)
    return int(value) if float(value).is_integer() else value


def format_number(value: int | float) -> str:
    """How results are shown to the agent: integers plainly, other values to 6 significant digits."""
    return str(value) if isinstance(value, int) else f"{value:.6g}"
