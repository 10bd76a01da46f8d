"""Typed configuration: nested dataclasses loaded from YAML with dotted command-line overrides.

Design choices:

- A config is a plain (nested) dataclass. Each field is declared with `option(default, doc=...)`,
  which stores its one-line docstring in the field metadata so `config_help` can print every key
  with its type, default and doc; a field without a doc is allowed but shows as such in the help.
  Checks that span fields live in the dataclass's own `__post_init__` and raise ValueError; the
  loader re-raises them as `ConfigError` prefixed with the dotted key of the section.
- Loading is strict, never dict-like: an unknown key (in the YAML or an override) is an error that
  names the full dotted key and lists the valid keys at that level; a value of the wrong type names
  the key and the expected type. Nothing is silently ignored or given a hidden default. A section's
  `RENAMED = {old key: what to write instead}` (a class attribute) turns an old key into an error
  that says so, so configs written before a rename fail with the new key's name.
- Every `ConfigError` of `load_config` is one line that starts with where the value came from:
  `config file 'x.yaml' line 3: ...` for a key set in the file, `override 'optim.lr=2': ...` for one
  set on the command line (`ConfigError.key` holds the dotted key). A check of a whole section names
  every source that set a key inside it; a missing required key names none (nothing set it).
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
from typing import Any, Literal, Mapping, Optional, Sequence, TypeVar, Union

import yaml

T = TypeVar("T")

_NONE_TYPE = type(None)


class ConfigError(ValueError):
    """A config that cannot be loaded: unknown key, wrong type, missing value or failed check.

    `key` is the dotted key at fault ("" for a check of the whole config, None when no key is).
    """

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key


def option(default: Any = dataclasses.MISSING, *, doc: str) -> Any:
    """A dataclass field with a docstring (for `config_help`).

    A mutable default (list, dict, dataclass instance) is turned into a `default_factory` that
    deep-copies it, so configs never share state. Leave `default` out for a required key.
    """
    metadata = {"doc": doc}
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def set_defaults(**values: Any):
    """Class decorator, applied under `@dataclasses.dataclass`: the decorated config's own defaults of fields it
    inherits, with each field's type and doc kept, so a field is declared and documented once (in the base) and a
    subclass states only its value (`@set_defaults(run_dir="runs/grpo_arith", steps=60)`)."""
    def apply(cls):
        inherited = {f.name: f for base in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in values.items():
            if name not in inherited:
                raise TypeError(f"{cls.__name__}: set_defaults({name}=...) names no inherited field")
            annotations[name] = inherited[name].type
            setattr(cls, name, option(value, doc=inherited[name].metadata.get("doc", "")))
        cls.__annotations__ = annotations
        return cls
    return apply


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


def _unknown_key(key: str, prefix: str, valid: Sequence[str], cls: Any = None) -> ConfigError:
    full = _join(prefix, key)
    renamed = getattr(cls, "RENAMED", {}).get(key)
    if renamed is not None:
        return ConfigError(f"config key '{full}' was renamed: {renamed}", key=full)
    where = f"under '{prefix}'" if prefix else "at the top level"
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{_join(prefix, close[0])}'?)" if close else ""
    return ConfigError(f"unknown config key '{full}'{hint}; valid keys {where}: {', '.join(valid)}", key=full)


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
        return ConfigError(f"config key '{key}' expects {_type_name(shown or tp)}, got {value!r} ({type(value).__name__})",
                           key=key)

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
        raise ConfigError(f"config key '{key}' must be one of {list(args)}, got {value!r}", key=key)
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
    raise ConfigError(f"config key '{key}' has an unsupported annotation {_type_name(tp)}", key=key)


def _from_dict(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(str(key), prefix, list(fields), cls)
    kwargs = {}
    for name, (f, tp) in fields.items():
        full = _join(prefix, name)
        if name in data:
            kwargs[name] = _coerce(data[name], tp, full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{full}' ({_type_name(tp)}): {f.metadata.get('doc', '')}",
                              key=full)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        where = f"'{prefix}' ({cls.__name__})" if prefix else cls.__name__
        raise ConfigError(f"invalid config {where}: {exc}", key=prefix) from exc


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


def _apply_override(cls: type, data: dict, override: str) -> str:
    """Set `a.b.c=value` into the raw nested dict `data`, checking every key against `cls`; return "a.b.c".

    Its errors leave out the override itself: `load_config` puts it in front.
    """
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError("must look like key.sub=value")
    dotted, _, text = override.partition("=")
    dotted = dotted.strip()
    parts = dotted.split(".")
    node, node_cls, prefix = data, cls, ""
    for depth, part in enumerate(parts):
        fields = _fields(node_cls)
        if part not in fields:
            raise _unknown_key(part, prefix, list(fields), node_cls)
        tp = fields[part][1]
        prefix = _join(prefix, part)
        if depth == len(parts) - 1:
            break
        sub_cls = _dataclass_of(tp)
        if sub_cls is None:
            raise ConfigError(f"'{prefix}' is a {_type_name(tp)}, not a section with sub-keys", key=prefix)
        child = node.get(part)
        if child is None:
            default = _field_default(fields[part][0])
            child = to_dict(default) if default is not None else {}
            node[part] = child
        elif not isinstance(child, dict):
            raise ConfigError(f"config key '{prefix}' expects a {sub_cls.__name__} section, got {child!r}", key=prefix)
        node, node_cls = child, sub_cls
    if _accepts_verbatim_text(tp) and text.strip() not in ("null", "~"):
        node[parts[-1]] = text
        return dotted
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse value {text!r} as YAML: {_one_line(exc)}", key=dotted) from exc
    return dotted


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


def _one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (PyYAML's span several)."""
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())


