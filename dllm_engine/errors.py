"""The exception for bad input, apart from bugs."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input: an argument, a request field, a method string, a file or checkpoint that does
    not fit. The message says what was wrong and what to do. The CLI prints it as one
    ``error:`` line (exit 2) and the server answers 400; any other exception is a bug and keeps
    its traceback (exit 1, or a logged 500). A ``ValueError`` subclass, so callers that catch
    ``ValueError`` keep working."""
