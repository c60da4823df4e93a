"""One rule in one place: a refused choice and a value of the wrong type read the same wherever
they are caught."""
import pytest

from moe_dist.checks import check_choice, coerce_value
from moe_dist.errors import ConfigError


def _message(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


def _choice(key: str, value, allowed) -> str:
    return f"{key}={value!r} is not allowed; allowed: {list(allowed)}"


def test_a_choice_is_not_a_bool_that_equals_it():
    check_choice("deepspeed.zero_stage", 1, (1, 2))
    assert _message(lambda: check_choice("deepspeed.zero_stage", True, (1, 2))) == _choice("deepspeed.zero_stage", True, (1, 2))


def test_a_value_of_a_declared_type():
    from typing import Optional

    assert coerce_value(3, float, "k") == 3.0 and isinstance(coerce_value(3, float, "k"), float)
    assert coerce_value(None, Optional[int], "k") is None and coerce_value(2, int | None, "k") == 2
    assert _message(lambda: coerce_value(True, int, "k")) == "k: got True (bool); allowed: an integer"
    assert _message(lambda: coerce_value("x", bool | None, "k")) == "k: got 'x' (str); allowed: true or false or null"
