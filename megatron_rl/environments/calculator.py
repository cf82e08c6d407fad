"""The calculator tool: exact arithmetic on a parsed expression, never `eval`.

Contract: `evaluate(expression)` parses with `ast` and walks the tree, allowing only numbers,
``+ - * / // % **``, unary ``+ -``, parentheses and the functions in `FUNCTIONS`. Integers stay
exact (``/`` of integers that divide is an integer); anything else raises `CalculatorError` with
a message fit to show the model (a name, an attribute, a call of anything else, a string,
division by zero, an exponent or a result too large to compute cheaply). `CALCULATOR_TOOL` is its
JSON schema; `call_calculator(arguments)` is the tool call: ``(text, ok)``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

MAX_EXPRESSION_CHARS = 2000
MAX_RESULT_DIGITS = 4000  # integers longer than this are refused (a ** b can be made huge cheaply)
MAX_EXPONENT = 10_000

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and parentheses, "
        "integers and decimals, and abs, round, min, max, sqrt.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. (123456 * 789) - 42"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message is shown to the model."""


Number = int | float
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _round(value: Number, ndigits: int | None = None) -> Number:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > 100):
        raise CalculatorError("round(x, n) takes an integer n between -100 and 100")
    return round(value, ndigits)


FUNCTIONS: dict[str, Callable[..., Number]] = {"abs": abs, "round": _round, "min": min, "max": max, "sqrt": math.sqrt}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic `expression` (see module doc)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {err.msg}") from None
    try:
        return _checked(_eval(tree.body))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _checked(_eval(node.left)), _checked(_eval(node.right))
        return _binary(node.op, left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        if node.keywords or not node.args:
            raise CalculatorError(f"{node.func.id}() takes positional numbers only")
        return FUNCTIONS[node.func.id](*(_checked(_eval(arg)) for arg in node.args))
    raise CalculatorError(
        f"unsupported element {ast.unparse(node)!r:.60}: only numbers, + - * / // % **, "
        f"parentheses and {', '.join(FUNCTIONS)}"
    )


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Div):
        if isinstance(left, int) and isinstance(right, int) and right and left % right == 0:
            return left // right
        return left / right
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT or (
            isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * math.log10(abs(left)) > MAX_RESULT_DIGITS
        ):
            raise CalculatorError("exponent too large")
        return left**right
    if type(op) in _BINARY:
        return _BINARY[type(op)](left, right)
    raise CalculatorError(f"unsupported operator {type(op).__name__}")


def _checked(value: Number) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * math.log2(10):
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def format_number(value: Number) -> str:
    """An exact integer, or a float without a trailing '.0' when it is whole."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def call_calculator(arguments: Mapping[str, Any]) -> tuple[str, bool]:
    """The calculator tool call: (the result or the error message, whether it succeeded)."""
    try:
        return format_number(evaluate(arguments.get("expression"))), True
    except CalculatorError as err:
        return f"Error: {err}", False
