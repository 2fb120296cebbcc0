"""The server's error answers: an OpenAI-style JSON body with its HTTP status (and Retry-After on 503)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from neuron_async_sm.serve import protocol as p

RETRY_AFTER_S = 1  # a 503 (overloaded, shutting down, engine dead) tells the client when to try again


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = (
            status,
            p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param, code=code)),
        )

    @property
    def message(self) -> str:
        return self.body.error.message

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=headers)


class GenerationEnded(Exception):
    """The engine ended the request without a result: `abort` (shutdown deadline) or `error` (engine failure)."""

    def __init__(self, reason: str, detail: str | None) -> None:
        super().__init__(detail or reason)
        self.api_error = (
            ApiError(503, "the server is shutting down; the request was aborted", "service_unavailable", code="abort")
            if reason == "abort"
            else ApiError(500, f"the engine failed: {detail}", "server_error", code="engine_error")
        )


def field_of(message: str) -> str | None:
    """Engine errors start with the field they are about ("max_tokens: ..."); the API calls the prompt `prompt`."""
    head = message.split(":", 1)[0]
    # a dotted path names a nested field: "response_format.json_schema.schema: ..."
    return {"prompt_token_ids": "prompt"}.get(head, head) if head.replace(".", "_").isidentifier() else None


def invalid(exc: Exception) -> ApiError:
    return ApiError(400, str(exc), param=field_of(str(exc)))
