"""OpenAI-shaped errors: what the client caused, as a status and an error body.

The official client turns the body ``{"error": {"message", "type", "param", "code"}}`` into
`openai.BadRequestError`, `NotFoundError`, ... so `param` names the field at fault.
"""

from typing import Any


class APIError(Exception):
    """An error the client caused (or a full queue): status + OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
