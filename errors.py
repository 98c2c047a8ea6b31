"""User-facing errors: one line that names the offending value and the fix."""


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
