"""The one error type the model package raises for an unusable model."""


class ModelLoadError(ValueError):
    """A model name, directory or checkpoint that cannot be used.

    Messages name the path and the missing or unsupported thing (file, field, tensor,
    architecture) so a user can act on them without reading this package.
    """
