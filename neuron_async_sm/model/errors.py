"""The one error type the model package raises for an unusable model."""

from neuron_async_sm.errors import NeuronAsyncSMError


class ModelLoadError(NeuronAsyncSMError, ValueError):
    """A model name, directory or checkpoint that cannot be used.

    Messages name the path and the missing or unsupported thing (file, field, tensor,
    architecture) so a user can act on them without reading this package.
    """
