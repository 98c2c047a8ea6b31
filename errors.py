"""User-facing errors: one line that names the offending value and the fix."""


class SpeculantError(ValueError):
    """A mistake the user can fix (bad path, wrong checkpoint, sizes that do not fit)."""
