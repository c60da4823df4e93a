"""YAML configs with ``KEY=VALUE`` overrides, typed and checked against the schema.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "model.moe.layers=[1,3]"])

Override values are parsed as YAML (``null``, ``true``, ``[1, 3]``, ``{a: 1}``). Unknown keys
and bad values raise :class:`ConfigError` with the full key, what was given and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterable, Optional

import yaml

from ..checks import check_field, describe_type, describe_value
from ..safe_io import MIB, UnreadableFile, read_text, write_atomically

CONFIG_LIMIT = 16 * MIB  # a config file is a few KB
from .schema import Config, ConfigError


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Typed dataclass instance from a nested mapping (unknown keys rejected)."""
    where = prefix or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: got {describe_value(raw)}; allowed: a mapping of keys {sorted(f.name for f in dataclasses.fields(cls))}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = str(unknown[0])
        full = f"{prefix}.{key}" if prefix else key
        hint = difflib.get_close_matches(key, list(fields), n=1)
        hint_txt = f"; did you mean {(prefix + '.' if prefix else '') + hint[0]!r}" if hint else ""
        raise ConfigError(f"{full}: unknown config key{hint_txt}; allowed keys in {where}: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, raw.get(name), key)
        elif name in raw:
            kwargs[name] = check_field(raw[name], tp, key, f.metadata)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=VALUE"`` -> ``("a.b", yaml value)``."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE (e.g. train.steps=100)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key; expected KEY=VALUE with a dotted key such as train.steps")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML ({e.__class__.__name__})") from None
    return key, value


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Set each ``KEY=VALUE`` in a nested mapping (creating sections as needed)."""
    for text in overrides:
        key, value = parse_override(text)
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{key}: {'.'.join(parts[:i + 1])} is not a section (it holds {describe_value(nxt)})")
            node = nxt
        node[parts[-1]] = value
    return raw


def config_from_dict(raw: Optional[dict]) -> Config:
    cfg = _build(Config, raw or {}, "")
    cfg.check()
    _resolve_cross_section_defaults(cfg)
    return cfg


def _resolve_cross_section_defaults(cfg: Config) -> None:
    """Defaults that depend on another section: router options that follow the run's length
    (``Router.options_for_run``, e.g. a k schedule spanning train.steps)."""
    from ..moe.routers import ROUTERS

    moe = cfg.model.moe
    moe.router_options = ROUTERS[moe.router].options_for_run(moe.router_options, cfg.train.steps)


def read_yaml(path: str) -> dict:
    try:
        raw = yaml.safe_load(read_text(path, CONFIG_LIMIT))
    except UnreadableFile as e:
        raise ConfigError(f"--config: file {path!r} {e.why}") from None
    except RecursionError:
        raise ConfigError(f"--config: {path!r} nests deeper than YAML is read here") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path!r} is not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path!r} must hold a mapping of sections (run, model, parallel, data, train, eval, ckpt)")
    return raw


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Schema defaults, then the YAML file (if any), then the overrides; checked."""
    raw = read_yaml(path) if path else {}
    return config_from_dict(apply_overrides(raw, overrides))


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str) -> None:
    """Write ``path`` whole or not at all (a reader, e.g. ``moe-dist eval``, never sees half of it)."""
    write_atomically(path, dump_config(cfg))


def describe_schema(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(key, allowed, default, help)`` for every key, for ``moe-dist train --list-keys``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_schema(tp, key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        bounds = ", ".join(f"{op} {f.metadata[k]}" for k, op in (("min", ">="), ("max", "<="), ("gt", ">")) if k in f.metadata)
        rows.append((key, describe_type(tp) + (f" ({bounds})" if bounds else ""), default, f.metadata.get("help", "")))
    return rows
