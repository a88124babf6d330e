"""A request's structured-output fields as the engine's StructuredOutputsParams: OpenAI's `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) and vLLM's
`structured_outputs` (`{"json" | "regex" | "choice" | "grammar" | "json_object": ..., "disable_any_whitespace", ...}`).

Only their shape is checked here (the handler's thread); the engine compiles the grammar in the request's worker
thread (prepare.py), and a schema, regex or grammar that does not compile is a 400 naming the field too.
"""
from dataclasses import fields

from nanovllm.sampling_params import StructuredOutputsParams

STRUCTURED_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))


class StructuredOutputsError(ValueError):
    """A structured-output field of the request that cannot be used: a 400 whose `param` is `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def requested_structured_outputs(response_format: dict | None,
                                 structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """The request's constraint, or None (no field, or response_format {"type": "text"})."""
    from_format = from_response_format(response_format) if response_format is not None else None
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise StructuredOutputsError("structured_outputs", "set either response_format or structured_outputs, "
                                                           "not both")
    unknown = sorted(set(structured_outputs) - set(STRUCTURED_FIELDS))
    if unknown:
        raise StructuredOutputsError(f"structured_outputs.{unknown[0]}", f"unknown option; the options are "
                                                                        f"{', '.join(STRUCTURED_FIELDS)}")
    try:
        return StructuredOutputsParams(**structured_outputs)
    except ValueError as e:
        raise StructuredOutputsError("structured_outputs", str(e)) from None


def from_response_format(response_format: dict) -> StructuredOutputsParams | None:
    """OpenAI's response_format. strict=true closes every object schema that does not say otherwise to other keys
    (OpenAI's strict mode has no additional properties); the schema is enforced with or without it, as vLLM does."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise StructuredOutputsError("response_format.type", f"{kind!r} must be 'text', 'json_object' or "
                                                             f"'json_schema'")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise StructuredOutputsError("response_format.json_schema.schema", "a json_schema response_format needs "
                                                                           "json_schema.schema, a JSON schema object")
    strict = spec.get("strict")
    if strict not in (None, True, False):
        raise StructuredOutputsError("response_format.json_schema.strict", f"{strict!r} must be true or false")
    return StructuredOutputsParams(json=spec["schema"], disable_additional_properties=bool(strict))
