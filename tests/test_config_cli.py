"""Settings (service.config) and the `fusedserve` command line (service.cli).

Every test runs in an empty temporary directory with no FUSEDSERVE_* variable set, so neither the
developer's environment nor a `.env` file in the checkout can change what it sees. No test starts a
server: uvicorn.run is replaced by a function that fails the test if it is ever reached.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import service.supervisor
from service.cli import main
from service.config import ENV_PREFIX, PACKAGE_MODEL_DIR, Settings, SettingsError, load_settings, unknown_variables
from service.model.locate import ModelNotFound

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
FIELDS = list(Settings.model_fields)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def no_server(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Supervisor._run was called: the command should have stopped before serving")

    monkeypatch.setattr(service.supervisor.Supervisor, "_run", refuse)


# ---- Settings ----


def test_defaults():
    s = load_settings()
    assert s.mode == "fused"
    assert s.device == "auto"
    assert s.model == "digits-mlp"
    assert s.model_dir == Path("model_weights")
    assert s.dtype == "auto"
    assert s.compute_dtype("cuda") == "float16" and s.compute_dtype("cpu") == "float32"
    assert s.allow_tf32 is False
    assert s.max_batch_size == 1024
    assert s.max_delay_ms == 0.0
    assert s.engine_spin_ms == 2.0
    assert s.max_rows_per_request == 1024  # defaults to max_batch_size
    assert s.max_queue_requests == 1024
    assert s.request_timeout_ms == 30_000
    assert s.kernel_timing_every == 16
    assert s.cuda_graphs is True
    assert s.tuning_cache is None
    assert s.tuning is True
    assert s.tuning_background is False
    assert s.tuning_startup_s == 60.0  # keys timed before ready for a minute at most, then while idle
    assert s.tuning_timing == "both"
    assert s.compile_threads is None  # the kernels take the engine's CPUs, at most 16 (kernels/precompile.py)
    assert s.pdl is True
    assert s.warmup is True
    assert s.host == "127.0.0.1"
    assert s.port == 8000
    assert s.grpc_port is None  # gRPC is off until a port is given
    assert s.log_level == "info"
    assert s.workers is None and s.engines is None  # resolved at start from the host's cores and GPUs
    assert s.shutdown_grace_s == 30.0
    assert s.max_connections == 2048 and s.header_timeout_s == 10.0 and s.body_timeout_s == 30.0
    assert s.ab_unfused_percent == 50.0 and s.shadow_every == 0 and s.config_file is None
    assert s.ab_other is None  # B: the other mode in DTYPE
    assert s.per_client_connect_rate is None and s.per_client_connect_burst is None  # unbounded unless set
    assert s.grpc_workers == 0  # gRPC, where on, in every HTTP front end
    assert set(FIELDS) == {
        "mode", "ab_unfused_percent", "shadow_every", "ab_other", "config_file", "device", "model", "model_dir",
        "dtype", "float8_fp16_steps", "allow_tf32", "max_batch_size", "max_delay_ms",
        "engine_spin_ms", "max_rows_per_request", "max_queue_requests", "request_timeout_ms", "image_max_pixels",
        "max_image_body_bytes", "image_decode_threads", "image_decode", "pinned_arenas", "kernel_timing_every",
        "cuda_graphs", "tuning", "tuning_background", "tuning_startup_s", "tuning_timing", "tuning_cache",
        "compile_threads", "compile_deadline_s", "pdl",
        "warmup", "workers", "engines",
        "shutdown_grace_s", "drain_delay_s", "max_connections", "max_connections_per_client",
        "per_client_connect_rate", "per_client_connect_burst", "header_timeout_s",
        "body_timeout_s",
        "host", "port", "grpc_port", "grpc_workers", "log_level", "access_log", "access_log_sample",
        "api_key", "api_keys_file", "restricted_api", "public_api", "metrics_port", "docs", "tls_cert", "tls_key",
        "tls_client_ca",
    }  # fmt: skip
    # Issue 51: no access log, a 5 s drain delay (load balancers notice before the port closes)
    assert (s.access_log, s.access_log_sample, s.drain_delay_s) == ("off", 1.0, 5.0)
    # Issue 50: JPEGs decoded on the GPU and arenas registered with CUDA where the engine can (off on a CPU engine)
    assert (s.image_decode, s.pinned_arenas) == ("auto", "auto")
    # Who may call what (docs/security.md): everything open, plain text, docs on, until configured.
    assert s.api_key is None and s.api_keys_file is None and s.restricted_api is None and s.restrictions() == {}
    assert s.metrics_port is None and s.docs is True and not s.tls and s.tls_client_ca is None


ENV_VALUES = [
    ("MODE", "unfused", "mode", "unfused"),
    ("MODE", "ab", "mode", "ab"),
    ("AB_UNFUSED_PERCENT", "12.5", "ab_unfused_percent", 12.5),
    ("SHADOW_EVERY", "16", "shadow_every", 16),
    ("DEVICE", "cpu", "device", "cpu"),
    ("DTYPE", "bfloat16", "dtype", "bfloat16"),
    ("ALLOW_TF32", "true", "allow_tf32", True),
    ("PDL", "false", "pdl", False),
    ("TUNING_TIMING", "cold", "tuning_timing", "cold"),
    ("TUNING_STARTUP_S", "90", "tuning_startup_s", 90.0),
    ("TUNING_STARTUP_S", "inf", "tuning_startup_s", float("inf")),
    ("WARMUP", "0", "warmup", False),
    ("MAX_BATCH_SIZE", "37", "max_batch_size", 37),
    ("MAX_DELAY_MS", "0.5", "max_delay_ms", 0.5),
    ("MAX_QUEUE_REQUESTS", "13", "max_queue_requests", 13),
    ("REQUEST_TIMEOUT_MS", "250", "request_timeout_ms", 250.0),
    ("KERNEL_TIMING_EVERY", "0", "kernel_timing_every", 0),
    ("HOST", "0.0.0.0", "host", "0.0.0.0"),
    ("PORT", "9137", "port", 9137),
    ("LOG_LEVEL", "debug", "log_level", "debug"),
    ("MODEL", "other-model", "model", "other-model"),
    ("MODEL_DIR", "/srv/models", "model_dir", Path("/srv/models")),
]


@pytest.mark.parametrize("var,raw,field,value", ENV_VALUES, ids=[f"{v[0]}={v[1]}" for v in ENV_VALUES])
def test_environment_is_read(monkeypatch, var, raw, field, value):
    monkeypatch.setenv(ENV_PREFIX + var, raw)
    assert getattr(load_settings(), field) == value


def test_dotenv_is_read_and_environment_wins(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text("FUSEDSERVE_MODE=unfused\nFUSEDSERVE_MAX_BATCH_SIZE=64\nFUSEDSERVE_PORT=9001\n")
    s = load_settings()
    assert (s.mode, s.max_batch_size, s.port, s.max_rows_per_request) == ("unfused", 64, 9001, 64)
    monkeypatch.setenv("FUSEDSERVE_PORT", "9002")
    assert load_settings().port == 9002


def test_explicit_override_wins(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_MODE", "unfused")
    monkeypatch.setenv("FUSEDSERVE_MAX_BATCH_SIZE", "8")
    s = load_settings(mode="fused", max_batch_size=None)  # None means "not given": the environment stays
    assert s.mode == "fused" and s.max_batch_size == 8


INVALID = [
    ("FUSEDSERVE_MODE", "fast", r"FUSEDSERVE_MODE: Input should be 'fused', 'unfused' or 'ab' \(got 'fast'\)"),
    ("FUSEDSERVE_AB_UNFUSED_PERCENT", "101", r"FUSEDSERVE_AB_UNFUSED_PERCENT: Input should be less than or equal"),
    ("FUSEDSERVE_SHADOW_EVERY", "-1", r"FUSEDSERVE_SHADOW_EVERY: Input should be greater than or equal to 0"),
    ("FUSEDSERVE_MAX_BATCH_SIZE", "0", r"FUSEDSERVE_MAX_BATCH_SIZE: Input should be greater than or equal to 1"),
    ("FUSEDSERVE_MAX_BATCH_SIZE", "65537", r"FUSEDSERVE_MAX_BATCH_SIZE: Input should be less than or equal to 65536"),
    ("FUSEDSERVE_PORT", "abc", r"FUSEDSERVE_PORT: Input should be a valid integer.*\(got 'abc'\)"),
    ("FUSEDSERVE_PORT", "70000", r"FUSEDSERVE_PORT: Input should be less than or equal to 65535"),
    ("FUSEDSERVE_MAX_DELAY_MS", "-1", r"FUSEDSERVE_MAX_DELAY_MS: Input should be greater than or equal to 0"),
    ("FUSEDSERVE_REQUEST_TIMEOUT_MS", "0", r"FUSEDSERVE_REQUEST_TIMEOUT_MS: Input should be greater than 0"),
    ("FUSEDSERVE_WARMUP", "maybe", r"FUSEDSERVE_WARMUP: Input should be a valid boolean"),
    (
        "FUSEDSERVE_DTYPE",
        "float64",
        r"FUSEDSERVE_DTYPE: Input should be 'auto', 'float32', 'float16', 'bfloat16' or 'float8'",
    ),
    ("FUSEDSERVE_KERNEL_TIMING_EVERY", "-2", r"FUSEDSERVE_KERNEL_TIMING_EVERY: Input should be greater than or equal"),
    ("FUSEDSERVE_TUNING_TIMING", "warm", r"FUSEDSERVE_TUNING_TIMING: Input should be 'both', 'cold' or 'hot'"),
    ("FUSEDSERVE_TUNING_STARTUP_S", "-5", r"FUSEDSERVE_TUNING_STARTUP_S: Input should be greater than or equal to 0"),
]


@pytest.mark.parametrize("var,raw,message", INVALID, ids=[f"{v}={r}" for v, r, _ in INVALID])
def test_invalid_value_names_the_variable(monkeypatch, var, raw, message):
    monkeypatch.setenv(var, raw)
    with pytest.raises(SettingsError, match=message):
        load_settings()


def test_config_file_is_read_in_place_of_dotenv_and_the_environment_wins(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text("FUSEDSERVE_MODE=unfused\n")
    conf = tmp_path / "ab.env"
    conf.write_text("FUSEDSERVE_MODE=ab\nFUSEDSERVE_SHADOW_EVERY=8\nFUSEDSERVE_PORT=9001\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG_FILE", str(conf))
    monkeypatch.setenv("FUSEDSERVE_PORT", "9002")
    s = load_settings()
    assert (s.mode, s.shadow_every, s.port, s.config_file) == ("ab", 8, 9002, conf)
    assert load_settings(config_file=str(tmp_path / ".env")).mode == "unfused"  # the command line's file wins


def test_a_config_file_that_is_missing_or_has_a_typo_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_CONFIG_FILE", str(tmp_path / "nope.env"))
    with pytest.raises(SettingsError, match=r"FUSEDSERVE_CONFIG_FILE: .*nope.env is not a readable file"):
        load_settings()
    (tmp_path / "typo.env").write_text("FUSEDSERVE_MDOE=ab\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG_FILE", str(tmp_path / "typo.env"))
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) FUSEDSERVE_MDOE"):
        load_settings()


def test_invalid_value_in_dotenv_names_the_variable(tmp_path):
    (tmp_path / ".env").write_text("FUSEDSERVE_DEVICE=tpu\n")
    with pytest.raises(SettingsError, match=r"FUSEDSERVE_DEVICE: Input should be 'auto', 'cuda' or 'cpu'"):
        load_settings()


def test_every_invalid_value_is_listed(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_MODE", "fast")
    monkeypatch.setenv("FUSEDSERVE_PORT", "abc")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "FUSEDSERVE_MODE" in str(info.value) and "FUSEDSERVE_PORT" in str(info.value)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("FUSEDSERVE_MAX_BATCHSIZE", " (did you mean FUSEDSERVE_MAX_BATCH_SIZE?)"),
     ("FUSEDSERVE_MDOE", " (did you mean FUSEDSERVE_MODE?)"), ("FUSEDSERVE_", "")],
)  # fmt: skip
def test_unknown_variable_is_rejected(monkeypatch, typo, meant):
    """Named with the setting it is closest to, not a list of every setting."""
    monkeypatch.setenv(typo, "8")
    with pytest.raises(SettingsError) as e:
        load_settings()
    assert str(e.value) == (
        f"unknown setting(s) {typo}{meant} (every setting: fusedserve serve --help, docs/configuration.md)"
    )
    assert unknown_variables() == [typo]
    assert unknown_variables({"FUSEDSERVE_PORT": "1", "OTHER_MAX": "2"}) == []


def test_max_rows_per_request(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_MAX_BATCH_SIZE", "40")
    assert load_settings().max_rows_per_request == 40
    assert load_settings(max_rows_per_request=40).max_rows_per_request == 40
    assert load_settings(max_rows_per_request=7).max_rows_per_request == 7
    with pytest.raises(SettingsError, match=r"--max-rows-per-request \(41\) exceeds FUSEDSERVE_MAX_BATCH_SIZE \(40\)"):
        load_settings(max_rows_per_request=41)
    monkeypatch.setenv("FUSEDSERVE_MAX_ROWS_PER_REQUEST", "0")
    with pytest.raises(SettingsError, match=r"FUSEDSERVE_MAX_ROWS_PER_REQUEST: Input should be greater than or"):
        load_settings()


def test_grpc_port_is_off_by_default_and_not_the_http_port(monkeypatch):
    assert load_settings().grpc_port is None
    monkeypatch.setenv("FUSEDSERVE_GRPC_PORT", "8001")
    assert load_settings().grpc_port == 8001
    with pytest.raises(SettingsError, match=r"FUSEDSERVE_GRPC_PORT \(8001\) must differ from --port"):
        load_settings(port=8001)
    monkeypatch.setenv("FUSEDSERVE_GRPC_PORT", "0")
    with pytest.raises(SettingsError, match=r"FUSEDSERVE_GRPC_PORT: Input should be greater than or equal to 1"):
        load_settings()


def test_model_path_resolves_a_name():
    # The cwd (tmp_path) has no model_weights/: the directory beside the package is used.
    assert Settings().model_path() == PACKAGE_MODEL_DIR / "digits-mlp"
    assert (Settings().model_path() / "config.json").is_file()


def test_model_path_uses_an_existing_model_dir(tmp_path):
    (tmp_path / "model_weights" / "mine").mkdir(parents=True)
    assert Settings(model="mine").model_path() == Path("model_weights") / "mine"
    (tmp_path / "elsewhere" / "x").mkdir(parents=True)
    assert Settings(model="x", model_dir=tmp_path / "elsewhere").model_path() == tmp_path / "elsewhere" / "x"


def test_model_path_resolves_a_path(tmp_path):
    d = tmp_path / "some" / "model"
    d.mkdir(parents=True)
    assert Settings(model=str(d)).model_path() == d
    assert Settings(model="some/model", model_dir=tmp_path / "unused").model_path() == Path("some/model")
    with pytest.raises(ModelNotFound, match=r"^\./gone: no such model directory or \.onnx file \(/"):
        Settings(model="./gone").model_path()  # as typed, then where that is; never under model_weights/


# ---- the command line ----


def _help_lists_everything(text: str) -> None:
    for name in FIELDS:
        assert re.search(rf"--{name.replace('_', '-')}\b", text), f"--{name.replace('_', '-')} missing from --help"
        assert ENV_PREFIX + name.upper() in text, f"{ENV_PREFIX + name.upper()} missing from --help"
    assert "--warmup" in text and "--no-warmup" in text
    assert "{fused,unfused,ab}" in text and "{auto,float32,float16,bfloat16,float8}" in text


def test_serve_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    _help_lists_everything(capsys.readouterr().out)


def test_serve_help_as_a_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | {"COLUMNS": "100"}
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    _help_lists_everything(proc.stdout)


def test_serve_invalid_choice_exits_2(no_server, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--mode", "fast"])
    assert info.value.code == 2
    assert re.search(r"--mode: invalid choice: '?fast'?", capsys.readouterr().err)


def test_serve_invalid_env_exits_2(monkeypatch, no_server, capsys):
    monkeypatch.setenv("FUSEDSERVE_MAX_DELAY_MS", "-1")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedserve: invalid configuration:")
    assert "FUSEDSERVE_MAX_DELAY_MS: Input should be greater than or equal to 0 (got '-1')" in err


def test_serve_invalid_option_value_names_the_option_as_typed(no_server, monkeypatch, capsys):
    """A value from the command line is named as typed (--max-batch-size), one from the environment by its variable;
    so are the checks across settings."""
    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "--max-batch-size: Input should be greater than or equal to 1 (got '0')" in capsys.readouterr().err
    monkeypatch.setenv("FUSEDSERVE_GRPC_PORT", "8001")
    assert main(["serve", "--port", "8001"]) == 2
    assert "FUSEDSERVE_GRPC_PORT (8001) must differ from --port" in capsys.readouterr().err
    monkeypatch.setenv("FUSEDSERVE_MAX_BATCH_SIZE", "-3")
    assert main(["serve"]) == 2
    assert "FUSEDSERVE_MAX_BATCH_SIZE: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_serve_unknown_variable_exits_2(monkeypatch, no_server, capsys):
    monkeypatch.setenv("FUSEDSERVE_MAX_BATCHSIZE", "8")
    assert main(["serve"]) == 2
    assert "unknown setting(s) FUSEDSERVE_MAX_BATCHSIZE" in capsys.readouterr().err


def test_serve_missing_model_exits_2(tmp_path, no_server, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["serve", "--model", str(missing), "--device", "cpu", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedserve: cannot serve: ") and f"{missing}: no such model directory" in err


def test_serve_options_beat_environment(monkeypatch, no_server, capsys):
    """The parsed Settings as the supervisor receives them (serve replaced: it fails after recording)."""
    seen = []

    def fake_serve(settings, overrides):
        seen.append(settings)
        # The command line's settings travel too: they beat the environment and the file at every reload.
        assert overrides["mode"] == "fused" and overrides["port"] is None
        raise RuntimeError("stop here")

    monkeypatch.setattr(service.supervisor, "serve", fake_serve)
    monkeypatch.setenv("FUSEDSERVE_MODE", "unfused")
    monkeypatch.setenv("FUSEDSERVE_PORT", "9100")
    monkeypatch.setenv("FUSEDSERVE_WARMUP", "true")
    monkeypatch.setenv("FUSEDSERVE_TUNING_TIMING", "cold")
    argv = ["serve", "--mode", "fused", "--max-batch-size", "8", "--no-warmup", "--allow-tf32", "--log-level", "error",
            "--tuning-timing", "hot"]  # fmt: skip
    assert main(argv) == 2
    assert "cannot serve: stop here" in capsys.readouterr().err
    (s,) = seen
    assert (s.mode, s.max_batch_size, s.max_rows_per_request, s.warmup, s.allow_tf32) == ("fused", 8, 8, False, True)
    assert s.tuning_timing == "hot"
    assert s.port == 9100 and s.log_level == "error"  # not given on the command line: the environment's


def test_unknown_variable_in_dotenv_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("FUSEDSERVE_MAX_BATCHSIZE=3\nOTHER_TOOL_SETTING=1\n")
    with pytest.raises(SettingsError, match="FUSEDSERVE_MAX_BATCHSIZE"):
        load_settings()


def test_a_model_dir_that_was_set_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_settings().model_path().is_dir()  # the default falls back to the packaged models
    monkeypatch.setenv("FUSEDSERVE_MODEL_DIR", "typo_dir")
    with pytest.raises(ModelNotFound) as e:
        load_settings().model_path()
    assert str(e.value) == (
        "no model named 'digits-mlp': looked in digits-mlp, typo_dir/digits-mlp (give a model directory or an .onnx "
        "file)"
    )


def test_the_engine_passes_the_tuning_settings_to_the_kernels(monkeypatch, tmp_path):
    """build_runner sets the kernels' process-wide switches from the settings (the runner itself is faked)."""
    import types

    import torch

    import service.model.runner
    from kernels import pdl, tuning
    from service.engine.core import build_runner

    monkeypatch.setattr(tuning, "_cache", [])
    monkeypatch.setattr(tuning.switch, "_on", None)
    monkeypatch.setattr(tuning.background, "_on", None)
    monkeypatch.setattr(tuning.timing_policy, "_value", None)
    monkeypatch.setattr(pdl.switch, "_on", None)
    monkeypatch.setattr(tuning, "timing_budget", tuning.TimingBudget())
    monkeypatch.setattr(service.model.runner, "ModelRunner", lambda *a, **k: "runner")
    settings = Settings(tuning=False, tuning_background=True, tuning_timing="hot", tuning_cache=tmp_path / "t.json",
                        pdl=False, tuning_startup_s=45)  # fmt: skip
    metrics = types.SimpleNamespace(observe_kernel=None, observe_forward=None)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # build_runner sets both
    try:
        assert build_runner(settings, torch.device("cpu"), "float32", None, metrics) == "runner"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert tuning.timing_policy() == "hot" and tuning.enabled() is False and pdl.enabled() is False
    assert tuning.background() is True and tuning.timing_budget.seconds == 45.0
    assert tuning.cache().path == tmp_path / "t.json"
    try:
        build_runner(settings.model_copy(update={"tuning_startup_s": float("inf")}), torch.device("cpu"), "float32",
                     None, metrics)  # fmt: skip
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert tuning.timing_budget.seconds is None  # inf: no budget


def test_default_workers_follow_the_cores_and_the_engines():
    from service.supervisor import default_workers

    # One front end per core left after the engines, at most 8 per engine, at least one.
    assert default_workers(1, cores=16) == 8
    assert default_workers(2, cores=32) == 16
    assert default_workers(2, cores=16) == 14
    assert default_workers(1, cores=4) == 3
    assert default_workers(1, cores=1) == 1
    assert default_workers(8, cores=8) == 1


def test_the_top_level_help_says_whole_sentences(capsys):
    """`fusedserve --help` gave the first line of a sentence and stopped."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`import` (an ONNX file into a model directory), `ab-report`" in text
    assert "service/docs_gen.py)." in text
