"""FUSEDSERVE_MODE=ab and the shadow comparison (service/engine/ab.py), without a server and then with one.

- the split: within every batch-size bucket exactly round(n * p) of n batches run unfused, so the share is the one
  asked for and both modes see the same mix of batch sizes, with any arrival pattern and any share;
- compare: max |fused - unfused| relative to the batch's largest output, NaN and infinities, argmax mismatches;
- the shadow: every Nth batch is kept, runs in the other mode only while the engine is idle, out of the forward and
  kernel metrics, and an error beyond the dtype's tolerance logs one warning naming the batch size and the error;
- an engine in ab mode (in process, stub runners) names the mode of every answer on the link;
- metrics: forward, kernel, queue wait, batch rows and requests carry the mode that ran them;
- a real server in ab mode (CPU): every answer names its mode (/predict's body and X-Fusedserve-Mode, the v2 REST
  `parameters.mode`, the gRPC `parameters["mode"]`), the modes take turns, and the shadow metrics fill.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.config import Settings
from service.engine import ab
from service.engine.ab import (
    FUSED,
    UNFUSED,
    Configs,
    LiveMode,
    Modes,
    ModeSplit,
    Shadow,
    bucket_of,
    compare,
    needed_modes,
)
from service.engine.core import Engine
from service.frontend.engine_client import EngineClient
from service.link import stream as link
from service.link import wire
from service.metrics import EngineMetrics, RequestMetrics

SHAPE = (6,)
OUT = 4


# ------------------------------------------------------------------------------------------- the split


def test_buckets_are_the_graph_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 1024)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 10]


@pytest.mark.parametrize("percent", [0, 12.5, 30, 50, 66.7, 100])
def test_every_bucket_runs_its_share_unfused_to_half_a_batch(percent):
    """Any arrival order of batch sizes: after each batch, every bucket's unfused count is round(n * p)."""
    rng = np.random.default_rng(int(percent * 10))
    split = ModeSplit(percent)
    p = percent / 100
    counts: dict[int, list[int]] = {}  # bucket -> [batches, unfused]
    sizes = np.concatenate([rng.integers(1, 1025, 3000), rng.choice([1, 64, 256], 3000)])
    rng.shuffle(sizes)
    for rows in sizes.tolist():
        mode = split.pick(rows)
        c = counts.setdefault(bucket_of(rows), [0, 0])
        c[0] += 1
        c[1] += mode == UNFUSED
        assert abs(c[1] - c[0] * p) <= 0.5 + 1e-9, (rows, c, p)
    total = sum(c[0] for c in counts.values())
    unfused = sum(c[1] for c in counts.values())
    assert abs(unfused - total * p) <= 0.5 * len(counts)  # overall: half a batch per bucket at most


def test_both_modes_see_the_same_mix_of_batch_sizes():
    """The batch-size histograms (per bucket) of the two modes at 50% differ by at most one batch per bucket, and
    their mean rows agree closely; a plain random draw would not promise either."""
    rng = np.random.default_rng(7)
    split = ModeSplit(50)
    sizes = {FUSED: [], UNFUSED: []}
    for rows in rng.geometric(0.05, 5000).clip(1, 1024).tolist():
        sizes[split.pick(rows)].append(rows)
    hist = {m: np.bincount([bucket_of(r) for r in v], minlength=11) for m, v in sizes.items()}
    assert np.abs(hist[FUSED] - hist[UNFUSED]).max() <= 1
    assert abs(np.mean(sizes[FUSED]) - np.mean(sizes[UNFUSED])) < 0.05 * np.mean(sizes[FUSED])