def _yaml_key_lines(text: str) -> dict[str, int]:
    """{dotted key: 1-based line} of every mapping key in YAML `text`, sections included (not inside lists)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = _join(prefix, str(key_node.value))
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return lines


def key_is_under(key: str, prefix: str) -> bool:
    """Whether dotted `key` is `prefix` itself or lies inside it ("a.b" and "a[0]" lie inside "a", "ab" does not)."""
    return key == prefix or key.startswith((prefix + ".", prefix + "["))


def _sources(key: Optional[str], origins: dict[str, str], file_label: Optional[str]) -> list[str]:
    """Where the value at fault came from (module doc), given {dotted key set: "config file ... line n" | "override ..."}.

    The most specific entry that set `key` or a section around it, then every other source that set a
    key inside `key` (a failed check of a section may come from any of them; the file is then named
    without a line).
    """
    if key is None:
        return []
    around = [p for p in origins if key_is_under(key, p)]
    found = [origins[max(around, key=len)]] if around else []
    for path, label in origins.items():
        if key == "" or (path != key and key_is_under(path, key)):
            if not label.startswith("override "):
                label = file_label
            if label not in found and not (label == file_label and any(f.startswith(label) for f in found)):
                found.append(label)
    return found


def load_config(cls: type[T], yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Config `cls` from an optional YAML file, then dotted `overrides` (`["a.b=1", ...]`) in order.

    An override of a key inside a section that is `None` by default (an `Optional[Section]`)
    creates that section from its defaults first. Raises ConfigError (a ValueError) whose one-line
    message starts with the file (and line) or the override the bad value came from (module doc).
    """
    data: dict = {}
    origins: dict[str, str] = {}  # dotted key -> where its value was set, in the order set
    file_label = None
    if yaml_path is not None:
        file_label = f"config file {os.fspath(yaml_path)!r}"
        try:
            with open(yaml_path, encoding="utf-8") as fh:
                text = fh.read()
            loaded = yaml.safe_load(text)
            lines = _yaml_key_lines(text)
        except OSError as exc:
            raise ConfigError(f"cannot read {file_label}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file_label} is not valid YAML: {_one_line(exc)}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file_label} must hold a mapping, got {type(loaded).__name__}")
        data = loaded or {}
        origins = {path: f"{file_label} line {line}" for path, line in lines.items()}
    if isinstance(overrides, str):
        raise ConfigError("overrides must be a list of 'key=value' strings, not one string")
    for override in overrides:
        try:
            dotted = _apply_override(cls, data, override)
        except ConfigError as exc:
            raise ConfigError(f"override {override!r}: {exc}", key=exc.key) from None
        origins = {p: label for p, label in origins.items() if not key_is_under(p, dotted)}  # replaced
        origins[dotted] = f"override {override!r}"
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        where = _sources(exc.key, origins, file_label)
        raise ConfigError(f"{', '.join(where)}: {exc}" if where else str(exc), key=exc.key) from None


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


def config_yaml(cfg: Any) -> str:
    """`cfg` (a config or its plain dict) as the YAML text `save_config` writes, keys in declaration order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write `cfg` as YAML to `path` atomically (`atomic_write_text`)."""
    atomic_write_text(path, config_yaml(cfg))


def config_help(cls: type, prefix: str = "", defaults: Any = None) -> str:
    """One line per leaf key: `dotted.key (type, default ...): doc`, nested sections expanded.

    A section's keys show the defaults of the section's own default value, so
    `optim: OptimConfig = option(OptimConfig(lr=3e-3))` lists `optim.lr` with default 0.003. A section
    that is None by default is listed as such, with the defaults it is created from when a key in it
    is set. `defaults`: the instance whose values are the defaults (None: the field defaults of `cls`).
    """
    lines = []
    for name, (f, tp) in _fields(cls).items():
        full = _join(prefix, name)
        sub = _dataclass_of(tp)
        doc = f.metadata.get("doc", "(undocumented)")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        value = getattr(defaults, name) if defaults is not None else None if required else _field_default(f)
        if sub is not None:
            off = " (None by default; setting a key in it creates it from the defaults below)" if value is None else ""
            lines.append(f"{full}: {doc}{off}")
            lines.append(config_help(sub, full, value))
            continue
        default = "required" if defaults is None and required else f"default {to_dict(value)!r}"
        lines.append(f"{full} ({_type_name(tp)}, {default}): {doc}")
    return "\n".join(lines)
