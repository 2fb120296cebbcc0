"""Structured output on the wire: OpenAI's `response_format` and vLLM's `structured_outputs` body field.

`response_format` `{"type": "json_object"}` constrains the output to a JSON object, `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"?}}` to the schema, `{"type": "text"}` not at
all. vLLM's `structured_outputs` takes one of `json`, `regex`, `choice`, `grammar` (Lark) or
`json_object`. Giving both is a 400; a grammar that does not compile is a 400 whose `param` names it
(`response_format.json_schema.schema`, `structured_outputs.regex`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from neuron_async_sm.sampling_params import InvalidRequestError
from neuron_async_sm.structured_output import StructuredOutputsParams, as_structured_outputs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` shadows pydantic's
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` (its StructuredOutputsParams' constraint fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # `json` shadows pydantic's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_outputs_of(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsField | None
) -> StructuredOutputsParams | None:
    """The request's constraint, or None. Raises InvalidRequestError naming the field."""
    constrained = response_format is not None and response_format.type != "text"
    if constrained and structured_outputs is not None:
        raise InvalidRequestError("response_format: give either response_format or structured_outputs, not both")
    if structured_outputs is not None:
        fields = structured_outputs.model_dump(by_alias=True, exclude_none=True)
        return as_structured_outputs(fields)
    if not constrained:
        return None
    assert response_format is not None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json=True, param="response_format")
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise InvalidRequestError("response_format.json_schema: a json_schema response format needs a schema")
    return StructuredOutputsParams(json=response_format.json_schema.schema_, param="response_format.json_schema.schema")
