"""bundle.json's objects as typed dataclasses: `Section.from_dict` checks each key's type against the annotation
and turns a missing or mistyped key into a one-line error naming its place in the file (bundle.py's sections and
config.py's ModelConfig use it)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields, is_dataclass
from types import UnionType
from typing import ClassVar, get_args, get_origin, get_type_hints

from infinigen_rt.errors import InfinigenError

BUNDLE_JSON = "bundle.json"


def _type_name(hint) -> str:
    """A field's type as its annotation reads ("list[float] | None"), for an error."""
    if get_origin(hint) is UnionType:
        return " | ".join(map(_type_name, get_args(hint)))
    if hint is type(None):
        return "None"
    return hint.__name__ if get_origin(hint) is None and isinstance(hint, type) else str(hint)


def _at(where: str) -> str:
    """A place in bundle.json, for an error: the file, or a key path in it."""
    return f"{BUNDLE_JSON} {where}" if where else BUNDLE_JSON


def _fits(value, hint) -> bool:
    """Whether a JSON value has the annotated type: an int is a float too, a bool is no number."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is UnionType:
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(v, args[1]) for v in value.values())
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _parse(hint, value, where: str):
    """`value` as the field's type: a section (or the model config) built from its object, anything else as
    read once its type is checked; a one-line error otherwise."""
    for t in get_args(hint) if get_origin(hint) is UnionType else (hint,):
        if is_dataclass(t) and isinstance(value, dict):
            return t.from_dict(value)
        if _fits(value, t):
            return value
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:36] + " ..."
    raise InfinigenError(f"{_at(where)} is {shown}, not {_type_name(hint)}; re-convert the bundle")


class Section:
    """A dataclass for an object of bundle.json. from_dict drops keys it does not know (a newer converter's),
    fills the fields that older bundles lack with their defaults, and turns a missing required key or a value
    of the wrong type into a one-line InfinigenError."""

    where: ClassVar[str]  # the object's key path in bundle.json ("" for the whole), for errors

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        hints = get_type_hints(cls)
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in d]
        if missing:
            raise InfinigenError(f"{_at(cls.where)} lacks {missing[0]!r}; re-convert the bundle")
        given = [f.name for f in fields(cls) if f.name in d]
        key = f"{cls.where}." if cls.where else ""
        return cls(**{name: _parse(hints[name], d[name], key + name) for name in given})
