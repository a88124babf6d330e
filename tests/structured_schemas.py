"""JSON schemas for the structured-output tests: nested objects, arrays, enums, patterns, bounds and optional fields,
built from small parts so that there are well over 100 distinct ones.

Every schema closes in a bounded number of tokens whatever the model prefers (tests/test_structured_outputs.py runs
them on a random model): strings have a maxLength or a pattern of bounded length, arrays a maxItems, integers a
range, objects additionalProperties false. Unbounded parts (a free number's digits, a string without a bound, an
object open to any key) would let a random model write until max_tokens, and the output would not validate.
"""
import itertools

LEAVES = [
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 6},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]{3}$"},
    {"type": "string", "pattern": "^[A-F0-9]{2}-[0-9]{2}$"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, 2, 3, "many"]},
    {"const": "fixed"},
    {"type": "string", "enum": ["yes", "no"]},
]


def array_of(items: dict, max_items: int = 3, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def object_of(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def flat_objects() -> list[dict]:
    """Pairs of leaves as two fields: both required, the second optional, or both optional (48 x ... trimmed)."""
    schemas = []
    for (i, a), (j, b) in itertools.combinations(enumerate(LEAVES), 2):
        required = [["a", "b"], ["a"], []][(i + j) % 3]
        schemas.append(object_of({"a": a, "b": b}, required))
    return schemas[:40]


def nested_objects() -> list[dict]:
    schemas = []
    for i, leaf in enumerate(LEAVES):
        inner = object_of({"value": leaf, "flag": {"type": "boolean"}}, ["value"] if i % 2 else ["value", "flag"])
        schemas.append(object_of({"id": {"type": "integer", "minimum": 1, "maximum": 9}, "inner": inner},
                                 ["id", "inner"]))
        schemas.append(object_of({"outer": object_of({"deep": object_of({"leaf": leaf}, ["leaf"])}, ["deep"])},
                                 ["outer"]))
    return schemas


def arrays() -> list[dict]:
    schemas = [array_of(leaf, max_items=1 + i % 3, min_items=i % 2) for i, leaf in enumerate(LEAVES)]
    schemas += [object_of({"tags": array_of(leaf, 2), "count": {"type": "integer", "minimum": 0, "maximum": 5}},
                          ["tags"]) for leaf in LEAVES]
    schemas += [array_of(object_of({"k": leaf}, ["k"]), 2, 1) for leaf in LEAVES[:8]]
    return schemas


def combinators() -> list[dict]:
    """anyOf, nullable fields, $defs references, top-level enums."""
    schemas = [object_of({"x": {"anyOf": [a, b]}}, ["x"]) for a, b in zip(LEAVES, LEAVES[3:])][:8]
    schemas += [object_of({"maybe": {"anyOf": [leaf, {"type": "null"}]}}, ["maybe"]) for leaf in LEAVES[:6]]
    point = object_of({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                       "y": {"type": "integer", "minimum": 0, "maximum": 9}}, ["x", "y"])
    schemas.append({"$defs": {"point": point}, **object_of({"start": {"$ref": "#/$defs/point"},
                                                           "end": {"$ref": "#/$defs/point"}}, ["start", "end"])})
    schemas.append({"$defs": {"point": point}, **array_of({"$ref": "#/$defs/point"}, 3, 1)})
    schemas += [{"enum": ["alpha", "beta", "gamma"]}, {"type": "boolean"}, {"type": "integer", "minimum": 10,
                                                                           "maximum": 20}]
    return schemas


def all_schemas() -> list[dict]:
    return flat_objects() + nested_objects() + arrays() + combinators()
