"""Typed values across the sandbox boundary: a JSON encoding that keeps Python's built-in types apart,
and the trusted comparison of a returned value with an expected one.

Stdlib only: this file is also shipped into the sandbox (as ``_hetrl_typed.py``) for the harness
to decode arguments and encode return values; the grader decodes them back with :func:`decode`,
which builds plain built-in values only (never an object the candidate constructed, never
pickle). The encoding, with JSON ``null``, ``true``/``false`` and strings for None, bool and str::

    int        ["i", "<decimal>"]        (exact, any size up to Python's digit limit)
    float      ["f", "<repr>"]           (round-trips exactly; "nan", "inf", "-inf" included)
    list       ["l", item, ...]          tuple ["t", item, ...]
    set        ["S", item, ...]          frozenset ["F", item, ...]
    dict       ["d", [key, value], ...]

Subclasses of these types (``Counter``, a named tuple, an ``IntEnum``) travel as their base type.
Anything else cannot cross (:class:`TypedError`).
"""

from __future__ import annotations

import json
import math

__all__ = ["TypedError", "encode", "decode", "dumps", "loads", "typed_equal", "show"]

#: Deepest nesting accepted either way (a deeper value is refused, not a crash).
MAX_DEPTH = 64
_TAGS = {"l": list, "t": tuple, "S": set, "F": frozenset}


class TypedError(ValueError):
    """A value that cannot be encoded, or a payload that is not a valid encoding."""


def encode(value, depth=0):
    """The JSON-able typed encoding of ``value`` (see the module docstring)."""
    if depth > MAX_DEPTH:
        raise TypedError("the value is too deeply nested")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return ["i", int.__repr__(value)]
    if isinstance(value, float):
        return ["f", float.__repr__(value)]
    for tag, kind in (("l", list), ("t", tuple), ("F", frozenset), ("S", set)):
        if isinstance(value, kind):
            return [tag, *(encode(v, depth + 1) for v in kind.__iter__(value))]
    if isinstance(value, dict):
        return ["d", *([encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value))]
    raise TypedError(f"a {type(value).__name__} cannot be transferred (only None, bool, int, float, str, "
                     "list, tuple, set, frozenset and dict)")


def decode(data, depth=0):
    """The value of an encoding: built-in types only. Raises :class:`TypedError` when ``data`` is
    not a valid encoding (unknown tag, bad number, unhashable set element or key, too deep)."""
    if depth > MAX_DEPTH:
        raise TypedError("the value is too deeply nested")
    if data is None or data is True or data is False or type(data) is str:
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise TypedError(f"not a typed value: {type(data).__name__}")
    tag, items = data[0], data[1:]
    try:
        if tag in ("i", "f"):
            if len(items) != 1 or type(items[0]) is not str:
                raise TypedError("a number is one string")
            if tag == "i":
                return int(items[0])
            return float(items[0])
        if tag in _TAGS:
            return _TAGS[tag](decode(v, depth + 1) for v in items)
        if tag == "d":
            out = {}
            for pair in items:
                if type(pair) is not list or len(pair) != 2:
                    raise TypedError("a dict item is a [key, value] pair")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
    except TypedError:
        raise
    except (ValueError, TypeError) as exc:  # int() digit limit, bad float text, unhashable key
        raise TypedError(str(exc)) from None
    raise TypedError(f"unknown tag {tag!r}")


def dumps(value) -> str:
    """``encode`` as compact JSON text."""
    return json.dumps(encode(value), separators=(",", ":"))


def loads(text: str):
    """``decode`` of JSON text; :class:`TypedError` for anything malformed."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TypedError(f"not JSON: {exc}") from None
    return decode(data)


def typed_equal(got, expected, rel_tol=1e-9, abs_tol=1e-9) -> bool:
    """Whether a returned value ``got`` equals ``expected``, types included:

    * a float ``expected`` matches a float or int within ``rel_tol``/``abs_tol`` (NaN matches NaN);
    * an int ``expected`` matches only an int, exactly (bools are not ints);
    * list, tuple, set, frozenset and dict match only their own type: sequences element by
      element, dicts key by key (keys and set elements exactly, by type and value);
    * None, bool and str match only themselves.
    """
    kind = type(expected)
    if kind is float:
        if type(got) not in (float, int):
            return False
        if math.isnan(expected) or math.isnan(got):
            return math.isnan(expected) and math.isnan(got)
        return got == expected or math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if type(got) is not kind:
        return False
    if kind in (list, tuple):
        return len(got) == len(expected) and all(typed_equal(g, e, rel_tol, abs_tol) for g, e in zip(got, expected))
    if kind in (set, frozenset):
        return {_key(v) for v in got} == {_key(v) for v in expected}
    if kind is dict:
        keys = {_key(k): k for k in got}
        return (keys.keys() == {_key(k) for k in expected}
                and all(typed_equal(got[keys[_key(k)]], v, rel_tol, abs_tol) for k, v in expected.items()))
    return got == expected  # None, bool, int, str: same type, so Python's equality is exact


def _key(value) -> str:
    """A canonical text of a hashable value that tells types apart (1, 1.0 and True differ):
    its encoding with the elements of every set (at any depth) in sorted order."""
    return _canonical(encode(value))


def _canonical(data) -> str:
    if type(data) is not list:
        return json.dumps(data)
    items = [_canonical(v) for v in data[1:]]
    if data[0] in ("S", "F", "d"):
        items.sort()
    return "[" + ",".join([json.dumps(data[0]), *items]) + "]"


def show(value, limit=120) -> str:
    """``repr`` of a value, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
