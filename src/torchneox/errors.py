"""Errors that end a command with a one-line message instead of a traceback."""

from __future__ import annotations


class TrainingStopped(RuntimeError):
    """A run that cannot go on (a non-finite loss, say); the message says why and what is kept."""