def test_at_half_a_bucket_alternates_and_does_not_follow_the_previous_mode():
    split = ModeSplit(50)
    assert [split.pick(1) for _ in range(6)] == [UNFUSED, FUSED] * 3
    # Interleaved sizes: each bucket keeps its own turn, whatever the batch before was.
    split = ModeSplit(50)
    got = [(rows, split.pick(rows)) for rows in (1, 64, 1, 64, 64, 1)]
    assert got == [(1, UNFUSED), (64, UNFUSED), (1, FUSED), (64, FUSED), (64, UNFUSED), (1, UNFUSED)]


def test_a_new_share_starts_afresh():
    split = ModeSplit(50)
    split.pick(1)
    split.set_percent(100)
    assert {split.pick(1) for _ in range(5)} == {UNFUSED}
    split.set_percent(0)
    assert {split.pick(n) for n in range(1, 100)} == {FUSED}


def test_needed_modes():
    assert needed_modes("fused", 0) == ("fused",) and needed_modes("unfused", 0) == ("unfused",)
    assert needed_modes("ab", 0) == needed_modes("fused", 16) == (FUSED, UNFUSED)
    assert needed_modes("unfused", 1) == (UNFUSED, FUSED)  # A, the configured one, first


def test_configurations_of_two_precisions_are_labelled_with_their_dtypes():
    """FUSEDSERVE_AB_OTHER=fused:float16 beside DTYPE=float8: both labels name their precision; of one dtype, the
    modes alone (today's labels)."""
    two = Configs("float8", ("fused", "float16"))
    assert two.pair("fused") == two.pair("ab") == ("fused:float8", "fused:float16")
    assert two.pair("unfused") == ("unfused:float8", "fused:float16")
    assert needed_modes("fused", 4, two) == ("fused:float8", "fused:float16") and needed_modes("fused", 0, two) == (
        "fused:float8",
    )
    assert two.config("fused:float16") == ("fused", "float16") and two.name("fused:float8") == "fused:float8"
    one = Configs("float16", ("unfused", "float16"))
    assert one.pair("fused") == (FUSED, UNFUSED) and one.name(UNFUSED) == "unfused:float16"
    with pytest.raises(ValueError, match="AB_OTHER .fused:float16. is the served configuration itself"):
        Configs("float16", ("fused", "float16")).pair("ab")
    assert ab.tolerance("float8", "float16") == ab.TOLERANCE_PRECISION["float8"]
    assert ab.tolerance("float16", "float16") == ab.TOLERANCE["float16"]


def test_ab_other_is_checked_with_the_settings(monkeypatch):
    from service.config import SettingsError, load_settings

    s = Settings(dtype="float8", ab_other="fused:float16")
    assert s.ab_configs("cuda") == (("fused", "float8"), ("fused", "float16"))
    assert Settings(mode="unfused").ab_configs("cpu") == (("unfused", "float32"), ("fused", "float32"))
    for bad, says in (("fused", "MODE:DTYPE"), ("fused:float7", "MODE:DTYPE"), ("fast:float16", "MODE:DTYPE"),
                      ("fused:float8", "the served configuration itself")):  # fmt: skip
        monkeypatch.setenv("FUSEDSERVE_AB_OTHER", bad)
        with pytest.raises(SettingsError, match=f"FUSEDSERVE_AB_OTHER.*{says}"):
            load_settings(dtype="float8")
        with pytest.raises(SettingsError, match=f"--ab-other.*{says}"):  # as typed on the command line
            load_settings(dtype="float8", ab_other=bad)


# ------------------------------------------------------------------------------------------- compare


def test_compare_is_relative_to_the_largest_output():
    f = np.array([[10.0, -2.0], [1.0, 3.0]], np.float32)
    u = f.copy()
    u[1, 0] += 0.01  # 0.01 off, the batch's largest |output| 10
    error, mismatches = compare(FUSED, f, u)
    assert error == pytest.approx(1e-3, rel=1e-4) and mismatches == 0
    assert compare(UNFUSED, u, f) == (error, 0)  # symmetric in which mode answered
    assert compare(FUSED, np.zeros((3, 2)), np.zeros((3, 2))) == (0.0, 0)


