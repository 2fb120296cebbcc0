"""neuron_async_sm: async scheduling for LLM inference on AWS Neuron, with the worker as a state machine."""

from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.engine.core import EngineDeadError
from neuron_async_sm.engine.llm import LLM, PromptRequest
from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.outputs import RequestOutput
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "NeuronAsyncSMError",
    "PromptRequest",
    "RequestOutput",
    "SamplingParams",
]
