"""UINT8 image tensors through the Open Inference Protocol's checks (service/v2/tensors.py), without a server: raw
bytes and JSON become the same float32 rows as FP32 would, and values a UINT8 cannot hold are refused. The real
server takes them over REST (binary) and gRPC in tests/test_service_e2e_resnet.py."""

from __future__ import annotations

import numpy as np
import pytest

from service.frontend.inputs import InputError
from service.frontend.state import ModelInfo
from service.v2 import tensors as t

CNN = ModelInfo("digits-resnet", None, (1, 8, 8), 10, None)


@pytest.mark.parametrize("shape", [[3, 1, 8, 8], [3, 8, 8], [3, 64]])
def test_uint8_pixels_become_the_float32_rows(shape):
    pixels = (np.arange(192) % 256).astype(np.uint8).reshape(shape)
    dtype, rows = t.check_input(CNN, "input", "UINT8", shape, 16)
    assert rows == 3 and dtype == np.uint8
    from_raw = t.rows_from_buffer(CNN, pixels.tobytes(), dtype, shape)
    from_json = t.rows_from_json(CNN, pixels.tolist(), dtype, shape)
    for got in (from_raw, from_json):
        assert got.dtype == np.float32 and got.shape == (3, 1, 8, 8)
        np.testing.assert_array_equal(got.reshape(-1), pixels.reshape(-1).astype(np.float32))


@pytest.mark.parametrize("bad", [256, -1, 1.5])
def test_json_values_a_uint8_cannot_hold_are_refused(bad):
    data = [0] * 63 + [bad]
    with pytest.raises(InputError, match="is UINT8: its data must be integers 0..255"):
        t.rows_from_json(CNN, data, np.dtype("u1"), [1, 64])


def test_uint8_byte_count_is_checked():
    with pytest.raises(InputError, match=r"has 63 bytes of data; shape \[1, 64\] in UINT8 takes 64"):
        t.rows_from_buffer(CNN, b"\0" * 63, np.dtype("u1"), [1, 64])


def test_unknown_datatypes_name_what_this_model_takes():
    """A float model offers the float datatypes, a uint8 model its pixels: never what the other kind takes."""
    with pytest.raises(InputError, match=r"datatype 'INT8'; this model takes FP32, FP16 or FP64$"):
        t.check_input(CNN, "input", "INT8", [1, 64], 16)
    pixels = ModelInfo("pixels", None, (1, 8, 8), 10, None, input_dtype="uint8")
    with pytest.raises(InputError, match=r"datatype 'INT8'; this model takes UINT8 pixels \(0..255\)$"):
        t.check_input(pixels, "input", "INT8", [1, 64], 16)
