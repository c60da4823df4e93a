"""The configuration reference page, generated from the schema and the router registry.

``python -m moe_dist.config.reference > docs/configuration.md`` writes it; ``tests/test_config_reference.py``
fails when the page differs from what this prints. Every key comes from
:func:`moe_dist.config.describe_schema` (the dataclasses of :mod:`moe_dist.config.schema`: the allowed
values from each field's annotation and bounds, its default and help from its
:func:`~moe_dist.checks.knob`), one table per section; every router's ``router_options`` from the registry (the names and
defaults its ``__init__`` declares, the presets a registered name fixes) and their meaning from the
router class's docstring, where each option is described as ``name: what it does``.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from typing import Any, Literal

from ..moe import ROUTERS, register_router
from ..moe.routers import router_options
from .load import describe_schema
from .schema import Config

GENERATED_BY = "python -m moe_dist.config.reference > docs/configuration.md"
_LABEL = re.compile(r"(?:(?<=^)|(?<=\n)|(?<=\. ))[ \t]*((?:\w+(?: \[[^\]\n]*\])?)(?:(?:, | / )\w+(?: \[[^\]\n]*\])?)*):\s")


def _type_name(tp: Any) -> str:
    """A compact spelling of a field's type: ``int``, ``float | null``, ``'a' | 'b'``, ``list[int]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else str(a) for a in args)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts + (["null"] if type(None) in args else []))
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _value(value: Any) -> str:
    """A default as YAML would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return "`[]`" if value == [] else "`{}`" if value == {} else f"`{value}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """One table cell: one line, ``|`` escaped, reStructuredText's double backticks as Markdown's."""
    text = re.sub(r":\w+:`", "`", " ".join(str(text).split()).replace("``", "`"))
    return text.replace("|", "\\|")


def sections(cls: type = Config) -> list[tuple[str, str]]:
    """``(key, one-line help)`` of every section, nested ones included (``model.moe``)."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.append((f.name, f.metadata.get("help", "")))
            out += [(f"{f.name}.{key}", help_) for key, help_ in sections(tp)]
    return out


# keys whose allowed values the registry holds, not the schema: said beside them
_REGISTRY_KEYS = {
    "model.moe.router": lambda: ("one of " + ", ".join(f"'{n}'" for n in sorted(ROUTERS)),
                                 " (each router's options: [below](#router-options-modelmoerouter_options))"),
    "model.moe.router_options": lambda: ("a mapping", " (per router: [below](#router-options-modelmoerouter_options))"),
}


def _section_rows(key: str) -> list[str]:
    rows = ["| key | allowed | default | meaning |", "|---|---|---|---|"]
    for name, allowed, default, help_ in describe_schema():
        if name.rsplit(".", 1)[0] == key:
            allowed, more = _REGISTRY_KEYS[name]() if name in _REGISTRY_KEYS else (allowed, "")
            rows.append(f"| `{name}` | {_cell(allowed)} | {_value(default)} | {_cell(help_)}{more} |")
    return rows


def _docstring_options(cls: type) -> dict[str, str]:
    """``option -> description`` from the docstrings of ``cls`` and its bases, where an option is
    described as ``name: text`` (or ``a, b: text``, ``a / b: text``) at a line's start or after a
    sentence; a description ends at the next such label, a blank line or a line that starts a new
    sentence at the docstring's margin (the text after the options)."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        doc = inspect.cleandoc(klass.__doc__ or "")
        labels = list(_LABEL.finditer(doc))
        for i, m in enumerate(labels):
            end = labels[i + 1].start() if i + 1 < len(labels) else len(doc)
            first, *rest = doc[m.end():end].split("\n\n")[0].split("\n")
            kept = [first]
            for line in rest:
                if line[:1].isupper():
                    break  # a sentence back at the margin: the text after the options
                kept.append(line)
            for name in re.findall(r"\w+", re.sub(r"\[[^\]]*\]", "", m.group(1))):
                found.setdefault(name, " ".join(" ".join(kept).split()))
    return found


def _mention(cls: type, name: str) -> str:
    """For an option described only in passing: the description of another option that names it
    (``init_temperature: ... clamped to [min_temperature, 1]``), else the first sentence of the
    docstrings of ``cls`` and its bases that names it (``e [embed_dim] ~ N(0, 1) trains``)."""
    named = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    for other, text in _docstring_options(cls).items():
        if named.search(text):
            return f"(named under `{other}`) {text}"
    for klass in cls.__mro__:
        text = " ".join(inspect.cleandoc(klass.__doc__ or "").split())
        for sentence in re.split(r"(?<=\.) (?=[A-Z`(])", text):
            if named.search(sentence):
                return f"(named in the router's description) {sentence}"
    return ""


def router_option_rows(name: str) -> list[dict]:
    """One row per option of router ``name``: ``option``, ``type``, ``default`` (the preset's when the
    registered name fixes it), ``meaning`` (from the docstrings; another router's when its own has none)."""
    presets = getattr(sys.modules[register_router.__module__], "ROUTER_DEFAULTS", {}).get(name, {})
    cls = ROUTERS[name]
    params = inspect.signature(cls.__init__).parameters
    hints = typing.get_type_hints(cls.__init__)
    own = _docstring_options(cls)
    others = {}
    for other in sorted(ROUTERS):
        for key, text in _docstring_options(ROUTERS[other]).items():
            others.setdefault(key, text)
    rows = []
    for opt in router_options(name):
        default = presets.get(opt, params[opt].default)
        rows.append({"option": opt, "type": _type_name(hints[opt]) if opt in hints else "any",
                     "default": None if default is inspect.Parameter.empty else default,
                     "preset": opt in presets,
                     "meaning": own.get(opt) or others.get(opt) or _mention(cls, opt)})
    return rows


def _router_section(name: str) -> list[str]:
    cls = ROUTERS[name]
    summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    head = summary if not (_LABEL.match(summary) or summary.rstrip().endswith(":")) else ""
    lines = [f"### `{name}`", ""]
    if head:
        lines += [_cell(head), ""]
    lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
    for row in router_option_rows(name):
        default = _value(row["default"]) + (f" (fixed by `{name}`)" if row["preset"] else "")
        lines.append(f"| `{row['option']}` | {row['type']} | {default} | {_cell(row['meaning']) or '(no description)'} |")
    return lines + [""]


def render() -> str:
    """The whole page, as ``docs/configuration.md`` holds it."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- generated from moe_dist/config/schema.py and the router registry by `{GENERATED_BY}`; "
        "do not edit by hand -->",
        "",
        "Every key of a run's config (`--config FILE` and `KEY=VALUE` overrides), with its type, default, "
        "bounds and meaning. Cross-field rules (which value must divide which) are checked at start-up "
        "and named in the one-line error. How to use them: [training.md](training.md).",
        "",
        "## Top-level keys",
        "",
        "| key | allowed | default | meaning |",
        "|---|---|---|---|",
    ]
    out += [f"| `{name}` | {_cell(allowed)} | {_value(default)} | {_cell(help_)} |"
            for name, allowed, default, help_ in describe_schema() if "." not in name]
    for key, help_ in sections():
        out += ["", f"## `{key}`", "", _cell(help_), ""] + _section_rows(key)
    out += ["", "## Router options (`model.moe.router_options`)", "",
            "The options each router takes under `model.moe.router_options` (its constructor's keyword "
            "arguments; an unknown option or a value of the wrong type is refused naming the allowed ones). "
            "A router registered under a second name with some options fixed says so in the default column.",
            ""]
    for name in sorted(ROUTERS):
        out += _router_section(name)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
