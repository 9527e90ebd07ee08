"""deploy/k8s and deploy/envoy, checked offline: the Kubernetes manifests against Kubernetes' own OpenAPI schemas
(kubernetes-validate ships them, strict: no unknown field passes), and both against what the server does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llmserve.api.servicer import SERVICE_NAME
from llmserve.config import ServerConfig, from_args
from llmserve.engine.types.protocol import EngineStats
from llmserve.telemetry.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest release with every field used here (native gRPC probes, the preStop sleep action).
K8S_VERSION = "1.30.0"


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str, app: str = "llmserve") -> list[dict[str, Any]]:
    """The documents of a kind, of llmserve's own (or smg's: smg.yaml)."""
    return [
        d
        for d in documents()
        if d["kind"] == kind and d["metadata"].get("labels", {}).get("app.kubernetes.io/name", "llmserve") == app
    ]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifests_match_the_kubernetes_schemas(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_schema_violation_is_caught() -> None:
    (deployment,) = by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def exported_metric_names() -> set[str]:
    """The families a server exports, with an engine stand-in for the engine's book-keeping."""
    stats = EngineStats(0, 0, 1, 0, 0, 16, 0, 0, 0, 0, 0, {"memory": 0}, 0)
    info = SimpleNamespace(name="m", dtype="float32", device="cpu", context_length=8)
    engine = SimpleNamespace(dead=False, model_info=info, stats=lambda: stats, engine_pid=None)
    metrics = ServerMetrics("r", lambda: 0, lambda: engine)  # type: ignore[arg-type,return-value]
    return {family.name for family in metrics.registry.collect()}


def test_the_deployment_follows_the_servers_flags_and_ports() -> None:
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    config = from_args(container["args"], env={k: e["value"] for k, e in env.items() if "value" in e})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(ServerConfig().address.rsplit(":", 1)[1])
    assert ports["metrics"] == config.server.metrics_port == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert env["LLMSERVE_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Drain time fits: preStop sleep, then the server's grace period, inside the pod's grace.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + config.server.grace_period_s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_autoscaler_scales_on_a_metric_the_server_exports() -> None:
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "llmserve_requests_waiting"
    assert "llmserve_requests_waiting" in exported_metric_names()
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind("Deployment")[0]["metadata"]["name"]


def test_the_fronts_hash_on_the_session_header() -> None:
    (ingress,) = by_kind("Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    envoy = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    (cluster,) = envoy["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "RING_HASH"
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == SERVICE_NAME
    (listener,) = envoy["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["hash_policy"] == [{"header": {"header_name": "x-session-id"}}]
    assert route["route"]["timeout"] == "0s"


def test_the_smg_gateway_discovers_the_replicas_on_their_grpc_port() -> None:
    """deploy/k8s/smg.yaml: smg's service discovery selects the llmserve pods and dials their gRPC port, with the RBAC
    to watch pods, the flags the tests' smg runs with (deploy/smg/launch.sh) and probes on its health port."""
    (smg,) = by_kind("Deployment", "smg")
    (llmserve,) = by_kind("Deployment")
    pod = smg["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    flag = {name: args[args.index(name) + 1] for name in ("--selector", "--service-discovery-port", "--policy")}
    labels = llmserve["spec"]["template"]["metadata"]["labels"]
    assert flag["--selector"] == ",".join(f"{k}={v}" for k, v in labels.items())
    (grpc_port,) = [
        p["containerPort"]
        for p in llmserve["spec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == "grpc"
    ]
    assert int(flag["--service-discovery-port"]) == grpc_port and flag["--policy"] == "cache_aware"
    (role,) = by_kind("Role", "smg")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind("RoleBinding", "smg")
    assert (
        binding["subjects"][0]["name"]
        == pod["serviceAccountName"]
        == by_kind("ServiceAccount", "smg")[0]["metadata"]["name"]
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(args[args.index("--port") + 1]) and ports["health"] == int(
        args[args.index("--health-check-port") + 1]
    )
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    assert '--policy "${SMG_POLICY:-cache_aware}"' in (ROOT / "deploy" / "smg" / "launch.sh").read_text()
