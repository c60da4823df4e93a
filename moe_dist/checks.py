"""The two checks of a user's value that every layer words the same way.

- :func:`check_choice`: a value among allowed ones (``KEY=VALUE is not allowed; allowed: [...]``);
- :func:`coerce_value`: a value of a declared type (``KEY: got VALUE (type); allowed: a number``),
  returned in its canonical form (an integer where a number is declared is that number; YAML's
  ``1e-3``, read as a string, is a number too);
  a float must fit bfloat16 and float32 (magnitude at most :data:`LARGEST_FLOAT`);
- :func:`check_bounds`: a number within bounds (``KEY: VALUE is too small; allowed: >= MIN``);
- :func:`knob` declares a dataclass field with its help and bounds, :func:`check_field` applies
  the last two to a value of such a field.

Both raise :class:`~moe_dist.errors.ConfigError`. The config schema, the MoE layer, the routers
(their options are typed by their ``__init__`` annotations) and the launcher use them, so a bad
value reads the same wherever it is caught.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Iterable, Literal, Mapping, Union

from .errors import ConfigError

# the largest number a config float may hold: bfloat16's largest finite value (float32's, 3.4028e38,
# is a little larger), so a value such as a learning rate or an init std stays finite in either dtype
LARGEST_FLOAT = 3.3895313892515355e38


class TooLarge(ConfigError):
    """A number of the right type beyond :data:`LARGEST_FLOAT` (no other type of a union fits it better)."""


def _is_one_of(value: Any, allowed: Iterable) -> bool:
    """``value`` equals one of ``allowed``, a bool only a bool (``True == 1`` does not count)."""
    return any(a == value and isinstance(a, bool) == isinstance(value, bool) for a in allowed)


def check_choice(key: str, value: Any, allowed: Iterable) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (a sequence, or a mapping's keys)."""
    if not _is_one_of(value, allowed):
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: {list(allowed)}")


def check_bounds(key: str, value: Any, min: Any = None, max: Any = None, gt: Any = None) -> None:
    """Refuse a number below ``min``, above ``max`` (both inclusive) or not above ``gt``; None and
    non-numbers pass (their type is :func:`coerce_value`'s business)."""
    if value is None or isinstance(value, (bool, str, list, dict)):
        return
    if min is not None and value < min:
        raise ConfigError(f"{key}: {value!r} is too small; allowed: >= {min}")
    if max is not None and value > max:
        raise ConfigError(f"{key}: {value!r} is too large; allowed: <= {max}")
    if gt is not None and value <= gt:
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed: > {gt}")


def describe_value(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType  # Optional[X] or X | None


def describe_type(tp: Any) -> str:
    """What a type allows, in words (``a number or null``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(origin):
        parts = [describe_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin is list:
        plural = {int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], describe_type(args[0]))}" if args else "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}.get(tp, str(tp))


def coerce_value(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against type ``tp`` (``int``, ``float``, ``bool``, ``str``, ``dict``,
    ``list[...]``, ``Literal[...]``, ``Optional[...]`` / unions) and returned in canonical form;
    otherwise a ConfigError naming ``key``, the value and what the type allows."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(origin):
        if value is None and type(None) in args:
            return None
        for alt in (a for a in args if a is not type(None)):
            try:
                return coerce_value(value, alt, key)
            except TooLarge:
                raise
            except ConfigError:
                pass
        raise ConfigError(f"{key}: got {describe_value(value)}; allowed: {describe_type(tp)}")
    if origin is Literal:
        check_choice(key, value, args)
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: got {describe_value(value)}; allowed: {describe_type(tp)}")
        return [coerce_value(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            if abs(number) > LARGEST_FLOAT:
                raise TooLarge(f"{key}: {value!r} overflows float32/bfloat16; allowed: a number of magnitude at "
                                  f"most {LARGEST_FLOAT:.4g}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return dict(value)
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported schema type {tp!r} for {key}")
    raise ConfigError(f"{key}: got {describe_value(value)}; allowed: {describe_type(tp)}")


def knob(default: Any, help: str, **bounds: Any) -> Any:
    """A dataclass field of a config section or argument object: ``bounds`` may hold ``min``,
    ``max`` (inclusive) and ``gt`` (exclusive), checked by :func:`check_field`."""
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_field(value: Any, tp: Any, key: str, metadata: Mapping[str, Any]) -> Any:
    """``value`` of a :func:`knob` field of type ``tp``: coerced (:func:`coerce_value`), then
    within the field's bounds (:func:`check_bounds`); returns the canonical value."""
    value = coerce_value(value, tp, key)
    check_bounds(key, value, metadata.get("min"), metadata.get("max"), metadata.get("gt"))
    return value
