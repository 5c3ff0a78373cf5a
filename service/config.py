"""All configuration: one pydantic-settings class, read from FUSEDSERVE_* variables and `.env`.

`fusedserve serve --help` lists these same fields (service/cli.py builds its options from them).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from dotenv import dotenv_values
from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FUSEDSERVE_"
PACKAGE_MODEL_DIR = Path(__file__).resolve().parents[1] / "model_weights"  # = service/model/locate.py's
DEFAULT_MODEL_DIR = Path("model_weights")
ENV_FILE = ".env"
SECRET_SETTINGS = ("api_key", "restricted_api")  # never echoed in an error or a log
# What FUSEDSERVE_RESTRICTED_API can put behind a header (service/frontend/auth.py, api_of_path): Triton's names where
# Triton has the API (statistics, model-config), ours for the rest. Health is never restricted; inference takes the
# API keys instead.
RESTRICTABLE_APIS = ("metrics", "model", "docs", "statistics", "model-config")
# What API keys close beside inference when they are on (issue 53): what tells a caller about the model and its traffic.
# /metrics is left to its header or its own port, where Prometheus scrapes without a key.
KEYED_APIS = ("docs", "model", "statistics", "model-config")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)
_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")  # printable ASCII, no space at either end


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=ENV_FILE, extra="ignore")

    mode: Literal["fused", "unfused", "ab"] = Field(
        "fused",
        description="fused: Triton kernels (GEMM+bias+act in one); unfused: plain torch, one op at a time; ab: both "
        "loaded in every engine, each batch run by one of them (AB_UNFUSED_PERCENT), every answer naming which "
        "(docs/ab.md). Changes live on SIGHUP",
    )
    ab_unfused_percent: float = Field(
        50.0,
        ge=0,
        le=100,
        description="in ab mode, the share of batches run unfused (by AB_OTHER's configuration where it is set), in "
        "percent; chosen per batch-size bucket, so both modes see the same mix of batch sizes. Changes live on SIGHUP",
    )
    shadow_every: int = Field(
        0,
        ge=0,
        description="run every Nth batch in the other mode (AB_OTHER's configuration where it is set) too, after its "
        "answers are sent and only while no request waits, and record the difference (fusedserve_shadow_*); 0: off. "
        "In fused or unfused mode a value above 0 loads the other executor as well. Changes live on SIGHUP",
    )
    ab_other: str | None = Field(
        None,
        description="the configuration the A/B compares against, MODE:DTYPE (e.g. fused:float16 beside "
        "DTYPE=float8): the executor that runs AB_UNFUSED_PERCENT of the batches in ab mode and every "
        "SHADOW_EVERY-th batch again as the shadow (unset: the other mode, fused or unfused, in DTYPE). When its "
        "DTYPE differs from the served one, both executors' `mode` labels and answers name their precision "
        "(fused:float8, fused:float16; docs/ab.md)",
    )
    config_file: Path | None = Field(
        None,
        description="the file of FUSEDSERVE_ settings read at start and again on SIGHUP (default: .env in the working "
        "directory); a setting in the environment or on the command line beats the file",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto picks cuda when present; fused on cpu runs Triton's interpreter (slow)"
    )
    model: str = Field(
        "digits-mlp",
        description="a model name (looked up in the working directory, then under model_dir), or a path to a model "
        "directory or an .onnx file (one with a '/', or ending in .onnx: taken as given)",
    )
    model_dir: Path = Field(
        DEFAULT_MODEL_DIR,
        description="where model names are looked up (left at its default where the working directory has none: "
        "the model_weights beside the package)",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float8"] = Field(
        "auto",
        description="compute dtype; weights are cast at load, kernels accumulate in fp32. auto: float16 on CUDA, "
        "float32 on the CPU. float8: convs and linears in e4m3 (weights per output channel, activations per tensor "
        "from the model's calibration.json: `fusedserve calibrate MODEL --samples DIR`; refused without it), the "
        "rest in float16 (FLOAT8_FP16_STEPS)",
    )
    float8_fp16_steps: str = Field(
        "first,last,pooled",
        description="with dtype float8, the steps kept in float16: step names, `first` (the first conv or linear), "
        "`last` (the classifier), `pooled` (the convs on a 1x1 map: squeeze-excitation's) and `gated` (the convs that "
        "apply a squeeze-excitation gate), comma-separated; empty: every step the fp8 kernels can run",
    )
    allow_tf32: bool = Field(False, description="let float32 matmuls use TF32 on GPU (both modes alike)")
    # 1024: with 64-row requests under load a 256-row batch held 4 requests and the engine's ~0.1 ms of host
    # work per batch capped it near 0.9M rows/s (H100 host); the digits MLP's kernel takes ~9 us at 1024 rows.
    max_batch_size: int = Field(1024, ge=1, le=65536, description="most rows merged into one forward")
    max_delay_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="longest an idle engine holds a partial batch for more requests (0: an idle engine runs what "
        "it has at once; while it is busy, arrivals gather into the next batch anyway). Changes live on SIGHUP",
    )
    engine_spin_ms: float = Field(
        2.0,
        ge=0,
        le=1_000,
        description="how long a CUDA engine polls for the next request after a batch before it sleeps (its core "
        "is busy meanwhile: 0 on a host whose cores are shared). Changes live on SIGHUP",
    )
    max_rows_per_request: int | None = Field(
        None, ge=1, description="most rows in one request (default: max_batch_size; never more than it)"
    )
    max_queue_requests: int = Field(
        1024, ge=1, description="requests waiting beyond this are refused at once with 503. Changes live on SIGHUP"
    )
    request_timeout_ms: float = Field(
        30_000, gt=0, description="a request still queued after this long is dropped with 504. Changes live on SIGHUP"
    )
    # 50 MP: a 48 MP phone photo (8000 x 6000, 144 MB decoded as RGB) passes; a 30,000 x 30,000 decompression bomb
    # (0.9 MB as a PNG, 2.7 GB as RGB) is refused from its header, before any pixel is decoded.
    image_max_pixels: int = Field(
        50_000_000,
        ge=1,
        description="most pixels (width x height) of one encoded image, read from its header before decoding; a "
        "larger one is refused with 413 (a model that takes images: service/images/decode.py)",
    )
    # 32 MiB: a dozen phone JPEGs of 2-3 MB each, base64 included; an image model's limit for rows of numbers is
    # larger anyway at 3 x 224 x 224 inputs (4.8 MB of JSON per row)
    max_image_body_bytes: int = Field(
        32 << 20,
        ge=1024,
        description="the largest request body (or gRPC message) of a model that takes encoded images, when its limit "
        "for rows of numbers (max_rows_per_request x input values x 32 bytes) is smaller",
    )
    image_decode_threads: int = Field(
        2,
        ge=1,
        le=64,
        description="threads per front end that decode and resize encoded images (Pillow and torch let go of "
        "Python's lock while they work), so that a request's images decode side by side and the front end goes on "
        "serving meanwhile",
    )
    image_decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="where JPEGs are decoded: gpu: in the engine, each batch's JPEGs in one nvJPEG call "
        "(torchvision.io.decode_jpeg on CUDA) while the batch before it runs, then resized and cropped on the GPU in "
        "one kernel, the front ends checking each "
        "file's header first; cpu: in the front ends (Pillow), as PNG and WebP always are; auto: gpu where the engine "
        "runs on CUDA and torchvision decodes a JPEG there, else cpu (service/images/gpu_decode.py)",
    )
    pinned_arenas: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on CUDA, register each front end's shared-memory arena with CUDA (cudaHostRegister) so that a "
        "batch's rows are copied to the GPU from where the front end wrote them, one asynchronous copy per contiguous "
        "run, with no staging copy on the engine's thread; auto: for inputs of at least 16 KiB a row (images), where "
        "the staging copy costs more than the copies it saves; off: every batch is staged into pinned memory first "
        "(service/engine/pinned.py)",
    )
    kernel_timing_every: int = Field(
        16,
        ge=0,
        description="time kernels on every Nth batch (0: never); on CUDA that batch replays a copy of its bucket's "
        "CUDA graph with events recorded between the steps",
    )
    cuda_graphs: bool = Field(
        True,
        description="on CUDA, a batch is one replay of the CUDA graph captured for its bucket (powers of two below "
        "max_batch_size, then max_batch_size)",
    )
    tuning: bool = Field(
        True, description="time candidate kernel configs per batch bucket at warm-up (false: first candidate, untimed)"
    )
    # ResNet-50 has ~50 keys per batch bucket, ~1.5 s each to time with Triton's cache warm: tuning them all holds a
    # start for minutes, where the untimed picks serve at once (kernels/tuning_background.py).
    tuning_background: bool = Field(
        False,
        description="with tuning on, report ready without timing: each kernel config missing from the tuning cache "
        "gets an untimed pick (the cached pick of the nearest batch bucket, else the first candidate), and the "
        "engine times them while no request waits, one candidate at a time, the buckets traffic uses first, "
        "caching each pick and swapping it in between batches (progress: fusedserve_tuning_pending_keys, "
        "GET /model's tuning)",
    )
    # ResNet-50's bucket 1 alone took 217 s to time with empty caches (H100); issue 34 asks a start within 3 minutes
    # with an empty tuning cache. Small models never reach the budget (the digits MLP times its keys in seconds).
    tuning_startup_s: float = Field(
        60.0,
        ge=0,
        description="with tuning on, seconds of kernel timing a start may spend: past them, the configs still "
        "missing from the tuning cache get untimed picks and are timed while no request waits, as with "
        "tuning_background (which is this at 0). inf: time every config before ready",
    )
    # both: a config that wins cold but loses back to back is the wrong pick for a loaded server, and the
    # reverse for the first batch after an idle spell (kernels/tuning.py, pick).
    tuning_timing: Literal["both", "cold", "hot"] = Field(
        "both",
        description="which device time picks a kernel config, since a config can win one and lose the other: cold "
        "(L2 cleared before each call: the first batch after a pause) or hot (calls back to back: a loaded server). "
        "both takes the fastest hot of the candidates within 2% of the best cold time and 10% of the best hot, or, "
        "when none is, the one closest to the best on its worse count. A pick made under another value is not "
        "reused",
    )
    tuning_cache: Path | None = Field(
        None,
        description="JSON file of tuned kernel configs with their cold and hot times, kept across restarts, per "
        "GPU, Triton version, kernel source, tuning_timing and list of candidates (a release that offers new ones "
        "times them again) (default $XDG_CACHE_HOME/fusedserve/tuning.json)",
    )
    compile_threads: int | None = Field(
        None,
        ge=0,
        le=256,
        description="threads that compile a kernel's candidate configs side by side before tuning times them one by "
        "one (Triton's AsyncCompileMode; a cold Triton cache makes compiling most of the tuning time); 0 or 1: each "
        "compiles as it is first timed (default: the CPUs the engine may run on, at most 16)",
    )
    # Compiles of this package's kernels take 0.2-5 s; one specialised into a huge program (SqueezeNet's 13x13 pool
    # unrolled into a conv's epilogue) compiled for over 5 minutes and kept a start from ever becoming ready.
    compile_deadline_s: float = Field(
        30.0,
        ge=0,
        description="seconds one Triton kernel compile may take: past them that launch config is dropped (and "
        "counted in fusedserve_kernel_compiles_late), and a fused step none of whose configs compiles in time runs "
        "its unfused op, reported in GET /model, the log and fusedserve_steps_unfused_fallback; 0: no deadline",
    )
    pdl: bool = Field(
        True,
        description="on sm_90+ GPUs, launch each layer's GEMM kernel as a programmatic dependent launch, so it "
        "starts loading weights while the previous layer finishes",
    )
    warmup: bool = Field(
        True,
        description="compile, tune and capture every batch bucket before reporting ready (/health/ready); on the "
        "CPU nothing compiles: fused (Triton's interpreter), batch 1 alone, which runs every kernel; unfused, batch 1 "
        "and the largest, the largest left out where batch 1's time times its rows passes 10 s, as for a ResNet",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=64,
        description="HTTP front-end processes (FastAPI + uvicorn, sharing the port; default: one per CPU the service "
        "may use (its CPU affinity, capped by a container's CPU quota: docker --cpus, a Kubernetes CPU limit) left "
        "after the engines, at most 8 per engine: 8 on a 16-core host with one GPU, 16 on 32 cores with two)",
    )
    engines: int | None = Field(
        None,
        ge=1,
        le=64,
        description="engine processes, each owning one device and one batch queue (default: one per visible GPU, "
        "1 on the CPU)",
    )
    shutdown_grace_s: float = Field(
        30.0, gt=0, le=3600, description="on SIGTERM, longest wait for accepted requests to be answered"
    )
    # 5 s: a Kubernetes endpoint removal reaches kube-proxies and ingresses within a few seconds, and a load balancer
    # that checks /health/ready every 2 s, out after 2 failures (a common setting), needs 4.
    drain_delay_s: float = Field(
        5.0,
        ge=0,
        le=600,
        description="on SIGTERM, how long the service goes on accepting and answering, /health/ready reading 503, "
        "so that load balancers and Kubernetes endpoints stop sending before it stops accepting; then it drains "
        "and stops within SHUTDOWN_GRACE_S. A second SIGTERM or Ctrl-C skips it. 0: drain at once",
    )
    max_connections: int = Field(
        2048,
        ge=2,
        le=1_000_000,
        description="open HTTP connections one front end serves; a request on one more gets 503 at once "
        "(Retry-After: 1, counted overloaded); on the gRPC port, calls in flight per front end (past it: "
        "RESOURCE_EXHAUSTED)",
    )
    max_connections_per_client: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="open connections one front end takes from one client address (its IP), TLS handshakes included; "
        "one more is closed as it is accepted (plain HTTP: after a 503). Unset: no limit per client (clients behind "
        "one proxy or NAT share an address: leave it unset there, or set it above their sum)",
    )
    per_client_connect_rate: float | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="new connections a second one front end takes from one client address (its IP), after a burst of "
        "PER_CLIENT_CONNECT_BURST (a token bucket per address): one more is closed as it is accepted, before any "
        'TLS handshake, counted in fusedserve_connections_refused_total{reason="connect_rate"}. Keep-alive '
        "clients open a few connections and keep them; each new TLS connection costs a handshake (docs/security.md: "
        "the attack benchmark's value). Unset: no bound. Behind a load balancer, a proxy or NAT, every client behind "
        "it arrives from its one address and shares one bucket: leave it unset there, or set it above their sum",
    )
    per_client_connect_burst: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="new connections one client address may open at once before PER_CLIENT_CONNECT_RATE applies "
        "(a client's connection pool opens at once; unset: twice the rate, rounded up)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="a connection whose request headers are not complete this long after its first byte (or its "
        "opening) is closed (408); over TLS the handshake too must end this long after the connection opens",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a request body that sends no bytes for this long is dropped and its connection closed",
    )
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in containers)")
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="port to listen on (/predict, the Open Inference Protocol's REST /v2 routes, /metrics)",
    )
    grpc_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port for the Open Inference Protocol over gRPC, shared by every front end (unset: no gRPC; the "
        "REST /v2 routes are always served on port)",
    )
    grpc_workers: int = Field(
        0,
        ge=0,
        le=64,
        description="front-end processes that serve gRPC only, beside the HTTP ones (0: every HTTP front end serves "
        "gRPC too, on its own event loop). In processes of their own, gRPC calls (and refused ones) do not take the "
        "HTTP front ends' GIL and event loop: docs/security.md measures what that keeps of HTTP throughput while "
        "unauthenticated gRPC calls arrive",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="log level. Changes live on SIGHUP"
    )
    # Off by default: a line per request is 13-15 us of a front end's time (docs/api.md), and many deployments log at
    # the proxy.
    access_log: Literal["off", "text", "json"] = Field(
        "off",
        description="a line per HTTP request on standard output (the server's log stays on standard error): time, "
        "request id, method and route, status, rows, mode, latency in the server, and the reason of an error; text, "
        "or json (one object a line). Written by a thread of its own, never on the request's path (docs/api.md)",
    )
    access_log_sample: float = Field(
        1.0,
        gt=0,
        le=1,
        description="with ACCESS_LOG on, the share of answers below 400 logged, drawn per request (0.01: one in a "
        "hundred); every error is logged",
    )
    # ---- who may call what (docs/security.md)
    api_key: SecretStr | None = Field(
        None,
        description="one API key: inference (POST /predict, the v2 infer routes, gRPC ModelInfer) then needs "
        "`Authorization: Bearer <key>` (gRPC metadata `authorization`), else 401. Prefer API_KEYS_FILE: a key in the "
        "environment or on the command line is seen by whoever can read the process's",
    )
    api_keys_file: Path | None = Field(
        None,
        description="a file of API keys, one a line, each the key itself or `sha256:<64 hex digits>` of it; blank "
        "lines and `#` comments are skipped (a Kubernetes Secret or compose secret mounted as a file). With "
        "API_KEY, either key is taken. Read at start (unreadable: the start fails naming it) and again on SIGHUP",
    )
    restricted_api: SecretStr | None = Field(
        None,
        description="routes that need a header, as Triton's --http-restricted-api: `API[,API...]:HEADER=VALUE`, "
        "groups separated by `;`, e.g. `metrics,statistics,model-config:X-Admin-Key=s3cret`. APIs: metrics "
        "(/metrics), model (/model), docs (/docs, /redoc, /openapi.json), statistics (/v2/models[/NAME[/versions/"
        "V]]/stats, gRPC ModelStatistics), model-config (/v2/models/NAME[/versions/V]/config, gRPC ModelConfig). "
        "Without the header and value: 403 (gRPC PERMISSION_DENIED). Health is always open",
    )
    public_api: str | None = Field(
        None,
        description="with API keys on, the APIs left open without a key, comma-separated: any of docs, model, "
        "statistics, model-config (default: none, so with keys on each of them needs `Authorization: Bearer <key>` "
        "too, or its RESTRICTED_API header where one is set). Without keys they are open anyway",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="serve /metrics on this port instead (plain HTTP, only /metrics, from the supervisor process), "
        "so that a network policy can keep it inside the cluster; /metrics on PORT then answers 404",
    )
    docs: bool = Field(
        True, description="serve the API docs: /docs, /redoc and /openapi.json (the container image turns them off)"
    )
    tls_cert: Path | None = Field(
        None, description="PEM certificate (chain) for HTTPS and gRPC over TLS; needs TLS_KEY (unset: plain text)"
    )
    tls_key: Path | None = Field(None, description="PEM private key of TLS_CERT")
    tls_client_ca: Path | None = Field(
        None,
        description="PEM CA certificate(s) for mutual TLS: HTTPS and gRPC clients must present a certificate "
        "signed by one (needs TLS_CERT)",
    )

    @model_validator(mode="after")
    def _rows_fit_a_batch(self) -> Settings:
        if self.max_rows_per_request is None:
            self.max_rows_per_request = self.max_batch_size
        elif self.max_rows_per_request > self.max_batch_size:
            raise ValueError(
                f"{ENV_PREFIX}MAX_ROWS_PER_REQUEST ({self.max_rows_per_request}) exceeds {ENV_PREFIX}MAX_BATCH_SIZE "
                f"({self.max_batch_size}): a request must fit in one batch"
            )
        if self.grpc_port is not None and self.grpc_port == self.port:
            # Both bind with SO_REUSEPORT: the kernel would hand HTTP connections to the gRPC server and back.
            raise ValueError(f"{ENV_PREFIX}GRPC_PORT ({self.grpc_port}) must differ from {ENV_PREFIX}PORT")
        if self.grpc_workers and self.grpc_port is None:
            raise ValueError(f"{ENV_PREFIX}GRPC_WORKERS ({self.grpc_workers}) needs {ENV_PREFIX}GRPC_PORT: without "
                             "it no gRPC is served")  # fmt: skip
        if self.metrics_port is not None and self.metrics_port in (self.port, self.grpc_port):
            raise ValueError(f"{ENV_PREFIX}METRICS_PORT ({self.metrics_port}) must differ from {ENV_PREFIX}PORT and "
                             f"{ENV_PREFIX}GRPC_PORT")  # fmt: skip
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("TLS_CERT", "TLS_KEY") if self.tls_key is None else ("TLS_KEY", "TLS_CERT")
            raise ValueError(f"{ENV_PREFIX}{given} is set without {ENV_PREFIX}{missing}: set both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"{ENV_PREFIX}TLS_CLIENT_CA needs {ENV_PREFIX}TLS_CERT and {ENV_PREFIX}TLS_KEY")
        self.ab_configs()  # a malformed or self-comparing AB_OTHER stops the start with its error
        self.restrictions()  # a malformed rule stops the start with its error
        self.public_apis()
        return self

    def connect_rate(self) -> tuple[float, int] | None:
        """(connections a second, burst) per client address, or None: PER_CLIENT_CONNECT_RATE and _BURST."""
        rate = self.per_client_connect_rate
        if rate is None:
            return None
        burst = self.per_client_connect_burst
        return rate, burst if burst is not None else max(1, math.ceil(2 * rate))

    def restrictions(self) -> dict[str, tuple[str, bytes]]:
        """FUSEDSERVE_RESTRICTED_API as {api: (header name in lower case, sha256 of the value)}; ValueError naming
        what is wrong, never the value. Values are kept as digests only, compared in constant time
        (service/frontend/auth.py)."""
        if self.restricted_api is None:
            return {}
        return parse_restricted(self.restricted_api.get_secret_value())

    def public_apis(self) -> frozenset[str]:
        """FUSEDSERVE_PUBLIC_API as a set of API names; ValueError naming an unknown one."""
        if self.public_api is None:
            return frozenset()
        names = frozenset(a.strip() for a in self.public_api.split(",") if a.strip())
        unknown = sorted(names - set(KEYED_APIS))
        if unknown:
            raise ValueError(f"{ENV_PREFIX}PUBLIC_API: unknown API {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(KEYED_APIS)}")  # fmt: skip
        return names

    def ab_configs(self, device_type: str | None = None) -> tuple[tuple[str, str], tuple[str, str]]:
        """The A/B's two configurations, ((mode, dtype) of A, (mode, dtype) of B): A is MODE's executor (fused in ab
        mode) in DTYPE, B is AB_OTHER, else the other mode in DTYPE. `device_type` resolves DTYPE=auto; without it an
        auto DTYPE is left as "auto" and B is checked only for its form. ValueError naming FUSEDSERVE_AB_OTHER."""
        dtype = self.compute_dtype(device_type) if device_type is not None else self.dtype
        a = ("fused" if self.mode == "ab" else self.mode, dtype)
        if self.ab_other is None:
            return a, ("unfused" if a[0] == "fused" else "fused", dtype)
        b = parse_config(self.ab_other)
        if b == a:
            served = f"{ENV_PREFIX}MODE={self.mode}, {ENV_PREFIX}DTYPE={dtype}"
            raise ValueError(f"{ENV_PREFIX}AB_OTHER ({self.ab_other}) is the served configuration itself ({served}): "
                             "name another mode or dtype")  # fmt: skip
        return a, b

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def compute_dtype(self, device_type: str) -> str:
        """The dtype to serve in: `dtype`, with auto resolved (float16 on CUDA: Hopper's tensor cores do not
        compute IEEE float32 products, so the fused digits MLP takes ~25 us per batch in float32 against ~9
        in float16; float32 on the CPU, where float16 matmuls are slow)."""
        if self.dtype != "auto":
            return self.dtype
        return "float16" if device_type == "cuda" else "float32"

    def model_path(self) -> Path:
        """The model directory or .onnx file `model` names, found by the one rule of service/model/locate.py (a path
        as given; a name in the working directory, then under model_dir, then, with model_dir at its default, beside
        the package); ModelNotFound names every place looked at. A model_dir that was set is taken as given, so a
        typo in it is reported, not papered over."""
        from .model.locate import locate_model

        return locate_model(self.model, self.model_dir)


AB_MODES = ("fused", "unfused")
AB_DTYPES = ("float32", "float16", "bfloat16", "float8")


def parse_config(text: str) -> tuple[str, str]:
    """FUSEDSERVE_AB_OTHER's `MODE:DTYPE` -> (mode, dtype); ValueError saying what is expected."""
    mode, colon, dtype = text.strip().partition(":")
    mode, dtype = mode.strip(), dtype.strip()
    if not colon or mode not in AB_MODES or dtype not in AB_DTYPES:
        raise ValueError(f"{ENV_PREFIX}AB_OTHER must be MODE:DTYPE with MODE one of {', '.join(AB_MODES)} and DTYPE "
                         f"one of {', '.join(AB_DTYPES)} (e.g. fused:float16), not {text!r}")  # fmt: skip
    return mode, dtype


