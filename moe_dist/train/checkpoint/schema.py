"""The fields of a checkpoint's JSON files that the code reads, with their types.

``meta.json`` is checked against :data:`META_FIELDS` when it is read, the ``COMPLETE`` manifest
against :data:`MANIFEST_FIELDS`. A file whose checksums match but which holds a field of another
type (edited by hand, or written by another program) is then refused in one line that names the
field (its path inside the file: ``diagnostics.probe_prev``, ``counters.recent_losses[3]``) and
what is allowed, before anything is loaded, instead of failing later inside the code that uses
the value.

Fields not listed here are allowed and ignored (a caller of ``save_checkpoint`` adds its own to
meta.json). A listed field may be absent unless its object requires it; the trainer's resume
needs more of meta.json than the weights-only readers do (:data:`TRAINER_META_FIELDS`).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any, Optional, Sequence

from ...errors import CheckpointError

_SHOWN_CHARS = 60  # of a refused value's repr in the message
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_]+")


class Mismatch(Exception):
    """A value (or a missing field) that does not fit its spec; ``where`` is its path in the file."""

    def __init__(self, where: str, allowed: str, value: Any = None, missing: bool = False):
        super().__init__(where)
        self.where, self.allowed, self.value, self.missing = where, allowed, value, missing

    def describe(self) -> str:
        if self.missing:
            return f"field {self.where} is missing; allowed: {self.allowed}"
        return f"field {self.where}: got {_shown(self.value)} ({json_type(self.value)}); allowed: {self.allowed}"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _field(where: str, key: str) -> str:
    """``where.key``; a key that is not a plain name (a file name such as ``meta.json``) as ``where["key"]``."""
    if not _PLAIN_KEY.fullmatch(key):
        return f"{where}[{json.dumps(key)}]"
    return f"{where}.{key}" if where else key


# ---- specs: each knows what it allows (in words) and checks a parsed value ------------------------
class Spec:
    allowed = "anything"

    def check(self, value: Any, where: str) -> None:
        if not self.fits(value):
            raise Mismatch(where, self.allowed, value)

    def fits(self, value: Any) -> bool:
        return True


COUNT_MAX = 1 << 53  # steps, windows, sequences: a count beyond this is no count a run reaches


class Integer(Spec):
    def __init__(self, minimum: Optional[int] = None, maximum: Optional[int] = COUNT_MAX):
        self.minimum, self.maximum = minimum, maximum
        bounds = ([f">= {minimum}"] if minimum is not None else []) + ([f"<= {maximum}"] if maximum is not None else [])
        self.allowed = " and ".join([f"an integer {bounds[0]}", *bounds[1:]]) if bounds else "an integer"

    def fits(self, value: Any) -> bool:  # JSON true / false are not integers here
        return (isinstance(value, int) and not isinstance(value, bool)
                and (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum))


class Number(Spec):
    """A finite JSON number (an integer too, within a double's range)."""

    allowed = "a number"

    def fits(self, value: Any) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(float(value))
        except OverflowError:  # an integer beyond a double
            return False


class Boolean(Spec):
    allowed = "true or false"

    def fits(self, value: Any) -> bool:
        return isinstance(value, bool)


class Text(Spec):
    allowed = "a string"

    def fits(self, value: Any) -> bool:
        return isinstance(value, str)


class Nullable(Spec):
    def __init__(self, inner: Spec):
        self.inner = inner
        self.allowed = f"null or {inner.allowed}"

    def check(self, value: Any, where: str) -> None:
        if value is not None:
            try:
                self.inner.check(value, where)
            except Mismatch as e:
                if e.where == where:  # the value itself, not a field inside it: say that null is allowed too
                    e.allowed = self.allowed
                raise


class ListOf(Spec):
    def __init__(self, item: Spec, label: Optional[str] = None):
        self.item = item
        self.allowed = label or f"a list of {_plural(item)}"

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise Mismatch(where, self.allowed, value)
        for i, item in enumerate(value):
            self.item.check(item, f"{where}[{i}]")


class Row(Spec):
    """A JSON list of fixed length whose items have their own specs (``[step, values]``)."""

    def __init__(self, label: str, *items: Spec):
        self.items, self.allowed = items, label

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise Mismatch(where, self.allowed, value)
        for i, (item, spec) in enumerate(zip(value, self.items)):
            spec.check(item, f"{where}[{i}]")


class Obj(Spec):
    """A JSON object with known fields (others are ignored); ``required`` ones must be there."""

    def __init__(self, fields: dict[str, Spec], required: Sequence[str] = (), label: Optional[str] = None):
        self.fields, self.required = fields, tuple(required)
        self.allowed = label or ("an object {" + ", ".join(fields) + "}" if fields else "an object")

    def requiring(self, *names: str) -> "Obj":
        return Obj(self.fields, self.required + names, self.allowed)

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Mismatch(where, self.allowed, value)
        for name in self.required:
            if name not in value:
                raise Mismatch(_field(where, name), self.fields[name].allowed, missing=True)
        for name, spec in self.fields.items():
            if name in value:
                spec.check(value[name], _field(where, name))


class MapOf(Spec):
    """A JSON object whose keys are names (layers, files) and whose values all have one spec."""

    def __init__(self, key: str, value: Spec):
        self.value = value
        self.allowed = f"an object of {key} -> {value.allowed}"

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Mismatch(where, self.allowed, value)
        for key, item in value.items():
            self.value.check(item, _field(where, key))


class ProbeIds(Obj):
    """The probe set's expert ids of one layer, as ``RoutingDiagnostics`` encodes them: the shape and
    the ids as base64 of little-endian int32, as many as the shape holds."""

    def __init__(self):
        super().__init__({"shape": ListOf(Integer(0)), "int32_b64": Text()}, required=("shape", "int32_b64"))

    def check(self, value: Any, where: str) -> None:
        super().check(value, where)
        count = math.prod(value["shape"])
        allowed = f"base64 of {count} little-endian int32 ids (shape {value['shape']})"
        try:
            raw = base64.b64decode(value["int32_b64"].encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise Mismatch(_field(where, "int32_b64"), allowed, value["int32_b64"]) from None
        if len(raw) != 4 * count:
            raise Mismatch(_field(where, "int32_b64"), allowed, value["int32_b64"])


def _plural(spec: Spec) -> str:
    return {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(spec.allowed, spec.allowed)


# ---- meta.json -------------------------------------------------------------------------------------
# what TrainSampler.state_dict writes (its load_state_dict reads every field)
# a blend adds each source's weight, window count and windows given (data.paths)
BLEND_SOURCE = Obj({"name": Text(), "weight": Number(), "windows": Integer(1), "consumed": Integer(0)},
                   required=("weight", "windows", "consumed"))
SAMPLER = Obj({"consumed": Integer(0), "seed": Integer(None, None), "seq_len": Integer(1), "n_windows": Integer(0),
               "blend": ListOf(BLEND_SOURCE)}, required=("consumed", "seed", "seq_len", "n_windows"))
# the train.* keys of the learning-rate schedule, compared with the config on resume
SCHEDULE = Obj({"lr": Number(), "min_lr_ratio": Number(), "warmup_steps": Integer(0), "steps": Integer(0)})
# the trainer's health counters (each optional: a checkpoint written before one was added lacks it)
COUNTERS = Obj({"skipped_steps": Integer(0), "rollbacks": Integer(0), "recent_losses": ListOf(Number()),
                "recent_grad_norms": ListOf(Number()), "last_loss": Nullable(Number())})
# what RoutingDiagnostics.state_dict writes, keyed by MoE layer
DIAGNOSTICS = Obj({
    "load_history": MapOf("layer", ListOf(Row("a list [step, [load of each expert]]", Integer(0), ListOf(Number())),
                                          label="a list of [step, [load of each expert]] rows")),
    "fluct_history": MapOf("layer", ListOf(Row("a list [step, {figure: value}]", Integer(0), MapOf("figure", Number())),
                                           label="a list of [step, {figure: value}] rows")),
    "probe_prev": Nullable(MapOf("layer", ProbeIds())),
}, required=("load_history", "fluct_history"))

META_FIELDS = Obj({
    "step": Integer(0),
    "sampler": SAMPLER,
    "world_size": Integer(1),
    "ep": Integer(1),
    "vocab_size": Nullable(Integer(1)),
    "tokenizer_sha256": Nullable(Text()),
    "lr": Number(),
    "schedule": SCHEDULE,
    "config": Nullable(Obj({"model": Nullable(Obj({}))})),  # its values: the config's own checks
    "diagnostics": Nullable(DIAGNOSTICS),
    "counters": Nullable(COUNTERS),
}, required=("step",))
# a training run continues its data order from the sampler's position
TRAINER_META_FIELDS = META_FIELDS.requiring("sampler")

# ---- the COMPLETE manifest ----------------------------------------------------------------------------
LAYOUT = Obj({"world_size": Integer(1), "ep": Integer(1), "edp": Integer(1), "dp": Integer(1), "dense": Text()})
MANIFEST_FIELDS = Obj({
    "format": Text(),
    "version": Integer(0),
    "step": Integer(0),
    "contents": ListOf(Text()),
    "layout": LAYOUT,
    "experts": MapOf("layer", Integer(1)),
    "files": MapOf("file", Obj({"bytes": Integer(0), "sha256": Text()}, required=("bytes", "sha256"))),
    "tensors": Integer(0),
    "config_sha256": Text(),
    "model_config_sha256": Text(),
    "torch": Text(),
    "created": Text(),
}, required=("format", "files"))


def mismatch(value: Any, spec: Spec) -> Optional[str]:
    """What of ``value`` (a parsed JSON file) does not fit ``spec``, in words; None if it fits."""
    try:
        spec.check(value, "")
    except Mismatch as e:
        return e.describe()
    return None


def check_meta(meta: Any, source: str, spec: Spec = META_FIELDS) -> None:
    """Refuse a meta.json (read from ``source``) that does not fit ``spec``, naming the field."""
    problem = mismatch(meta, spec)
    if problem is not None:
        raise CheckpointError(f"{source}: {problem}; nothing was loaded")
