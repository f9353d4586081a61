"""Errors shared by gateway and worker. Each package translates them to HTTP or wire codes in one place."""

from __future__ import annotations


class BatchgateError(Exception):
    """Base of every error batchgate raises on purpose."""


class ValidationError(BatchgateError):
    """Caller input that cannot be accepted. `field` is a dotted path into the request body."""

    def __init__(self, field: str, message: str, code: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.code = code  # an error code more precise than the API's default (e.g. context_length_exceeded)


class CodecError(BatchgateError):
    """Bytes that are not a valid batchgate wire message."""


class SchemaVersionError(CodecError):
    """A wire message from a schema version this build does not understand."""


class ConfigError(BatchgateError):
    """Invalid settings or model configuration; raised at start-up, never at import."""