def parse_restricted(text: str) -> dict[str, tuple[str, bytes]]:
    """`metrics,statistics:X-Admin-Key=v;docs:X-Docs=w` -> {"metrics": ("x-admin-key", sha256(v)), ...}. A value may
    hold `=` but not `,` or `;`; every API at most once. Errors name the group by its number, never its value."""
    var = ENV_PREFIX + "RESTRICTED_API"
    rules: dict[str, tuple[str, bytes]] = {}
    groups = [g.strip() for g in text.split(";")]
    for n, group in enumerate(groups, 1):
        if not group:
            if len(groups) == 1:
                raise ValueError(f"{var} is empty; unset it, or give API[,API...]:HEADER=VALUE")
            continue
        apis, colon, rule = group.partition(":")
        header, equals, value = rule.partition("=")
        header, value = header.strip(), value.strip()
        where = f"{var}, group {n} of {len(groups)}"
        if not colon or not equals:
            raise ValueError(f"{where}: expected API[,API...]:HEADER=VALUE (groups separated by ';')")
        if not _TOKEN.fullmatch(header):
            raise ValueError(f"{where}: {header!r} is not an HTTP header name")
        if not _VALUE.fullmatch(value):
            raise ValueError(f"{where}: the value of {header} must be printable ASCII, not empty (not shown here)")
        if "," in value:
            raise ValueError(f"{where}: the value of {header} holds ',' (separate groups with ';')")
        for api in (a.strip() for a in apis.split(",")):
            if api not in RESTRICTABLE_APIS:
                why = " (health is always open)" if api == "health" else ""
                raise ValueError(f"{where}: unknown API {api!r}{why}; known: {', '.join(RESTRICTABLE_APIS)}")
            if api in rules:
                raise ValueError(f"{where}: {api} is restricted twice")
            rules[api] = (header.lower(), hashlib.sha256(value.encode()).digest())
    return rules


