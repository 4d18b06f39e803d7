"""User-facing errors: each one says what is wrong and how to fix it, in one line."""


class QerlError(Exception):
    """An error the CLI reports as one line and a non-zero exit code (no traceback)."""


class RecipeError(QerlError):
    """A recipe file or a --set override is invalid."""


class ArtifactError(QerlError):
    """An artifact is missing, damaged, or would overwrite something that is not ours."""


class ModelSourceError(QerlError):
    """A model cannot be found or read, or its architecture is not supported."""


class QuantizationError(QerlError):
    """A tensor cannot be quantized (non-finite values, a shape the format does not allow)."""
