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
