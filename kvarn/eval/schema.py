"""A small JSON-Schema subset validator, so results files can be checked offline against the schemas shipped with
the package (kvarn/eval/schemas/, package data: an installed kvarn has them too).

Supported keywords: type (one name or a list; "number" accepts integers, "integer" rejects booleans),
required, properties, additionalProperties (bool or schema), items, minItems, enum, minimum, maximum,
$ref to "#/$defs/<name>". Anything else in a schema is ignored (titles, descriptions).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMAS = resources.files("kvarn.eval") / "schemas"

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}


def load_schema(name: str) -> dict:
    """kvarn/eval/schemas/<name>.schema.json, read as package data."""
    path = SCHEMAS / f"{name}.schema.json"
    if not path.is_file():
        raise ValueError(f"no schema {name!r} in {SCHEMAS}")
    return json.loads(path.read_text(encoding="utf-8"))


def has_schema(name: str) -> bool:
    return (SCHEMAS / f"{name}.schema.json").is_file()


def validate(value: Any, schema: dict, root: dict | None = None, path: str = "$") -> None:
    """Raise ValueError naming the first place where `value` breaks `schema`."""
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        schema = root["$defs"][ref.removeprefix("#/$defs/")]
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_TYPES[t](value) for t in names):
            raise ValueError(f"{path}: expected {' or '.join(names)}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise ValueError(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ValueError(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{path}: missing required key {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                validate(v, props[key], root, f"{path}.{key}")
            elif extra is False:
                raise ValueError(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                validate(v, extra, root, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise ValueError(f"{path}: {len(value)} items, fewer than {schema['minItems']}")
        if "items" in schema:
            for i, v in enumerate(value):
                validate(v, schema["items"], root, f"{path}[{i}]")
