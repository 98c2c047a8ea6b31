"""User-facing errors: one line that names the offending value and the fix."""

from typing import Any


def shown(value: Any, limit: int = 40) -> str:
    """A value as an error line names it: repr(value), its middle left out when long (a
    5000-digit number or a list of 10,000 strings stays one short line)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    head, tail = text[: limit // 2], text[-8:]
    if isinstance(value, str):
        head, tail = repr(head), repr(tail)
    return f"{head}...{tail} ({len(text)} characters)"


class SpeculantError(ValueError):
    """A mistake the user can fix (bad path, wrong checkpoint, sizes that do not fit)."""


class PromptError(SpeculantError):
    """A problem with one prompt of a generate call: `index`, its place in the call; `detail`,
    what is wrong with it ("has token id ..."). Reads "prompt INDEX DETAIL"; the CLI names the
    --prompts line instead (FILE:LINE)."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"prompt {index}{'' if detail.startswith(':') else ' '}{detail}")
        self.index, self.detail = index, detail

    def __reduce__(self):  # pickled whole (a Ray actor's error reaches its driver so)
        return type(self), (self.index, self.detail)