class SettingsError(ValueError):
    """A configuration value is wrong; the message names the variable."""


# Settings a running service takes on SIGHUP (service/supervisor.py re-reads the configuration file and hands these
# to its engines and front ends). The others are fixed for the life of the process tree: ports, processes, the model,
# its dtype and batch buckets (each bucket's CUDA graph is captured at warm-up), the kernel switches.
LIVE_SETTINGS = (
    "mode",
    "ab_unfused_percent",
    "shadow_every",
    "max_delay_ms",
    "max_queue_requests",
    "request_timeout_ms",
    "engine_spin_ms",
    "log_level",
)


def config_file_of(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The configuration file: `config_file` from the overrides (the command line) or FUSEDSERVE_CONFIG_FILE, else
    `.env` in the working directory."""
    given = (overrides or {}).get("config_file")
    if given is None:
        given = (os.environ if environ is None else environ).get(ENV_PREFIX + "CONFIG_FILE") or None
    return Path(given) if given is not None else Path(ENV_FILE)


def unknown_variables(environ: Mapping[str, str] | None = None, env_file: str | Path | None = ENV_FILE) -> list[str]:
    """FUSEDSERVE_* names, in the environment or the configuration file, that match no setting: a typo
    would otherwise be silently ignored."""
    names = set(os.environ if environ is None else environ)
    if env_file is not None and Path(env_file).is_file():
        names |= {k for k in dotenv_values(env_file) if k}
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    return sorted(k for k in names if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


def load_settings(**overrides) -> Settings:
    """Settings from the environment, the configuration file (`.env`, or FUSEDSERVE_CONFIG_FILE) and explicit
    overrides, or a SettingsError naming each bad value. Precedence: overrides, then the environment, then the file."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    env_file = config_file_of(overrides)
    explicit = "config_file" in overrides or os.environ.get(ENV_PREFIX + "CONFIG_FILE")
    if explicit and not env_file.is_file():
        raise SettingsError(f"{ENV_PREFIX}CONFIG_FILE: {env_file} is not a readable file")
    typos = unknown_variables(env_file=env_file)
    if typos:
        raise SettingsError("unknown setting(s) " + "; ".join(_did_you_mean(k) for k in typos) + " (every setting: "
                            "fusedserve serve --help, docs/configuration.md)")  # fmt: skip
    try:
        return Settings(_env_file=env_file, **overrides)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            name = setting_name(field, overrides) if field in Settings.model_fields else field
            shown = "input" in err and not isinstance(err["input"], dict) and field not in SECRET_SETTINGS
            got = f" (got {err['input']!r})" if shown else ""
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{name}: {msg}{got}" if field != "settings" else _as_typed(msg, overrides))
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def setting_name(field: str, overrides: Mapping[str, object] | None = None) -> str:
    """A setting as the user gave it: `--port` when it came from the command line (the overrides), else
    FUSEDSERVE_PORT (the environment or the configuration file)."""
    if overrides and overrides.get(field) is not None:
        return "--" + field.replace("_", "-")
    return ENV_PREFIX + field.upper()


def _as_typed(message: str, overrides: Mapping[str, object]) -> str:
    """A message of the cross-field checks, which name FUSEDSERVE_ variables, with the command line's as typed."""
    for field, value in overrides.items():
        if value is not None and field in Settings.model_fields:
            message = re.sub(rf"\b{ENV_PREFIX}{field.upper()}\b", setting_name(field, overrides), message)
    return message


def _did_you_mean(unknown: str) -> str:
    """`FUSEDSERVE_MAX_BATCHSIZE (did you mean FUSEDSERVE_MAX_BATCH_SIZE?)`, or the name alone when nothing is close."""
    import difflib

    # compared without the prefix that every name shares, so that FUSEDSERVE_ alone is close to nothing
    close = difflib.get_close_matches(unknown[len(ENV_PREFIX) :].lower(), Settings.model_fields, n=2, cutoff=0.75)
    return f"{unknown} (did you mean {' or '.join(ENV_PREFIX + c.upper() for c in close)}?)" if close else unknown


def changed_settings(old: Settings, new: Settings) -> tuple[dict[str, object], list[str]]:
    """What a reload would change: ({live field: new value}, [fixed fields that differ, which need a restart])."""
    live, fixed = {}, []
    for name in Settings.model_fields:
        if getattr(old, name) == getattr(new, name):
            continue
        if name in LIVE_SETTINGS:
            live[name] = getattr(new, name)
        else:
            fixed.append(name)
    return live, fixed


def overridden_in_file(
    env_file: Path, overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """FUSEDSERVE_ variables the file sets that the environment or the command line overrides: a reload cannot
    change them through the file."""
    environ = os.environ if environ is None else environ
    if not env_file.is_file():
        return []
    out = []
    for key in dotenv_values(env_file):
        if not key or not key.upper().startswith(ENV_PREFIX):
            continue
        field = key[len(ENV_PREFIX) :].lower()
        if key.upper() in {k.upper() for k in environ} or (overrides or {}).get(field) is not None:
            out.append(key.upper())
    return sorted(out)
