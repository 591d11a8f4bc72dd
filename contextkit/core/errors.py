"""The exception tree users catch, and how each class goes over HTTP (decided here, for every server and
the SDK): its status, its OpenAI error ``type`` and a stable code (``ERRORS``).

Every message says what is wrong and how to fix it.

ContextKitError                  500
├── ConfigError                  500  a setting is invalid (the operator's to fix)
│   └── CalibrationError             a calibration profile that cannot be read or is for other weights
├── ModelError                   500
│   ├── ModelNotFoundError           unknown model name or missing directory
│   ├── CorruptModelError            the GGUF / weights file cannot be read or fails its checksum
│   └── UnsupportedModelError        an architecture or feature the built-in engine does not implement
├── InputError                   422  a request is malformed (``param`` names the field to fix)
│   ├── MalformedBodyError       400  the body is not a JSON object
│   ├── BodyTooLargeError        413  the body is over the server's limit
│   ├── UnsupportedMediaTypeError 415 the body is not sent as JSON
│   ├── EmptyInputError          422  nothing to answer
│   └── PromptTooLongError       413  prompt (+ tokens to generate) exceeds the model's context
├── AccessError                  a request that may not be served as sent
│   ├── AuthenticationError      401  no API key, or one the server does not know
│   └── PermissionDeniedError    403  a key asking for what it may not (another tenant)
├── OverloadedError              429  the server's queue is full (retry after ``retry_after_s``)
│   └── RateLimitError               a tenant sent more requests per second than its limit
├── DeadlineExceededError        504  a request ran past its deadline
├── KVCacheError                 500  a KV cache misuse (out of capacity, mismatched shapes)
│   └── CorruptEntryError            stored KV bytes that fail a check: dropped and recomputed, never served
└── UpstreamError                502  an upstream (vLLM) failed or could not be started
    ├── NoUpstreamError          503  no upstream is in rotation
    └── UpstreamTimeoutError     504  an upstream did not answer in time
"""

from __future__ import annotations

from dataclasses import dataclass


class ContextKitError(Exception):
    """Base class of every error contextkit raises on purpose."""


class ConfigError(ContextKitError, ValueError):
    """A configuration value is invalid."""


class CalibrationError(ConfigError):
    """A calibration profile that cannot be read, or was made for other weights or another dtype: never used."""


class ModelError(ContextKitError):
    """A model cannot be found, read or run."""


class ModelNotFoundError(ModelError, LookupError):
    """The named model is not known, or its directory does not exist."""


class CorruptModelError(ModelError):
    """A model file is unreadable, truncated or fails its checksum."""


class UnsupportedModelError(ModelError):
    """The model uses an architecture or feature the built-in engine does not implement."""


class InputError(ContextKitError, ValueError):
    """A request is malformed. ``param`` names the request field to fix, when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class MalformedBodyError(InputError):
    """A request body that is not a JSON object."""


class BodyTooLargeError(InputError):
    """A request body over the server's size limit."""


class UnsupportedMediaTypeError(InputError):
    """A request body sent with a Content-Type the server does not read (it reads JSON)."""


class EmptyInputError(InputError):
    """The request has nothing to work on."""


class PromptTooLongError(InputError):
    """The prompt plus the tokens to generate do not fit the model's context window."""


class AccessError(ContextKitError):
    """The caller may not be served as the request says."""


class AuthenticationError(AccessError):
    """No API key, or a key the server does not know."""


class PermissionDeniedError(AccessError):
    """The key is valid but asks for what it may not (a tenant other than its own)."""


