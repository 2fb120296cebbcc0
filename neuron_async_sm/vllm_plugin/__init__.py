"""A vLLM platform plugin: vLLM's engine, schedulers, executors and `vllm serve` drive our worker.

The entry point (`vllm.platform_plugins`, name `neuron_async_sm`) is `register()`. Installing this
package next to vLLM must not take over anyone's vLLM, so the plugin is active only when the
`VLLM_PLUGINS` environment variable names it. Nothing here imports vLLM: the package is importable
without it, and only `platform.py` and `worker.py` (loaded by vLLM itself) import it.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "neuron_async_sm"
PLATFORM_CLS = "neuron_async_sm.vllm_plugin.platform.NeuronAsyncSMPlatform"
WORKER_CLS = "neuron_async_sm.vllm_plugin.worker.NeuronAsyncSMWorker"
VLLM_VERSION = "0.33.0"  # the one vLLM release this plugin is written and tested against (.ci/vllm-env)


def register() -> str | None:
    """vLLM calls this in every process it starts; a class name activates our platform, None declines.

    Read at the edge, once per process: `VLLM_PLUGINS` is vLLM's own switch (a comma list of plugin
    names). Unset means "load every installed plugin", and then we decline: a GPU user who happens
    to have this package installed keeps their platform.
    """
    names = os.environ.get("VLLM_PLUGINS")
    if names is None:
        return None
    return PLATFORM_CLS if PLUGIN_NAME in {name.strip() for name in names.split(",")} else None
