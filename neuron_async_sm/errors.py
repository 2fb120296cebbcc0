"""The package's error base: `except NeuronAsyncSMError` catches every error this package raises on purpose.

Each error also derives from the builtin it refines (ValueError for bad input or configuration,
RuntimeError for a failed device or engine, OSError for output files), so existing handlers keep working.

    NeuronAsyncSMError
    ├── ConfigError              (config.py)          an invalid engine configuration; names the field
    ├── InvalidRequestError      (sampling_params.py) a request the engine rejects; names the field
    ├── ModelLoadError           (model/errors.py)    a model that cannot be used; names the path
    ├── DeviceProgramError       (runtime/errors.py)  a program failed; DeviceLostError, DeviceStartupError,
    │                                                 DeviceHungError below it
    ├── EngineDeadError          (engine/core.py)     the engine failed earlier; build a new one
    └── ResultsWriteError        (results_file.py)    the CLI's output file cannot be written; names the file
"""


class NeuronAsyncSMError(Exception):
    """Base of every error neuron_async_sm raises on purpose."""
