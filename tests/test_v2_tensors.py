"""service/v2/tensors.py without a server: the checks every Open Inference Protocol input passes, the conversions to
the engine's float32, and the `label` output in raw BYTES form."""

from __future__ import annotations

import numpy as np
import pytest

from service.frontend.inputs import InputError
from service.frontend.state import ModelInfo
from service.v2 import tensors as t

MLP = ModelInfo("digits-mlp", None, (64,), 10, [str(i) for i in range(10)])
CNN = ModelInfo("digits-cnn", None, (1, 8, 8), 10, None)


def test_metadata_names_the_batch_dimension_minus_one():
    meta = t.model_metadata(CNN)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert [o["shape"] for o in meta["outputs"]] == [[-1, 10], [-1]]


@pytest.mark.parametrize("shape", [[2, 1, 8, 8], [2, 8, 8], [2, 64]])
@pytest.mark.parametrize("datatype", ["FP32", "FP16", "FP64"])
def test_every_layout_and_datatype_becomes_the_same_rows(shape, datatype):
    """Every layout gives the same (2, 1, 8, 8) rows: float32, except FP16, kept as sent (the engine's fp16 wire
    takes it with one copy)."""
    values = np.arange(128, dtype=np.float64).reshape(shape) / 8  # exact in FP16 too
    dtype, rows = t.check_input(CNN, "input", datatype, shape, 16)
    assert rows == 2
    from_raw = t.rows_from_buffer(CNN, values.astype(dtype).tobytes(), dtype, shape)
    from_json = t.rows_from_json(CNN, values.tolist(), dtype, shape)
    flat_json = t.rows_from_json(CNN, values.reshape(-1).tolist(), dtype, shape)
    for got in (from_raw, from_json, flat_json):
        assert got.dtype == (np.float16 if datatype == "FP16" else np.float32) and got.shape == (2, 1, 8, 8)
        np.testing.assert_array_equal(got.reshape(-1).astype(np.float32), values.reshape(-1).astype(np.float32))


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (("x", "FP32", [1, 64]), 400, "unknown input 'x'"),
        (("input", "BF16", [1, 64]), 400, "datatype 'BF16'"),
        (("input", "FP32", [64]), 400, "the model takes [-1, 64]"),
        (("input", "FP32", [1, 8, 8]), 400, "the model takes [-1, 64]"),
        (("input", "FP32", [1, "64"]), 400, "a shape is a list of integers"),
        (("input", "FP32", [-1, 64]), 400, "-1 rows"),
        (("input", "FP32", [17, 64]), 413, "at most 16 per request"),
    ],
)
def test_bad_declarations_name_what_is_wrong(args, status, message):
    with pytest.raises(InputError) as e:
        t.check_input(MLP, *args, 16)
    assert e.value.status == status and message in e.value.message, e.value.message


def test_bad_data_names_what_is_wrong():
    f4 = np.dtype("<f4")
    with pytest.raises(InputError, match="has 255 bytes of data; shape \\[1, 64\\] in FP32 takes 256"):
        t.rows_from_buffer(MLP, b"\0" * 255, f4, [1, 64])
    with pytest.raises(InputError, match="element 3 is NaN"):
        t.rows_from_buffer(MLP, np.array([0, 0, 0, np.nan] + [0] * 60, "<f4").tobytes(), f4, [1, 64])
    f2 = t.DTYPES["FP16"]
    for bad in (np.inf, -np.inf, np.nan):  # FP16 rows are checked as they are, without a cast to float32
        with pytest.raises(InputError, match="element 5 is NaN"):
            t.rows_from_buffer(MLP, np.array([1] * 5 + [bad] + [0] * 58, "<f2").tobytes(), f2, [1, 64])
    with pytest.raises(InputError, match="beyond float32"):
        t.rows_from_json(MLP, [1e300] * 64, np.dtype("<f8"), [1, 64])
    with pytest.raises(InputError, match="ragged"):
        t.rows_from_json(MLP, [[1.0] * 64, [1.0]], f4, [2, 64])


def test_label_tensor_is_length_prefixed_utf8_in_row_order():
    outputs = np.zeros((3, 10), np.float32)
    outputs[[0, 1, 2], [7, 0, 9]] = 1
    assert t.labels_tensor(MLP, outputs) == b"\1\0\0\0" + b"7" + b"\1\0\0\0" + b"0" + b"\1\0\0\0" + b"9"
    assert t.label_names(MLP, outputs) == ["7", "0", "9"]
    # Labels of different lengths (no model labels, 12 classes: "9" and "11") take the general path.
    wide = ModelInfo("m", None, (4,), 12, None)
    outputs = np.zeros((2, 12), np.float32)
    outputs[[0, 1], [11, 9]] = 1
    assert t.labels_tensor(wide, outputs) == b"\2\0\0\0" + b"11" + b"\1\0\0\0" + b"9"


