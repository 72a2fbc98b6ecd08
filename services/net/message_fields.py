"""A message's fields: one validator for every message the services exchange (no torch here, so the
launcher's health probe uses it too).

A message class is a dataclass; read_fields() reads its fields from a decoded msgpack map, each
checked against its annotation and its rule() (bounds, and the value when the field is absent),
before anything else is done with them. A WireError names the field.
"""

from __future__ import annotations

import dataclasses


class WireError(ValueError):
    """A message (or a header being built) is malformed; the text names the field."""


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rule(**bounds) -> dict:
    """A field's rule on the wire, as its dataclass metadata (`g: int = field(metadata=rule(low=-1))`):
    low, high (ints), choices, max_len, length (strings), absent (the value when the map lacks the
    field; without it the field is required)."""
    unknown = set(bounds) - {"low", "high", "choices", "max_len", "length", "absent"}
    if unknown:
        raise TypeError(f"rule: unknown bounds {sorted(unknown)}")
    return {"wire": bounds}


# annotation -> (type, the check of its items)
FIELD_TYPES = {
    "int": (int, None),
    "bool": (bool, None),
    "str": (str, None),
    "float": (float, None),
    "list[int]": (list, is_int),
    "list[str]": (list, lambda item: isinstance(item, str)),
    "dict": (dict, lambda key: isinstance(key, str)),  # a map with string keys, its values as sent
}


def read_fields(cls, header, what: str, names=None) -> dict:
    """The fields of dataclass `cls` (those in `names`, else all) read from a decoded map, each checked
    against its annotation (one of FIELD_TYPES, or one of them "| None") and its rule(); a field the map
    lacks takes its rule's `absent` value, or is an error. A WireError names the field: "{what} field
    'g': expected int >= -1, got '1.5'"."""
    if not isinstance(header, dict):
        raise WireError(f"{what}: expected a map, got {type(header).__name__}")
    values = {}
    for f in dataclasses.fields(cls):
        if names is None or f.name in names:
            bounds = f.metadata.get("wire", {})
            if f.name in header:
                value = header[f.name]
                if not _fits(f, value):
                    raise WireError(f"{what} field {f.name!r}: expected {_describe(f)}, got {str(value)[:80]!r}")
            elif "absent" in bounds:
                value = bounds["absent"]
            else:
                raise WireError(f"{what} field {f.name!r}: expected {_describe(f)}, got nothing")
            values[f.name] = value
    return values


def _fits(f: dataclasses.Field, value) -> bool:
    kind, optional = _annotation(f)
    if value is None:
        return optional
    (want, each), bounds = FIELD_TYPES[kind], f.metadata.get("wire", {})
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
        return False
    if each is not None:
        return all(each(item) for item in value)
    low, high, choices = bounds.get("low"), bounds.get("high"), bounds.get("choices")
    max_len, length = bounds.get("max_len"), bounds.get("length")
    return (
        (low is None or value >= low)
        and (high is None or value <= high)
        and (not choices or value in choices)
        and (max_len is None or len(value) <= max_len)
        and (length is None or len(value) == length)
    )


def _annotation(f: dataclasses.Field) -> tuple[str, bool]:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = text.removesuffix(" | None")
    if kind not in FIELD_TYPES:
        raise TypeError(f"{f.name}: {text} is not a wire field type ({', '.join(FIELD_TYPES)})")
    return kind, kind != text


def _describe(f: dataclasses.Field) -> str:
    kind, optional = _annotation(f)
    b = f.metadata.get("wire", {})
    if b.get("choices"):
        text = f"one of {b['choices']}"
    elif b.get("low") is not None and b.get("high") is not None:
        text = f"{kind} in [{b['low']}, {b['high']}]"
    elif b.get("low") is not None:
        text = f"{kind} >= {b['low']}"
    elif b.get("length") is not None:
        text = f"{kind} of {b['length']} characters"
    elif b.get("max_len") is not None:
        text = f"{kind} of at most {b['max_len']} characters"
    else:
        text = kind
    return text + (" or nil" if optional else "")
