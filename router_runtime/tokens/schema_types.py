"""Tool parameter types written the database or programming-language way ("varchar(64)", "int32",
"list[str]", "bool"), rewritten to JSON Schema's types as SGLang 0.5.23 rewrites them before it renders
the tools into the prompt (so the rewritten schema is part of the prefix to match)."""

from __future__ import annotations

from typing import Any

_STANDARD = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_ALIASES = {
    **dict.fromkeys(
        ("str", "text", "varchar", "char", "enum", "uuid", "date", "datetime", "time", "timestamp",
         "binary", "blob", "bytea", "bytes", "varbinary"),
        "string",
    ),
    "bool": "boolean",
    **dict.fromkeys(("bigint", "smallint", "tinyint"), "integer"),
    **dict.fromkeys(("double", "decimal", "real", "numeric"), "number"),
    **dict.fromkeys(("arr", "tuple", "set"), "array"),
    "map": "object",
}  # fmt: skip
# A prefix names a type when it is the whole name or is followed by a digit, a bracket or a space:
# "int32" and "list[str]" are types, "internal" and "list_price" are not.
_PREFIXES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)
_AFTER_PREFIX = frozenset("0123456789[<( \t")
# Where subschemas sit: maps of them, lists of them, single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def _one(name: Any) -> Any:
    if not isinstance(name, str) or name in _STANDARD:
        return name
    base = name.split("(", 1)[0].strip().lower()
    if base in _STANDARD:
        return base
    if base in _ALIASES:
        return _ALIASES[base]
    for prefixes, target in _PREFIXES:
        for p in prefixes:
            if base == p or (base.startswith(p) and len(base) > len(p) and base[len(p)] in _AFTER_PREFIX):
                return target
    return name


def normalize_schema_types(schema: Any) -> bool:
    """Rewrite every ``type`` in a JSON Schema tree in place (unknown names are left as they are).
    False when some ``type`` is still not one of JSON Schema's: the schema is invalid (SGLang answers
    400; its other validity checks are not reproduced)."""
    if isinstance(schema, list):
        return all([normalize_schema_types(item) for item in schema])
    if not isinstance(schema, dict):
        return True
    ok = True
    t = schema.get("type")
    if isinstance(t, str):
        schema["type"] = _one(t)
        ok = schema["type"] in _STANDARD
    elif isinstance(t, list):
        seen: list[Any] = []
        for x in map(_one, t):
            if x not in seen:
                seen.append(x)
        schema["type"] = seen
        ok = all(isinstance(x, str) and x in _STANDARD for x in seen)
    subs: list[Any] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            subs += schema[key].values()
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            subs += schema[key]
    subs += [schema[key] for key in _SCHEMA_ONES if key in schema]
    return all([normalize_schema_types(sub) for sub in subs]) and ok
