"""Errors the scheduler raises at admission; the engine maps them onto HTTP 400 / 503."""

from __future__ import annotations


class AdmissionError(ValueError):
    """The request can never be served as asked (HTTP 400); `field` names the offending input."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_num_queued_reqs` requests (HTTP 503, retry later)."""