def test_model_and_output_names():
    t.check_model(MLP, "digits-mlp", "")
    t.check_model(MLP, "digits-mlp", "1")
    with pytest.raises(InputError, match="unknown version '2'"):
        t.check_model(MLP, "digits-mlp", "2")
    with pytest.raises(InputError, match="unknown model 'x'") as e:
        t.check_model(MLP, "x", None)
    assert e.value.status == 404
    assert t.check_outputs([]) == ["logits", "label"] and t.check_outputs(["label"]) == ["label"]
    with pytest.raises(InputError, match="unknown output 'probs'"):
        t.check_outputs(["probs"])


def test_the_rest_routes_are_in_the_openapi_schema():
    from fastapi import FastAPI

    from service.frontend.routes import router

    app = FastAPI()
    app.include_router(router)
    paths = app.openapi()["paths"]
    assert paths["/v2/models/{name}/infer"]["post"]["summary"].startswith("inference")
    for p in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}/versions/{version}/ready"):
        assert "get" in paths[p], p


def test_the_openapi_schema_describes_the_v2_requests_and_answers():
    from fastapi import FastAPI

    from service.frontend.openapi import describe_routes
    from service.frontend.routes import router

    app = FastAPI()
    app.include_router(router)
    schema = describe_routes(app.openapi(), (64,), 4, "digits-mlp")
    paths = schema["paths"]
    for p in ("/v2/health/live", "/v2/health/ready", "/v2/models/{name}/ready"):
        assert "content" not in paths[p]["get"]["responses"]["200"], p  # the protocol's empty 200
    infer = paths["/v2/models/{name}/versions/{version}/infer"]["post"]
    assert {p["name"] for p in infer["parameters"]} == {"name", "version"}
    assert {"200", "400", "404", "413", "503", "504"} <= set(infer["responses"])
    assert set(infer["responses"]["200"]["content"]) == {"application/json", "application/octet-stream"}

    # The request schema holds exactly what the server takes: data filling the shape, in the datatype's range.
    jsonschema_rs = pytest.importorskip("jsonschema_rs")  # schemathesis's own validator
    request = infer["requestBody"]["content"]["application/json"]["schema"]
    valid = jsonschema_rs.validator_for({**request, "components": schema["components"]}).is_valid

    def doc(shape, data, datatype="FP32", **kw):
        return {"inputs": [{"name": "input", "datatype": datatype, "shape": shape, "data": data}], **kw}

    assert valid(doc([2, 64], [1.0] * 128, id="a", outputs=[{"name": "label"}]))
    assert valid(doc([2, 64], [[1.0] * 64] * 2, "FP16"))
    assert valid(doc([1, 64], [1e5] * 64, "FP64"))
    assert not valid(doc([2, 64], [1.0] * 64))  # fewer values than the shape
    assert not valid(doc([5, 64], [1.0] * 320))  # more rows than max_rows
    assert not valid(doc([1, 64], [1e5] * 64, "FP16"))  # beyond float16
    assert not valid(doc([1, 64], [1.0] * 64, "INT32"))
    assert not valid(doc([1, 64], [1.0] * 64, outputs={}))
    assert not valid(doc([1, 64], [1.0] * 64, outputs=[{"name": "probs"}]))


def test_a_value_beyond_float32_is_refused_without_a_numpy_warning():
    """1e39 in FP32 JSON is refused by name; numpy's overflow warning of the cast never reaches the server's log."""
    import warnings

    data = [1.0] * 63 + [1e39]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail here instead of the InputError
        with pytest.raises(InputError, match=r"element 63 is NaN, infinite or beyond float32"):
            t.rows_from_json(MLP, data, t.DTYPES["FP32"], [1, 64])


@pytest.mark.parametrize(
    ("body", "nan"),
    [(b'{"inputs": [NaN]}', True), (b'{"inputs": [-Infinity]}', True), (b'{"inputs": [1,}', False), (b"{", False)],
)
def test_the_json_error_mentions_nan_only_where_the_parser_stopped_at_one(body, nan):
    import orjson

    from service.v2.rest import _nan_note

    with pytest.raises(orjson.JSONDecodeError) as e:
        orjson.loads(body)
    assert ("NaN and Infinity are not JSON numbers" in _nan_note(body, e.value.pos)) == nan
