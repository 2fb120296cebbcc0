"""Shared by the clients lane's tests (tests/clients, .ci/clients-lane): one local checkpoint with a
tokenizer and a chat template, one real `neuron-async-sm serve` on it for the whole session, and the
`transformers` model of the same checkpoint as the reference.

float32, as a user serves: our greedy tokens equal `transformers`' in float32 (tests/test_model_hf_parity.py).
The tools themselves run through tests/support/clients_harness.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.serve_harness import ServerProcess, write_text_model

MAX_MODEL_LEN = 128
FLAGS = ("--dtype", "float32", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A random 64-token Llama with a whitespace tokenizer (words `w3`..`w60`) and chat_template.jinja,
    which `transformers` loads too."""
    folder = tmp_path_factory.mktemp("checkpoint")
    return write_text_model(folder / "model", chat_template="jinja", model_type="llama", torch_dtype="float32")


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory) -> Iterator[ServerProcess]:
    """`neuron-async-sm serve` on the checkpoint (async scheduling, a device process); it must exit 0 on SIGTERM."""
    proc = ServerProcess(tmp_path_factory.mktemp("server"), str(checkpoint), *FLAGS)
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """The reference: `transformers`' Llama on the same checkpoint, float32."""
    import torch
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
