"""The HTTP API's errors: every failure becomes an ``APIError`` that renders OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class APIError(Exception):
    """An HTTP error with OpenAI's body; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# request fields named as is in an engine's refusal (RequestError.field); any other refusal
# names the prompt (a grammar's fault is found before the engine sees it)
PARAM_FIELDS = ("logit_bias", "stop_token_ids")


def refusal(problem: ValueError, endpoint: str) -> APIError:
    """The 400 of a request the engine refused (a ValueError before its first token)."""
    field = getattr(problem, "field", None)  # a SamplingParams field (RequestError)
    if field not in PARAM_FIELDS:
        field = "prompt" if endpoint == "/v1/completions" else "messages"
    return bad_request(str(problem), field)
