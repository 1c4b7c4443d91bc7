"""Dropping a library's known-harmless log records for the span of one call, leaving its other records alone."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def without_records(logger_name: str, harmless: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """While inside, the logger ``logger_name`` drops the records ``harmless`` picks (and only those)."""

    def keep(record: logging.LogRecord) -> bool:
        return not harmless(record)

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