def test_compare_counts_rows_whose_label_differs():
    f = np.array([[1.0, 0.9], [0.0, 1.0], [5.0, 1.0]])
    u = np.array([[0.9, 1.0], [0.0, 1.0], [1.0, 5.0]])
    assert compare(FUSED, f, u)[1] == 2


def test_compare_nan_and_infinities():
    f = np.array([[np.nan, 1.0], [np.inf, 2.0]])
    assert compare(FUSED, f, f.copy()) == (0.0, 0)  # the same NaN and infinity in both modes agree
    u = f.copy()
    u[0, 0] = 1.0
    assert compare(FUSED, f, u)[0] == float("inf")


# ------------------------------------------------------------------------------------------- shadow


class StubRunner:
    """Answers each row's first OUT values times `scale` in float32; remembers what it ran, shadow or not."""

    def __init__(self, scale: float = 2.0):
        self.scale = scale
        self.wire_dtype = np.dtype(np.float32)
        self.runs: list[tuple[int, bool]] = []  # (rows, observed)

    def launch(self, parts, observe: bool = True):
        x = np.concatenate([p.reshape(p.shape[0], -1) for p in parts]).astype(np.float32)
        self.runs.append((len(x), observe))
        return x[:, :OUT] * self.scale

    def collect(self, out):
        return out


class Recorder:
    """EngineMetrics' interface, recording the shadow comparisons and the modes of everything else."""

    def __init__(self):
        self.shadows: list[tuple[float, int]] = []
        self.pairs: list[tuple[int, str, str]] = []  # (rows, a, b) of each comparison
        self.calls: list[tuple[str, tuple]] = []

    def shadow(self, error, mismatches, rows=0, a=FUSED, b=UNFUSED):
        self.shadows.append((error, mismatches))
        self.pairs.append((rows, a, b))

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a + tuple(k.values())))


def test_every_nth_batch_is_kept_and_compared_out_of_the_metrics():
    metrics = Recorder()
    shadow = Shadow(3, metrics, "float32")
    runners = {FUSED: StubRunner(2.0), UNFUSED: StubRunner(2.0)}
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    kept = []
    for _ in range(7):
        if shadow.due():
            kept.append(True)
            shadow.keep(FUSED, [x[:1], x[1:]], runners[FUSED].launch([x]))
    assert len(kept) == 2 and len(shadow.pending) == 2  # batches 3 and 6
    while shadow.pending:
        shadow.run_one(runners)
    assert metrics.shadows == [(0.0, 0), (0.0, 0)]
    assert runners[UNFUSED].runs == [(2, False), (2, False)]  # in the other mode, unobserved


def test_the_kept_rows_are_a_copy():
    """The batch's rows are views of the front ends' memory, reused once the batch is answered."""
    shadow = Shadow(1, Recorder(), "float32")
    x = np.ones((2, 6), np.float32)
    shadow.keep(UNFUSED, [x], x[:, :OUT] * 2)
    x[:] = 7
    assert (shadow.pending[0].rows == 1).all()


def test_a_full_backlog_drops_the_oldest():
    shadow = Shadow(1, Recorder(), "float32")
    for i in range(ab.MAX_PENDING + 2):
        shadow.keep(FUSED, [np.full((1, 6), i, np.float32)], np.zeros((1, OUT), np.float32))
    assert len(shadow.pending) == ab.MAX_PENDING and shadow.dropped == 2
    assert shadow.pending[0].rows[0, 0] == 2


