"""Typed configuration: nested dataclasses loaded from YAML with dotted command-line overrides.

Design choices:

- A config is a plain (nested) dataclass. Each field is declared with `option(default, doc=...)`,
  which stores its one-line docstring in the field metadata so `config_help` can print every key
  with its type, default and doc; a field without a doc is allowed but shows as such in the help.
  Checks that span fields live in the dataclass's own `__post_init__` and raise ValueError; the
  loader re-raises them as `ConfigError` prefixed with the dotted key of the section.
- Loading is strict, never dict-like: an unknown key (in the YAML or an override) is an error that
  names the full dotted key and lists the valid keys at that level; a value of the wrong type names
  the key and the expected type. Nothing is silently ignored or given a hidden default.
- Values are coerced against the annotations, recursively: `bool`, `int`, `float`, `str`, `Any`,
  `Optional[X]`, `Union`, `Literal[...]`, `list[X]`, `tuple[X, ...]`, `Sequence[X]` (loaded as a
  tuple), `dict[str, X]` and nested dataclasses (also inside lists). The coercions are the few that are never surprising:
  an int is accepted for a float, and a string that Python's `float()` parses is accepted for a
  float because YAML 1.1 (PyYAML) reads `1e-4` as a string; `bool` accepts only true/false.
- Overrides are `a.b.c=value` strings; the value is parsed as YAML (`x=[1, 2]`, `x=null`, `x=true`),
  except that a field typed exactly `str` (or `Optional[str]`, unless the value is `null`/`~`) takes
  the text verbatim, so `name=007` stays "007". Library code never reads `sys.argv`: launch
  scripts pass `sys.argv[1:]`.
- `save_config` writes the resolved config as YAML to a temporary file and renames it, so a crash
  never leaves half a config in a run directory; `load_config(type(cfg), path)` gives back `cfg`.
"""
from __future__ import annotations

import collections.abc as cabc
import copy
import dataclasses
import difflib
import os
import tempfile
import types
import typing
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

T = TypeVar("T")

_NONE_TYPE = type(None)


class ConfigError(ValueError):
    """A config that cannot be loaded: unknown key, wrong type, missing value or failed check."""


def option(default: Any = dataclasses.MISSING, *, doc: str) -> Any:
    """A dataclass field with a docstring (for `config_help`).

    A mutable default (list, dict, dataclass instance) is turned into a `default_factory` that
    deep-copies it, so configs never share state. Leave `default` out for a required key.
    """
    metadata = {"doc": doc}
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """{name: (field, resolved annotation)} of the init fields of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _unknown_key(key: str, prefix: str, valid: Sequence[str]) -> ConfigError:
    full = _join(prefix, key)
    where = f"under '{prefix}'" if prefix else "at the top level"
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{_join(prefix, close[0])}'?)" if close else ""
    return ConfigError(f"unknown config key '{full}'{hint}; valid keys {where}: {', '.join(valid)}")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _coerce(value: Any, tp: Any, key: str, shown: Any = None) -> Any:
    """`value` converted to annotation `tp`, or ConfigError naming `key` and the expected type.

    `shown` is the annotation to name in that error (the whole `Optional[X]` while checking `X`).
    """
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def bad() -> ConfigError:
        return ConfigError(f"config key '{key}' expects {_type_name(shown or tp)}, got {value!r} ({type(value).__name__})")

    if _is_union(tp):
        if value is None:
            if _NONE_TYPE in args:
                return None
            raise bad()
        members = [a for a in args if a is not _NONE_TYPE]
        if len(members) == 1:
            return _coerce(value, members[0], key, shown=tp)
        for member in members:
            try:
                return _coerce(value, member, key)
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        for choice in args:
            if value == choice and type(value) is type(choice):
                return choice
        raise ConfigError(f"config key '{key}' must be one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _from_dict(tp, value, key)
        raise bad()
    if origin in (list, tuple, cabc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise bad()
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise bad()
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)  # an abstract Sequence loads immutable
    if origin in (dict, cabc.Mapping):
        if not isinstance(value, Mapping):
            raise bad()
        key_tp, val_tp = args if args else (Any, Any)
        return {_coerce(k, key_tp, key): _coerce(v, val_tp, _join(key, str(k))) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise ConfigError(f"config key '{key}' has an unsupported annotation {_type_name(tp)}")


def _from_dict(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(str(key), prefix, list(fields))
    kwargs = {}
    for name, (f, tp) in fields.items():
        full = _join(prefix, name)
        if name in data:
            kwargs[name] = _coerce(data[name], tp, full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{full}' ({_type_name(tp)}): {f.metadata.get('doc', '')}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        where = f"'{prefix}' ({cls.__name__})" if prefix else cls.__name__
        raise ConfigError(f"invalid config {where}: {exc}") from exc


def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build dataclass `cls` from a nested mapping, with the checks described in the module doc."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
    return _from_dict(cls, data, "")


def to_dict(cfg: Any) -> Any:
    """Plain nested dicts/lists/scalars of a config (tuples become lists, so YAML can hold them)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def _accepts_verbatim_text(tp: Any) -> bool:
    """Whether an override for a field of type `tp` should take its text as is (see module doc)."""
    if tp is str:
        return True
    return _is_union(tp) and set(typing.get_args(tp)) == {str, _NONE_TYPE}


