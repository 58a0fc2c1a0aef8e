"""Client-facing errors: every one becomes `{"error": code, "message": text}` at the API edge."""

from __future__ import annotations


class ApiError(Exception):
    """A request the service refuses; `code` is the contract's error code."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


class BadRequest(ApiError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(400, code, message)


class RateLimited(ApiError):
    def __init__(self, retry_after_seconds: int) -> None:
        super().__init__(
            429, "rate_limited", f"too many requests; retry after {retry_after_seconds} s",
            {"Retry-After": str(retry_after_seconds)},
        )