class OverloadedError(ContextKitError):
    """The server cannot take the request now; try again after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimitError(OverloadedError):
    """A tenant's requests came faster than the server's per-tenant rate; retry after ``retry_after_s``."""


class DeadlineExceededError(ContextKitError):
    """A request ran past its deadline and was stopped."""


class KVCacheError(ContextKitError):
    """A KV cache was used beyond its capacity or with tensors of the wrong shape."""


class CorruptEntryError(KVCacheError):
    """Stored bytes that fail a check (magic, length, checksum, key). Never served; dropped and counted."""


class UpstreamError(ContextKitError):
    """An upstream server could not be started, reached, or failed; the message says what to check."""


class NoUpstreamError(UpstreamError):
    """No upstream server is healthy."""


class UpstreamTimeoutError(UpstreamError):
    """An upstream server did not answer within its deadline."""


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """How a server answers one class of the tree, and how a client knows it again.

    Attributes:
        status: the HTTP status.
        type: the OpenAI error object's ``type`` (what OpenAI clients switch on).
        code: a stable machine name for the class (snake_case), sent as ``contextkit_code`` in the error
            object so a client raises the same class; never renamed once released.
    """

    status: int
    type: str
    code: str


# The one table: each class's status, OpenAI type and code. The most specific class wins (looked up
# along the MRO); a class not listed here answers as its nearest listed parent.
ERRORS: dict[type[ContextKitError], ErrorKind] = {
    ContextKitError: ErrorKind(500, "api_error", "internal_error"),
    ConfigError: ErrorKind(500, "api_error", "config_error"),
    CalibrationError: ErrorKind(500, "api_error", "calibration_error"),
    ModelError: ErrorKind(500, "api_error", "model_error"),
    ModelNotFoundError: ErrorKind(500, "api_error", "model_not_found"),
    CorruptModelError: ErrorKind(500, "api_error", "corrupt_model"),
    UnsupportedModelError: ErrorKind(500, "api_error", "unsupported_model"),
    InputError: ErrorKind(422, "invalid_request_error", "invalid_input"),
    MalformedBodyError: ErrorKind(400, "invalid_request_error", "malformed_body"),
    BodyTooLargeError: ErrorKind(413, "invalid_request_error", "body_too_large"),
    UnsupportedMediaTypeError: ErrorKind(415, "invalid_request_error", "unsupported_media_type"),
    EmptyInputError: ErrorKind(422, "invalid_request_error", "empty_input"),
    PromptTooLongError: ErrorKind(413, "invalid_request_error", "context_length_exceeded"),  # OpenAI's code
    AccessError: ErrorKind(500, "api_error", "access_error"),
    AuthenticationError: ErrorKind(401, "authentication_error", "invalid_api_key"),  # OpenAI's code
    PermissionDeniedError: ErrorKind(403, "permission_error", "permission_denied"),
    OverloadedError: ErrorKind(429, "rate_limit_error", "overloaded"),
    RateLimitError: ErrorKind(429, "rate_limit_error", "rate_limit_exceeded"),  # OpenAI's code
    DeadlineExceededError: ErrorKind(504, "timeout", "deadline_exceeded"),
    KVCacheError: ErrorKind(500, "api_error", "kv_cache_error"),
    CorruptEntryError: ErrorKind(500, "api_error", "corrupt_entry"),
    UpstreamError: ErrorKind(502, "upstream_error", "upstream_error"),
    NoUpstreamError: ErrorKind(503, "service_unavailable", "no_upstream"),
    UpstreamTimeoutError: ErrorKind(504, "timeout", "upstream_timeout"),
}
_INTERNAL = ERRORS[ContextKitError]  # what an exception outside the tree answers as
_BY_CODE: dict[str, type[ContextKitError]] = {kind.code: cls for cls, kind in ERRORS.items()}


def error_kind(exc: BaseException) -> ErrorKind:
    """The table's row for ``exc``: its class's, or its nearest listed parent's (500 outside the tree)."""
    for cls in type(exc).__mro__:
        kind = ERRORS.get(cls)  # type: ignore[call-overload]
        if kind is not None:
            return kind
    return _INTERNAL


def http_status(exc: BaseException) -> int:
    """The HTTP status a server answers ``exc`` with: 4xx for the client's mistakes, 5xx for ours."""
    return error_kind(exc).status


def error_class(code: str | None) -> type[ContextKitError] | None:
    """The class an error object's ``contextkit_code`` names (None: no code, or one this version does not know)."""
    return _BY_CODE.get(code) if isinstance(code, str) else None
