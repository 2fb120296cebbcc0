"""One error base: a caller catches everything this package raises on purpose with one except clause."""

from __future__ import annotations

import pytest

import neuron_async_sm
from neuron_async_sm import ConfigError, EngineConfig, EngineDeadError, InvalidRequestError, NeuronAsyncSMError
from neuron_async_sm.model import ModelLoadError
from neuron_async_sm.results_file import ResultsWriteError
from neuron_async_sm.runtime import DeviceHungError, DeviceLostError, DeviceProgramError, DeviceStartupError


@pytest.mark.parametrize(
    "error, builtin",
    [
        (ConfigError, ValueError),
        (InvalidRequestError, ValueError),
        (ModelLoadError, ValueError),
        (DeviceProgramError, RuntimeError),
        (DeviceLostError, RuntimeError),
        (DeviceStartupError, RuntimeError),
        (DeviceHungError, RuntimeError),
        (EngineDeadError, RuntimeError),
        (ResultsWriteError, OSError),
    ],
)
def test_every_package_error_derives_from_the_base_and_its_builtin(error, builtin):
    assert issubclass(error, NeuronAsyncSMError) and issubclass(error, builtin)


def test_a_config_error_is_caught_by_the_base():
    with pytest.raises(NeuronAsyncSMError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_the_base_is_exported():
    assert "NeuronAsyncSMError" in neuron_async_sm.__all__
