"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` -> StructuredOutputsParams.

``response_format`` is ``{"type": "text"}`` (no constraint),
``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``; the schema
is enforced whatever ``strict`` says. ``structured_outputs`` takes the fields
of vLLM's ``StructuredOutputsParams``. A request may use one of the two.
Every error names the field; whether the constraint compiles is checked here
too, so the field named is the one the client sent.
"""

from __future__ import annotations

from typing import Any

from services.common.sampling_params import CONSTRAINT_FIELDS, StructuredOutputsParams
from services.common.validation import ValidationError, validate_structured_outputs_shape
from services.frontend.structured_outputs import check_structured_outputs

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_STRUCTURED_OUTPUTS_FIELDS = (*CONSTRAINT_FIELDS, "disable_any_whitespace")


def structured_outputs_params(response_format: dict[str, Any] | None,
                              structured_outputs: dict[str, Any] | None
                              ) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; ValidationError naming the field."""
    from_format = _from_response_format(response_format)
    from_extra = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise ValidationError("structured_outputs",
                              "set response_format or structured_outputs, not both")
    return from_format if from_format is not None else from_extra


def _from_response_format(response_format: dict[str, Any] | None
                          ) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise ValidationError("response_format.type", "response_format.type must be one of "
                              f"{', '.join(_RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValidationError("response_format.json_schema.schema",
                              "response_format.json_schema.schema must be a JSON schema object")
    so = StructuredOutputsParams(json=spec["schema"])
    _check(so, "response_format.json_schema.schema")
    return so


def _from_structured_outputs(fields: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    unknown = sorted(set(fields) - set(_STRUCTURED_OUTPUTS_FIELDS))
    if unknown:
        field = f"structured_outputs.{unknown[0]}"
        raise ValidationError(field, f"{field} is not a field; structured_outputs takes "
                              f"{', '.join(_STRUCTURED_OUTPUTS_FIELDS)}")
    set_fields = {k: v for k, v in fields.items() if v is not None}
    try:
        so = StructuredOutputsParams(**set_fields)
    except TypeError as e:
        raise ValidationError("structured_outputs", f"structured_outputs: {e}") from None
    validate_structured_outputs_shape(so)
    check_structured_outputs(so)
    return so


def _check(so: StructuredOutputsParams, field: str) -> None:
    try:
        validate_structured_outputs_shape(so)
        check_structured_outputs(so)
    except ValidationError as e:
        message = str(e).replace(e.field, field, 1)
        raise ValidationError(field, message) from None
