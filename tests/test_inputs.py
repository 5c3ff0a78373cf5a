"""service.frontend.inputs.parse_rows for image models: rows as [1][8][8], [8][8] or 64 flat values, mixed in one
request, each refusal naming the row and the value where it is (the e2e tests send the same over HTTP)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from service.frontend.inputs import InputError, parse_rows, row_layouts

IMAGE = (1, 8, 8)
PIXELS = np.arange(64, dtype=np.float32).reshape(8, 8) % 17


def parse(inputs, shape=IMAGE, max_rows=16) -> np.ndarray:
    return parse_rows(orjson.dumps({"inputs": inputs}), shape, max_rows)


def refused(inputs, shape=IMAGE) -> str:
    with pytest.raises(InputError) as info:
        parse(inputs, shape)
    assert info.value.status == 422, info.value.message
    return info.value.message


@pytest.mark.parametrize(
    "shape,layouts",
    [
        ((64,), [(64,)]),
        ((1, 8, 8), [(1, 8, 8), (8, 8), (64,)]),
        ((1, 1, 5), [(1, 1, 5), (1, 5), (5,)]),
        ((3, 8, 8), [(3, 8, 8), (192,)]),
        ((2, 3, 5), [(2, 3, 5), (30,)]),
    ],
)
def test_row_layouts(shape, layouts):
    assert list(row_layouts(shape)) == layouts


@pytest.mark.parametrize(
    "row", [PIXELS[None].tolist(), PIXELS.tolist(), PIXELS.reshape(-1).tolist()], ids=["1x8x8", "8x8", "flat64"]
)
def test_each_layout_gives_the_image(row):
    out = parse([row, row])
    assert out.dtype == np.float32 and out.shape == (2, 1, 8, 8)
    np.testing.assert_array_equal(out[1, 0], PIXELS)


def test_layouts_mixed_in_one_request():
    rows = [PIXELS.tolist(), (PIXELS + 1).reshape(-1).tolist(), (PIXELS + 2)[None].tolist(), [[1.5] * 8] * 8]
    out = parse(rows)
    assert out.shape == (4, 1, 8, 8)
    for k in range(3):
        np.testing.assert_array_equal(out[k, 0], PIXELS + k)
    assert (out[3] == 1.5).all()


def _image_with(value, at=(3, 5)) -> list:
    img = PIXELS.tolist()
    img[at[0]][at[1]] = value
    return img


@pytest.mark.parametrize(
    "inputs,needles",
    [
        ([PIXELS.tolist(), _image_with("x")], ["inputs[1][3][5]", "'x' (a string)", "every value must be a number"]),
        ([_image_with(True)], ["inputs[0][3][5]", "boolean"]),
        ([_image_with(None, (7, 0))], ["inputs[0][7][0]", "null"]),
        ([_image_with([1, 2])], ["inputs[0][3][5]", "a list"]),
        ([PIXELS.tolist()[:7]], ["inputs[0] has 7 items; expected 8", "64 numbers or nested as [1][8][8] or [8][8]"]),
        ([[*PIXELS.tolist()[:7], [1.0] * 7]], ["inputs[0][7] has 7 values; expected 8"]),
        ([[*PIXELS.tolist()[:7], 3]], ["inputs[0][7] is 3; expected a list"]),
        ([PIXELS.reshape(-1).tolist()[:63]], ["inputs[0] has 63 values; expected 64"]),
        ([PIXELS[None].tolist(), [PIXELS.tolist(), PIXELS.tolist()]], ["inputs[1] has 2 items; expected 1"]),
        ([PIXELS[None, :, :, None].tolist()], ["inputs[0][0][0][0] is a list; every value must be a number"]),
        ([PIXELS.tolist(), "row"], ["inputs[1] is 'row' (a string); each row must be a list of 64 numbers or"]),
    ],
    ids=[
        "string", "boolean", "null", "list-value", "7-image-rows", "short-image-row", "number-for-image-row",
        "63-flat", "2-channels", "too-deep", "row-not-a-list",
    ],
)  # fmt: skip
def test_refusal_names_row_and_value(inputs, needles):
    message = refused(inputs)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_out_of_float32_range_is_named_in_the_row_layout():
    assert "inputs[1][2][6] is out of float32 range" in refused([PIXELS.tolist(), _image_with(1e39, (2, 6))])
    flat = PIXELS.reshape(-1).tolist()
    flat[20] = -1e39
    assert "inputs[0][20] is out of float32 range" in refused([flat])
    assert "inputs[0][0][4][2] is out of float32 range" in refused([[_image_with(1e39, (4, 2))]])


def test_flat_models_keep_their_messages():
    assert refused([list(range(63))], (64,)) == "inputs[0] has 63 values; the model takes 64"
    assert refused([[*range(9), [1, 2], *range(54)]], (64,)).startswith("inputs[0][9] is a list; every value")
    assert refused([list(range(64)), 3], (64,)) == "inputs[1] is 3; each row must be a list of 64 numbers"
    assert refused([PIXELS.tolist()], (64,)).startswith("inputs[0][0] is a list; every value must be a number")


# ---- a model of uint8 pixels: integers 0-255, as uint8 ----


def test_uint8_rows_in_every_layout():
    image = np.random.default_rng(1).integers(0, 256, (3, 4, 5))
    for row in (image.tolist(), image.reshape(-1).tolist(), image.astype(float).tolist()):
        got = parse_rows(orjson.dumps({"inputs": [row, row]}), (3, 4, 5), 8, "uint8")
        assert got.dtype == np.uint8 and got.shape == (2, 3, 4, 5) and (got == image).all()
    mixed = parse_rows(orjson.dumps({"inputs": [image.tolist(), image.reshape(-1).tolist()]}), (3, 4, 5), 8, "uint8")
    assert (mixed == image).all()


@pytest.mark.parametrize(
    "value,shown",
    [(256, "256"), (-1, "-1"), (2.5, "2.5"), (255.5, "255.5"), (1e300, "1e+300"), (2**70, "1.1805916207174113e+21")],
)
def test_uint8_refusal_names_the_pixel(value, shown):
    rows = [[0] * 20, [1] * 7 + [value] + [2] * 12]
    with pytest.raises(InputError) as info:
        parse_rows(orjson.dumps({"inputs": rows}) if value != 2**70 else _big(rows), (1, 4, 5), 8, "uint8")
    assert info.value.status == 422
    assert info.value.message == f"inputs[1][7] is {shown}; this model takes uint8 pixels: integers 0-255"


def _big(rows) -> bytes:
    return ("{" + f'"inputs": {rows}' + "}").encode()  # orjson writes no integer beyond 64 bits


@pytest.mark.parametrize("body,message", [(b'{"inputs": [[1, true, 3, 4]]}', "a boolean"),
                                          (b'{"inputs": [[1, NaN, 3, 4]]}', "every value must be finite")])  # fmt: skip
def test_uint8_rows_keep_the_general_refusals(body, message):
    with pytest.raises(InputError, match=message):
        parse_rows(body, (4,), 8, "uint8")
