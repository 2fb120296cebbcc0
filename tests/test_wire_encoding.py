"""The byte-stream encoding of the runtime's messages gives back equal messages, for every message
type, every input kind and dtype; a value marshal cannot write falls back to pickle."""

import numpy as np
import pytest
import torch

from neuron_async_sm.runtime import messages as m


def _tensor(dtype: torch.dtype, shape=(3,)) -> m.WireTensor:
    return m.WireTensor.encode(torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape).to(dtype))


MESSAGES = [
    m.RunProgram(
        7,
        "model_step",
        {"input_ids": m.FutureRef(6), "positions": _tensor(torch.int32), "seeds": _tensor(torch.int64, (2, 2))},
        (4,),
        torch.int32,
        True,
        (3, 5),
    ),
    m.RunProgram(
        8, "model_logits", {"x": _tensor(torch.bfloat16), "e": _tensor(torch.float64, (0,))}, (2, 9), torch.float32
    ),
    m.ProgramDone(7, 0.0012, None, 3, _tensor(torch.int32), 0.0001, 2),
    m.ProgramDone(8, 0.5, "program 'x' (#8) failed: ValueError: boom", 4),
    m.Fetch(1, 7),
    m.Release((1, 2)),
    m.Shutdown(),
    m.Ready(("a", "b")),
    m.StartupFailed("trace"),
    m.Fetched(1, _tensor(torch.float16), None),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda x: type(x).__name__)
def test_decode_gives_back_an_equal_message(message):
    back = m.decode(m.encode(message))
    assert type(back) is type(message)
    assert back == message
    for name, arg in getattr(back, "inputs", {}).items():  # the values too, not just equal bytes
        if isinstance(arg, m.WireTensor):
            assert torch.equal(arg.decode(), message.inputs[name].decode())


def test_the_step_messages_are_marshalled_the_rest_pickled():
    assert [m.encode(x)[:1] for x in MESSAGES[:4]] == [b"R", b"R", b"D", b"D"]
    assert all(m.encode(x)[:1] == b"P" for x in MESSAGES[4:])


@pytest.mark.parametrize(
    "odd",
    [
        m.RunProgram(1, "p", {}, (np.int64(4),), torch.int32),  # marshal would write the numpy int as bytes
        m.RunProgram(1, "p", {"x": m.WireTensor(b"\0" * 4, (np.int64(1),), torch.int32)}, (1,), torch.int32),
        m.ProgramDone(1, 0.1, None, 2, m.WireTensor(b"\0" * 4, (np.int64(1),), torch.int32)),
        m.ProgramDone(1, np.float64(0.1), None, 2),
    ],
)
def test_a_value_marshal_cannot_write_faithfully_is_pickled(odd):
    data = m.encode(odd)
    assert data[:1] == b"P" and m.decode(data) == odd