def test_an_error_beyond_tolerance_logs_one_warning_with_the_batch_size_and_the_error(caplog, monkeypatch):
    metrics = Recorder()
    shadow = Shadow(1, metrics, "float16")
    runners = {FUSED: StubRunner(2.0), UNFUSED: StubRunner(2.5)}  # 20% apart: far beyond float16's 1e-2
    x = np.ones((5, 6), np.float32)
    with caplog.at_level(logging.WARNING, logger="service.engine.ab"):
        for _ in range(3):
            shadow.keep(FUSED, [x], runners[FUSED].launch([x]))
            shadow.run_one(runners)
    warnings = [r for r in caplog.records if r.name == "service.engine.ab"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # then at most one per WARN_EVERY_S
    msg = warnings[0].getMessage()
    assert "5 rows" in msg and "0.2" in msg and "float16" in msg, msg
    assert [e for e, _ in metrics.shadows] == pytest.approx([0.2] * 3)
    # The next warning, WARN_EVERY_S later, says how many were not logged.
    monkeypatch.setattr(ab, "WARN_EVERY_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="service.engine.ab"):
        shadow.keep(FUSED, [x], runners[FUSED].launch([x]))
        shadow.run_one(runners)
    assert "2 more batches over it" in caplog.records[-1].getMessage()


def test_rounding_differences_log_nothing(caplog):
    shadow = Shadow(1, Recorder(), "float32")
    runners = {FUSED: StubRunner(2.0), UNFUSED: StubRunner(2.0 * (1 + 1e-6))}
    x = np.ones((3, 6), np.float32)
    with caplog.at_level(logging.WARNING, logger="service.engine.ab"):
        shadow.keep(FUSED, [x], runners[FUSED].launch([x]))
        shadow.run_one(runners)
    assert not caplog.records


# ------------------------------------------------------------------------------------------- Modes


def test_a_configuration_whose_executor_is_missing_loads_it_and_switches_when_it_is_warm():
    gate = threading.Event()
    made = []

    def make(mode):
        gate.wait(5)
        made.append(mode)
        return StubRunner(3.0)

    metrics = Recorder()
    modes = Modes({FUSED: StubRunner()}, LiveMode("fused", 50, 0), metrics, Shadow(0, metrics, "float32"), make)
    modes.configure(LiveMode("ab", 50, 0))
    assert modes.mode == "fused" and set(modes.loading) == {UNFUSED}
    assert {modes.pick(1) for _ in range(4)} == {FUSED}  # serving on in the old mode meanwhile
    assert not modes.poll()
    gate.set()
    end = time.monotonic() + 5
    while not modes.poll():
        assert time.monotonic() < end
        time.sleep(0.01)
    assert made == [UNFUSED] and modes.mode == "ab" and set(modes.runners) == {FUSED, UNFUSED}
    assert [modes.pick(1) for _ in range(4)] == [UNFUSED, FUSED, UNFUSED, FUSED]
    assert ("set_mode", ("ab",)) in metrics.calls
    # Loaded executors stay: back to fused and to ab again at once, with no loading.
    modes.configure(LiveMode("fused", 50, 0))
    modes.configure(LiveMode("ab", 25, 4))
    assert not modes.loading and modes.mode == "ab" and modes.shadow.every == 4 and modes.split.share == 0.25


def test_a_load_that_fails_keeps_the_running_configuration(caplog):
    def make(mode):
        raise RuntimeError("out of memory (test)")

    failed = []
    metrics = Recorder()
    modes = Modes({UNFUSED: StubRunner()}, LiveMode("unfused", 50, 0), metrics, Shadow(0, metrics, "float32"), make)
    modes.on_failed = lambda: failed.append(1)
    modes.configure(LiveMode("fused", 50, 0))
    end = time.monotonic() + 5
    with caplog.at_level(logging.ERROR, logger="service.engine.ab"):
        while not modes.poll():
            assert time.monotonic() < end
            time.sleep(0.01)
    assert modes.mode == "unfused" and failed == [1] and modes.target is None
    assert "could not load the fused executor" in caplog.text and "out of memory (test)" in caplog.text


def test_graph_captures_become_thread_local_unless_asked_otherwise(monkeypatch):
    """With torch's default (global), a capture on the loading thread made the serving thread's stream
    synchronisation fail ("operation not permitted when stream is capturing", on an H200): the engine took it for a
    sticky error and exited."""
    import torch

    seen = []

    def init(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        seen.append(capture_error_mode)

    monkeypatch.setattr(torch.cuda.graph, "__init__", init)
    assert ab.captures_ignore_other_threads() and ab.captures_ignore_other_threads()  # twice: wrapped once
    torch.cuda.graph(object(), pool=None)
    torch.cuda.graph(object(), capture_error_mode="relaxed")
    assert seen == ["thread_local", "relaxed"]


# ------------------------------------------------------------------------------------------- metrics


def test_engine_metrics_carry_the_mode_that_ran():
    m = EngineMetrics("m", "ab", "cpu", "float32")
    m.observe_forward(1e-4, "unfused")
    m.observe_kernel("mlp_0_2", 2e-5, "fused")
    m.queue_waits([1e-3, 2e-3], "unfused")
    m.batch(3, "fused")
    m.shadow(1e-3, 2, 8, FUSED, UNFUSED)
    text = m.render().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def count(family, **labels):
        return sum(
            s.value
            for s in fams[family].samples
            if s.name.endswith("_count") and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert (
        count("fusedserve_forward_seconds", mode="unfused") == 1
        and count("fusedserve_forward_seconds", mode="fused") == 0
    )
    assert count("fusedserve_kernel_seconds", mode="fused", kernel="mlp_0_2") == 1
    assert count("fusedserve_queue_wait_seconds", mode="unfused") == 2
    assert count("fusedserve_batch_rows", mode="fused") == 1
    assert count("fusedserve_shadow_error") == 1
    assert 'fusedserve_shadow_argmax_mismatch_total{a="fused",b="unfused",engine="0",model="m"} 2.0' in text
    assert 'fusedserve_shadow_rows_total{a="fused",b="unfused",engine="0",model="m"} 8.0' in text
    assert 'fusedserve_shadow_top1_agreement_bucket{a="fused",b="unfused",engine="0",le="0.8",model="m"} 1.0' in text
    assert 'fusedserve_shadow_top1_agreement_bucket{a="fused",b="unfused",engine="0",le="0.5",model="m"} 0.0' in text
    assert 'fusedserve_model_info{device="cpu",dtype="float32",engine="0",mode="ab",model="m"} 1.0' in text
    m.set_mode("fused")
    text = m.render().decode()
    assert 'mode="ab",model="m"} 0.0' in text and 'mode="fused",model="m"} 1.0' in text


def test_request_metrics_label_the_answering_mode_and_the_configured_one_where_none_ran():
    m = RequestMetrics("m", "ab")
    m.observe_request("ok", 1e-3, mode="unfused")
    m.observe_request("invalid")
    text = m.render().decode()
    assert 'fusedserve_requests_total{mode="unfused",model="m",outcome="ok",protocol="predict"} 1.0' in text
    assert 'fusedserve_requests_total{mode="ab",model="m",outcome="invalid",protocol="predict"} 1.0' in text
    assert 'mode="ab",model="m",outcome="ok"' not in text  # no executor ran: never an answer
    assert 'fusedserve_request_seconds_count{mode="unfused",model="m",protocol="predict"} 1.0' in text
    single = RequestMetrics("m", "fused").render().decode()
    assert 'mode="unfused"' not in single and 'mode="ab"' not in single  # a fused service shows fused alone


# ------------------------------------------------------------------------------------------- an engine, in process


def test_an_engine_in_ab_mode_names_the_mode_of_every_answer_and_shadows_while_idle(tmp_path):
    path = str(tmp_path / "engine.sock")
    runners = {FUSED: StubRunner(2.0), UNFUSED: StubRunner(2.0)}
    listener = link.new_socket()
    listener.bind(path)
    listener.listen(8)
    metrics = Recorder()
    settings = Settings(mode="ab", shadow_every=2, max_batch_size=64)
    engine = Engine(runners, listener, settings, SHAPE, metrics)
    thread = threading.Thread(target=engine.serve, daemon=True)
    thread.start()
    x = np.arange(6, dtype=np.float32).reshape(1, 6)

    async def scenario():
        client = EngineClient([path], [SimpleNamespace(value=wire.READY)], OUT)
        client.start()
        end = time.monotonic() + 5
        while client._wire[0] is None:
            assert time.monotonic() < end
            await asyncio.sleep(0.005)
        answers = []
        for _ in range(6):  # one at a time: each a batch of one row, bucket 0
            answers.append(await asyncio.wait_for(client.submit(x, time.monotonic() + 5, time.monotonic())[1], 5))
        client.close()
        return answers

    try:
        answers = asyncio.run(scenario())
        end = time.monotonic() + 5
        while len(metrics.shadows) < 3:  # batches 2, 4 and 6, each compared once the engine is idle
            assert time.monotonic() < end, metrics.shadows
            time.sleep(0.01)
    finally:
        engine.stopping = True
        thread.join(10)
    assert [mode for _, mode in answers] == [UNFUSED, FUSED] * 3
    for out, _ in answers:
        np.testing.assert_array_equal(out, x[:, :OUT] * 2)
    assert metrics.shadows == [(0.0, 0)] * 3
    observed = [r for r in runners[FUSED].runs + runners[UNFUSED].runs if r[1]]
    assert len(observed) == 6 and len(runners[FUSED].runs) + len(runners[UNFUSED].runs) == 9
    assert [a for name, a in metrics.calls if name == "batch"] == [(1, UNFUSED), (1, FUSED)] * 3


def test_an_engine_takes_a_published_configuration_between_batches(tmp_path, caplog):
    from service.config import LIVE_SETTINGS
    from service.link.live import write_live

    listener = link.new_socket()
    listener.bind(str(tmp_path / "engine.sock"))
    metrics = Recorder()
    engine = Engine({FUSED: StubRunner(), UNFUSED: StubRunner()}, listener, Settings(), SHAPE, metrics)
    engine.config_generation, engine.run_dir = SimpleNamespace(value=0), tmp_path
    live = {k: getattr(Settings(), k) for k in LIVE_SETTINGS}
    write_live(tmp_path, 1, {**live, "mode": "ab", "ab_unfused_percent": 25.0, "max_delay_ms": 3.0})
    engine.config_generation.value = 1
    engine._reload()
    assert engine.config_seen == 1 and engine.modes.mode == "ab" and engine.modes.split.share == 0.25
    assert engine.queue.max_delay_s == 0.003
    (tmp_path / "live.json").write_text("{not json")  # a broken publication: logged, the configuration stays
    engine.config_generation.value = 2
    with caplog.at_level(logging.ERROR, logger="service.engine.core"):
        engine._reload()
    assert engine.config_seen == 2 and engine.modes.mode == "ab" and "could not read" in caplog.text
    listener.close()


# ------------------------------------------------------------------------------------------- a real server


def _metrics(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=10)
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _sum(fams: dict, family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in fams[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def ab_server(tmp_path_factory):
    from .server import free_port, running_server

    grpc_port = free_port()
    env = {"max_batch_size": 8, "shadow_every": 2, "kernel_timing_every": 1, "workers": 1, "grpc_port": grpc_port}
    with running_server("ab", log_dir=tmp_path_factory.mktemp("ab"), **env) as url:
        yield url, grpc_port


ROW = [float(i % 16) for i in range(64)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_answer_names_its_mode_and_the_modes_take_turns(ab_server):
    url, grpc_port = ab_server
    seen = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(4):  # one at a time: batches of one row, bucket 0, alternating
            r = client.post("/predict", json={"inputs": [ROW]})
            assert r.status_code == 200, r.text
            assert r.json()["mode"] == r.headers["x-fusedserve-mode"] in (FUSED, UNFUSED)
            seen.append(r.json()["mode"])
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ROW}]}
        r = client.post("/v2/models/digits-mlp/infer", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["parameters"]["mode"] == r.headers["x-fusedserve-mode"] in (FUSED, UNFUSED)
        seen.append(r.json()["parameters"]["mode"])
    assert seen[:4] in ([UNFUSED, FUSED] * 2, [FUSED, UNFUSED] * 2) and seen[4] == seen[2]

    # gRPC, with tritonclient's generated modules: the service's own and tritonclient's define the same `inference`
    # symbols, so only one of them may be imported in a process, and the other tests use tritonclient's.
    import grpc

    pb = pytest.importorskip("tritonclient.grpc.service_pb2", reason="tritonclient[grpc] is not installed")
    pb_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

    request = pb.ModelInferRequest(
        model_name="digits-mlp",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, 64])],
        raw_input_contents=[np.asarray([ROW], np.float32).tobytes()],
    )
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        modes = [stub.ModelInfer(request, timeout=30).parameters["mode"].string_param for _ in range(2)]
    assert sorted(modes) == [FUSED, UNFUSED]

    fams = _metrics(url)
    for protocol, n in (("predict", 4), ("v2_rest", 1), ("v2_grpc", 2)):
        by_mode = [
            _sum(fams, "fusedserve_requests", "fusedserve_requests_total", protocol=protocol, outcome="ok", mode=m)
            for m in (FUSED, UNFUSED)
        ]
        assert sum(by_mode) == n, (protocol, by_mode)
    for m in (FUSED, UNFUSED):  # each mode ran, timed its kernel and forwards, from one process on one engine
        assert _sum(fams, "fusedserve_forward_seconds", "fusedserve_forward_seconds_count", mode=m, engine="0") >= 3
        assert _sum(fams, "fusedserve_kernel_seconds", "fusedserve_kernel_seconds_count", mode=m, kernel="mlp_0_2") >= 3
    info = [s for s in fams["fusedserve_model_info"].samples if s.value == 1]
    assert [s.labels["mode"] for s in info] == ["ab"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_shadow_metrics_fill_with_a_real_server(ab_server):
    url, _ = ab_server
    before = _metrics(url)
    rows = np.random.default_rng(3).uniform(0, 16, (8, 64)).round(1).tolist()
    with httpx.Client(base_url=url, timeout=30) as client:
        for n in (1, 2, 3, 4, 5, 6, 7, 8):  # one at a time: every other batch is compared while the engine is idle
            assert client.post("/predict", json={"inputs": rows[:n]}).status_code == 200
    end = time.monotonic() + 30
    while True:
        after = _metrics(url)
        got = {
            k: _sum(after, f, s) - _sum(before, f, s)
            for k, f, s in (
                ("batches", "fusedserve_shadow_batches", "fusedserve_shadow_batches_total"),
                ("errors", "fusedserve_shadow_error", "fusedserve_shadow_error_count"),
                ("mismatches", "fusedserve_shadow_argmax_mismatch", "fusedserve_shadow_argmax_mismatch_total"),
            )
        }
        if got["batches"] >= 4 or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert got["batches"] == got["errors"] == 4, got
    assert got["mismatches"] == 0, got  # these rows have no near tie: the two modes agree to rounding
    # Every comparison within the served dtype's tolerance (float32 on the CPU, float16 on a GPU).
    tolerance = ab.TOLERANCE[httpx.get(url + "/model", timeout=10).json()["dtype"]]
    within = [
        s
        for s in after["fusedserve_shadow_error"].samples
        if s.name.endswith("_bucket") and float(s.labels["le"]) == pytest.approx(tolerance)
    ]
    assert within and within[0].value == _sum(after, "fusedserve_shadow_error", "fusedserve_shadow_error_count")