def _apply_override(cls: type, data: dict, override: str) -> None:
    """Set `a.b.c=value` into the raw nested dict `data`, checking every key against `cls`."""
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"config override {override!r} must look like key.sub=value")
    dotted, _, text = override.partition("=")
    parts = dotted.strip().split(".")
    node, node_cls, prefix = data, cls, ""
    for depth, part in enumerate(parts):
        fields = _fields(node_cls)
        if part not in fields:
            raise _unknown_key(part, prefix, list(fields))
        tp = fields[part][1]
        prefix = _join(prefix, part)
        if depth == len(parts) - 1:
            break
        sub_cls = _dataclass_of(tp)
        if sub_cls is None:
            raise ConfigError(f"config override '{dotted}': '{prefix}' is a {_type_name(tp)}, not a section with sub-keys")
        child = node.get(part)
        if child is None:
            default = _field_default(fields[part][0])
            child = to_dict(default) if default is not None else {}
            node[part] = child
        elif not isinstance(child, dict):
            raise ConfigError(f"config key '{prefix}' expects a {sub_cls.__name__} section, got {child!r}")
        node, node_cls = child, sub_cls
    if _accepts_verbatim_text(tp) and text.strip() not in ("null", "~"):
        node[parts[-1]] = text
        return
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config override '{dotted}': cannot parse value {text!r} as YAML: {exc}") from exc


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` (`X` or `Optional[X]`), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        inner = [a for a in typing.get_args(tp) if a is not _NONE_TYPE]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _field_default(f: dataclasses.Field) -> Any:
    """The default value of field `f` (calling its factory), or None when it is required."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def load_config(cls: type[T], yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Config `cls` from an optional YAML file, then dotted `overrides` (`["a.b=1", ...]`) in order.

    An override of a key inside a section that is `None` by default (an `Optional[Section]`)
    creates that section from its defaults first. Raises ConfigError (a ValueError) naming the
    file, key or override at fault.
    """
    data: dict = {}
    if yaml_path is not None:
        try:
            with open(yaml_path, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {os.fspath(yaml_path)!r}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {os.fspath(yaml_path)!r} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {os.fspath(yaml_path)!r} must hold a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    if isinstance(overrides, str):
        raise ConfigError("overrides must be a list of 'key=value' strings, not one string")
    for override in overrides:
        _apply_override(cls, data, override)
    return from_dict(cls, data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename.

    Readers (and ranks racing to write the same file) see the old file or the whole new one,
    never a partial write.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write `cfg` as YAML to `path` atomically (`atomic_write_text`)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False))


def config_help(cls: type, prefix: str = "") -> str:
    """One line per leaf key: `dotted.key (type, default ...): doc`, nested sections expanded."""
    lines = []
    for name, (f, tp) in _fields(cls).items():
        full = _join(prefix, name)
        sub = _dataclass_of(tp)
        doc = f.metadata.get("doc", "(undocumented)")
        if sub is not None:
            lines.append(f"{full}: {doc}")
            lines.append(config_help(sub, full))
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            default = "required"
        else:
            default = f"default {to_dict(_field_default(f))!r}"
        lines.append(f"{full} ({_type_name(tp)}, {default}): {doc}")
    return "\n".join(lines)
