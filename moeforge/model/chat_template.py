"""Chat templates, rendered in a sandbox with limits: a template comes from a model file, i.e. it is untrusted.

Rendering runs in jinja2's immutable sandbox (as transformers' ``apply_chat_template``: trim_blocks, lstrip_blocks,
loop controls) with a budget per render: a deadline (``CHAT_TEMPLATE_TIME_LIMIT_S``) and a size that no output,
string, sequence or number built on the way may exceed (``CHAT_TEMPLATE_MAX_CHARS`` beyond the messages' own size),
checked by the sandbox's filters and operations, and loops guarded. A template that breaks a limit or raises is
refused with ``TokenizerError`` naming why.
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from contextvars import ContextVar
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeforge.core.errors import TokenizerError

CHAT_TEMPLATE_TIME_LIMIT_S = 1.0  # a real chat template renders in milliseconds
CHAT_TEMPLATE_MAX_CHARS = 1_000_000  # the output and any value built on the way, beyond the messages' own size
# Filters that turn their whole value into text (nested containers included) before anything else.
TEXT_FILTERS = frozenset(("string", "tojson", "pprint", "join", "indent", "center", "upper", "lower", "title",
                          "capitalize", "trim", "escape", "e", "forceescape", "urlencode", "wordwrap", "safe"))


def render_chat_template(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         variables: dict[str, Any]) -> str:
    """Render a chat template over ``messages`` (and ``variables``: special tokens, caller's kwargs) within the
    limits; ``TokenizerError`` naming the limit or the template's failure."""
    # The messages' own text may be long; the limit is on what the template adds to it.
    inputs = len(json.dumps([messages, variables], default=str))
    budget = _RenderBudget(CHAT_TEMPLATE_TIME_LIMIT_S, CHAT_TEMPLATE_MAX_CHARS + inputs)
    token = _BUDGET.set(budget)
    try:
        template = _compile_chat_template(source)
        chunks, size = [], 0
        for chunk in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            size += len(chunk)
            budget.check_size(size, "the output")
            budget.check_time()
            chunks.append(chunk)
        return "".join(chunks)
    except TokenizerError:  # a limit
        raise
    except jinja2.exceptions.TemplateError as exc:  # syntax errors, raise_exception(), sandbox violations
        raise TokenizerError(f"chat template failed: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError, MemoryError) as exc:
        # Template code is arbitrary: 1/0, int("x"), a macro recursing forever are the model file's fault.
        raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _BUDGET.reset(token)


class _RenderBudget:
    """The limits of one chat-template render: a deadline and a size that no string, sequence, number (in
    decimal digits), range or call argument may exceed, the output included."""

    def __init__(self, seconds: float, max_chars: int) -> None:
        self.seconds, self.max_chars = seconds, max_chars
        self.deadline = time.perf_counter() + seconds

    def check_time(self) -> None:
        if time.perf_counter() > self.deadline:
            raise TokenizerError(f"chat template rendering exceeded its time limit ({self.seconds:g} s): the "
                                 "template loops too long for a chat template; refused")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TokenizerError(f"chat template rendering exceeded its size limit: {what} would be {size:,} "
                                 f"characters or items, more than {self.max_chars:,}; refused")

    def check_value(self, value: Any, what: str) -> Any:
        """``value`` if it is within the size limit (strings, sequences, integers by their decimal digits)."""
        if isinstance(value, str | list | tuple | dict):
            self.check_size(len(value), what)
        elif isinstance(value, int) and not isinstance(value, bool):
            self.check_size(_digits(value), what)
        return value

    def check_rendered(self, value: Any, what: str) -> Any:
        """``value`` if its text (``str(value)``, containers included) stays within the limit: checked before the
        conversion, which is one C call a time limit cannot interrupt (``[[s] * 999] * 999`` holds a million
        references to one string and would print as a terabyte)."""
        self.check_size(rendered_size(value, self.max_chars), what)
        return value

    def check_args(self, args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
        # Integer arguments size things (center(n), indent(n), range(n), lipsum(n)): bound them all.
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                self.check_size(abs(arg), f"an argument of {what}")

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        """Refuse an operation whose result would exceed the limit, before computing it."""
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0:
            self.check_size(_digits(left) * right, f"{_digits(left)}-digit ** {right}")
        elif operator == "*" and _is_int(left) and _is_int(right):
            self.check_size(_digits(left) + _digits(right), "an integer product")
        elif operator == "*":
            seq, count = (left, right) if _is_int(right) else (right, left)
            if isinstance(seq, Sized) and _is_int(count):
                self.check_size(len(seq) * count, f"a repetition {len(seq)} x {count}")
        elif operator == "+" and isinstance(left, Sized) and isinstance(right, Sized):
            self.check_size(len(left) + len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            self.check_args(right if isinstance(right, tuple) else (right,), {}, "a % format")
            self.check_widths(left, percent=True)
            self.check_size(len(left) + rendered_size(right, self.max_chars), "a % format")

    def check_widths(self, text: str, percent: bool) -> None:
        """Field widths and precisions in a ``%`` or ``str.format`` format string."""
        if percent:
            numbers = [n for m in re.finditer(r"%[#0 +-]*(\d*)(?:\.(\d*))?", text) for n in m.groups() if n]
        else:
            numbers = [n for _, _, spec, _ in string.Formatter().parse(text) for n in re.findall(r"\d+", spec or "")]
        for number in numbers:
            self.check_size(int(number), f"a field width in the format {text[:40]!r}")


_NO_BUDGET = _RenderBudget(math.inf, CHAT_TEMPLATE_MAX_CHARS)  # size checks still apply (compile-time folding)
_BUDGET: ContextVar[_RenderBudget] = ContextVar("chat_template_budget", default=_NO_BUDGET)


def rendered_size(value: Any, limit: int) -> int:
    """About the length of ``str(value)`` (strings with their quotes inside containers, separators, integers by
    their digits, other objects as a short repr), walking containers without converting anything and stopping
    as soon as the count passes ``limit``: the cost is bounded by the limit, not by the value."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif _is_int(item):
            total += _digits(item)
        else:
            total += 32
    return total


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _digits(value: int) -> int:
    """About the number of decimal digits of ``value`` (from its bit length: no conversion)."""
    return value.bit_length() * 30103 // 100000 + 1


def _check_str_call(budget: _RenderBudget, name: str, text: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Size checks of the str operations whose result is a product of their inputs' sizes (a C call that a time
    limit cannot interrupt): ``replace``, ``join``, ``expandtabs``, ``format``."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = len(text) + 1 if old == "" else text.count(old)
        budget.check_size(len(text) + count * (len(new) - len(old)), "a replace()")
    elif name == "join" and args and isinstance(args[0], Sized):
        items = args[0]
        parts = sum(len(x) for x in items if isinstance(x, str)) if isinstance(items, list | tuple) else 0
        budget.check_size(len(text) * max(len(items) - 1, 0) + parts, "a join()")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        budget.check_size(len(text) * max(tab, 1) if _is_int(tab) else len(text), "an expandtabs()")
    elif name in ("format", "format_map"):
        budget.check_widths(text, percent=False)
        budget.check_size(len(text) + rendered_size((args, kwargs), budget.max_chars), f"a {name}()")


def _limited_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the render budget's checks: time, integer arguments, product-sized str results, result size."""
    value_at = 1 if hasattr(fn, "jinja_pass_arg") else 0  # context-taking filters get the value second

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        budget.check_time()
        value, rest = (args[value_at], args[value_at + 1:]) if len(args) > value_at else (None, ())
        budget.check_args(rest, kwargs, f"|{name}")
        if name == "join" and isinstance(value, Sized):
            separator = rest[0] if rest else kwargs.get("d", "")
            _check_str_call(budget, "join", str(separator), (value,), {})
        elif name == "replace" and isinstance(value, str):
            _check_str_call(budget, name, value, rest, kwargs)
        elif name == "format" and isinstance(value, str):  # |format is value % args
            budget.check_widths(value, percent=True)
            budget.check_rendered(rest, f"the arguments of |{name}")
        elif name == "indent" and isinstance(value, str):  # every line gets the width: a product of sizes
            width = rest[0] if rest else kwargs.get("width", 4)
            lines = value.count("\n") + 1
            budget.check_size(len(value) + (len(width) if isinstance(width, str) else abs(int(width))) * lines,
                              f"|indent of {lines:,} lines")
        if name in TEXT_FILTERS:  # they convert their whole value (nested containers too) to text first
            budget.check_rendered(value, f"the text |{name} makes")
        return budget.check_value(fn(*args, **kwargs), f"the result of |{name}")

    return limited


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with a render budget: every loop step, call, attribute and item lookup checks the deadline;
    repetition, concatenation, powers, formats and ranges are sized before they are computed."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))  # (also keeps constant folding off for them)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        budget.check_time()
        budget.check_binop(operator, left, right)
        return budget.check_value(super().call_binop(context, operator, left, right), f"a {operator!r} result")

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        budget.check_time()
        name = getattr(__obj, "__name__", "a call")
        budget.check_args(args, kwargs, f"{name}()")
        # Jinja hands out str.format wrapped (functools.update_wrapper keeps the bound method as __wrapped__).
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(receiver, str):
            _check_str_call(budget, name, receiver, args, kwargs)
        return budget.check_value(super().call(__context, __obj, *args, **kwargs), f"the result of {name}()")

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _BUDGET.get()
        budget.check_time()
        return budget.check_value(super().getattr(obj, attribute), f"attribute {attribute!r}")

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _BUDGET.get()
        budget.check_time()
        return budget.check_value(super().getitem(obj, argument), "an item")

    def concat_guard(self, *values: Any) -> str:
        """What ``a ~ b`` computes (``str`` of each, joined), after checking the size of the text it would make."""
        budget = _BUDGET.get()
        budget.check_time()
        budget.check_rendered(values, "a ~ concatenation")
        return "".join(map(str, values))

    def loop_guard(self, iterable: Any) -> Iterator[Any]:
        """What every ``{% for %}`` iterates: the iterable, checking the deadline at each step."""
        budget = _BUDGET.get()
        for item in iterable:
            budget.check_time()
            yield item


def _bounded_range(*args: int) -> range:
    numbers = range(*args)
    _BUDGET.get().check_size(len(numbers), "range()")
    return numbers


_bounded_range.__name__ = "range"  # what error messages call it


def _guard(template: nodes.Template) -> nodes.Template:
    """Route every for loop's iterable through ``environment.loop_guard``, so nested loops over long sequences stop
    at the deadline too, and every ``~`` through ``environment.concat_guard``, which sizes its text first
    (environment attributes: a template cannot rebind them)."""
    for loop in template.find_all(nodes.For):
        guard = nodes.EnvironmentAttribute("loop_guard", lineno=loop.lineno)
        loop.iter = nodes.Call(guard, [loop.iter], [], None, None, lineno=loop.lineno)
    for concat in list(template.find_all(nodes.Concat)):
        concat_guard = nodes.EnvironmentAttribute("concat_guard", lineno=concat.lineno)
        call = nodes.Call(concat_guard, list(concat.nodes), [], None, None, lineno=concat.lineno)
        concat.nodes = [call]  # a Concat of one node is that node's text
    return template


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value before Jinja converts it to text: sized first."""
    return _BUDGET.get().check_rendered(value, "an output expression's text")


def check_chat_template(source: str) -> None:
    """Refuse (``TokenizerError``) a chat template that does not parse, e.g. when a server starts with it."""
    try:
        _compile_chat_template(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc}") from None


@cache
def _compile_chat_template(source: str) -> jinja2.Template:
    # The same environment transformers uses: chat templates come from model files, i.e. untrusted.
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates must not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                          finalize=_finalize)
    env.filters["tojson"] = tojson
    env.filters = {name: _limited_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _bounded_range
    return env.from_string(_guard(env.parse(source)))
