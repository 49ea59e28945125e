"""The codec's errors: what a receiver says of a payload it refuses (fedgpu.core.codec and
fedgpu.core.segments raise them; callers name them codec.CodecError and so on)."""

from __future__ import annotations

from typing import ClassVar

__all__ = ["CodecError", "DigestMismatch", "PayloadTooLarge", "Truncated"]


class CodecError(ValueError):
    """A payload that is not a well-formed tensor set. `reason` names the kind of defect in
    the words the aggregator counts refusals by, so nobody classifies errors by their text."""

    reason: ClassVar[str] = "malformed"


class PayloadTooLarge(CodecError):
    """The announced payload is larger than the receiver's limit."""

    reason = "too_large"


class DigestMismatch(CodecError):
    """Every byte arrived, but they do not hash to the announced digest."""

    reason = "digest"


class Truncated(CodecError):
    """The stream ended before the announced size."""

    reason = "truncated"
