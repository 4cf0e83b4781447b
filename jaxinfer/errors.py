"""The project's own error types for what a user hands in (pure Python, imported by every front end).

`InvalidInput` is what every front door raises for a bad prompt, sampling setting, chat message, engine
argument or batch record: one sentence naming the field, the value and what the field accepts, raised before
any device work. It carries those three as attributes so a server can answer 400 with the field's name
without parsing the message. Wrong *types* raise `InvalidInputType`, which is also a `TypeError`, so code
that distinguishes the two Python conventions keeps working.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config field holds a value outside what the field accepts."""


class InvalidInput(ConfigError):
    """Bad user input, refused at the door. `field` names it as the user spelled it (e.g. "temperature",
    "prompt", "messages[1].role", "max_model_len"); `value` is what was given; `accepted` says what is."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None,
                 accepted: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.accepted = accepted

    @classmethod
    def of(cls, where: str, field: str, value: Any, accepted: str) -> InvalidInput:
        """The standard sentence: "<where><field> must be <accepted>, got <value>." (`where` is a prefix such
        as "SamplingParams." or "LLM(...) argument "; empty for top-level inputs)."""
        return cls(f"{where}{field} must be {accepted}, got {_short_repr(value)}.", field=field, value=value,
                   accepted=accepted)


class InvalidInputType(InvalidInput, TypeError):
    """Bad user input of the wrong type (a dict where SamplingParams belongs, None as a prompt, ...)."""


def _short_repr(value: Any, limit: int = 120) -> str:
    """repr of the offending value, cut short: a 100k-token prompt must not become a 1 MB error message."""
    text = repr(value) if not isinstance(value, type) else value.__name__
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__} of length {_len(value)})"


def _len(value: Any) -> str:
    try:
        return str(len(value))
    except TypeError:
        return "?"


class Notice(UserWarning):
    """A one-line notice about an argument accepted for vLLM compatibility that does not change results here
    (e.g. trust_remote_code, download_dir, enforce_eager), issued through `warnings`."""
