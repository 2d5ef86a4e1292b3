"""deploy/k8s: both overlays render (kubectl kustomize), validate against Kubernetes' own schemas
(kubernetes-validate, offline), and start every process with flags its own parser accepts; so do
the by-hand commands of docs/multi-host.md."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
IDS = ["cpu-overlay", "cuda-overlay"]  # not "gpu": tests/conftest.py takes that keyword for a GPU test
DOC = K8S.parents[1] / "docs" / "multi-host.md"
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is not installed (it renders the kustomize overlays)")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_the_overlay_renders_and_validates_against_kubernetes_schemas(overlay: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Secret", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema violation


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_nodes_advertise_their_pod_ip_probe_grpc_health_and_read_keys_from_the_secret(overlay: str) -> None:
    deployments = by_kind(render(overlay), "Deployment")
    for role, port in (("prefill", 50051), ("decode", 50052)):
        c = container(deployments[f"pdcluster-{role}"])
        env = {e["name"]: e.get("valueFrom") for e in c["env"]}
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "--advertise-host=$(POD_IP)" in c["args"] and "--host=0.0.0.0" in c["args"]
        assert env["PDCLUSTER_CLUSTER_TOKEN"]["secretKeyRef"]["name"] == "pdcluster-keys"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}
    proxy = deployments["pdcluster-proxy"]
    assert proxy["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    keys = {e["name"] for e in container(proxy)["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert keys == {"PDCLUSTER_CLUSTER_TOKEN", "PDCLUSTER_API_KEY", "PDCLUSTER_ADMIN_KEY"}
    if overlay == "gpu":
        for role in ("prefill", "decode"):
            spec = deployments[f"pdcluster-{role}"]["spec"]["template"]["spec"]
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert container(deployments[f"pdcluster-{role}"])["resources"]["limits"]["nvidia.com/gpu"] == 2


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In / NotIn / Exists) picks ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_only_pdclusters_pods_reach_the_nodes_and_redis(overlay: str) -> None:
    """The nodes (every port: gRPC and Mooncake's, which it picks at start) and Redis take connections from
    the proxy and the nodes only, but for the nodes' /metrics port, which any pod may scrape; nothing
    restricts the proxy, whose HTTP port faces clients."""
    docs = render(overlay)
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind(docs, "Deployment").items()}
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {"pdcluster-nodes", "pdcluster-redis"}
    ours = {"pdcluster-proxy", "pdcluster-prefill", "pdcluster-decode"}
    for name, guarded in (("pdcluster-nodes", {"pdcluster-prefill", "pdcluster-decode"}),
                          ("pdcluster-redis", {"pdcluster-redis"})):
        spec = policies[name]["spec"]
        assert {p for p, labels in pods.items() if selects(spec["podSelector"], labels)} == guarded
        assert spec["policyTypes"] == ["Ingress"]
        rule = spec["ingress"][0]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # pods of this namespace only
        assert {p for p, labels in pods.items() if selects(peer["podSelector"], labels)} == ours
    redis_port = by_kind(docs, "Service")["pdcluster-redis"]["spec"]["ports"][0]["port"]
    assert policies["pdcluster-redis"]["spec"]["ingress"][0]["ports"] == [{"port": redis_port, "protocol": "TCP"}]
    assert "ports" not in policies["pdcluster-nodes"]["spec"]["ingress"][0]  # Mooncake's ports are not known
    assert len(policies["pdcluster-redis"]["spec"]["ingress"]) == 1
    (scrapes,) = policies["pdcluster-nodes"]["spec"]["ingress"][1:]
    assert scrapes["from"] == [{"namespaceSelector": {}}]  # any namespace's pods: Prometheus runs in its own
    deployments = by_kind(docs, "Deployment")
    for node in ("pdcluster-prefill", "pdcluster-decode"):
        template = deployments[node]["spec"]["template"]
        (container,) = template["spec"]["containers"]
        port = int(template["metadata"]["annotations"]["prometheus.io/port"])  # where Prometheus scrapes
        assert f"--metrics-port={port}" in container["args"]
        assert {"name": "metrics", "containerPort": port} in container["ports"]
        assert scrapes["ports"] == [{"port": port, "protocol": "TCP"}]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_every_process_starts_with_flags_its_parser_accepts(overlay: str, tiny_model: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The args with the ConfigMap's values and a pod's own put in (the model: the test's tiny one)."""
    from node_runtime import cli
    from proxy.cli import parse_args

    docs = render(overlay)
    (config,) = by_kind(docs, "ConfigMap").values()
    values = {**config["data"], "PDCLUSTER_MODEL": str(tiny_model), "POD_NAME": "pdcluster-prefill-abc12",
              "POD_IP": "10.1.2.3"}

    def expand(args: list[str]) -> list[str]:
        return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]

    deployments = by_kind(docs, "Deployment")
    for role in ("prefill", "decode"):
        c = container(deployments[f"pdcluster-{role}"])
        assert c["command"] == ["python", "-m", f"{role}_node"]
        node, served = cli.parse(role, expand(c["args"]))
        assert node.advertise_host == "10.1.2.3" and node.node_id == "pdcluster-prefill-abc12"
        assert node.registry.url == "redis://pdcluster-redis:6379/0"
        assert node.engine.device == config["data"]["PDCLUSTER_DEVICE"]
    monkeypatch.setenv("PDCLUSTER_ADMIN_KEY", "from-the-secret")  # the proxy refuses 0.0.0.0 without one
    proxy_config, _ = parse_args(expand(container(deployments["pdcluster-proxy"])["args"]))
    assert proxy_config.host == "0.0.0.0" and proxy_config.admin_key == "from-the-secret"


def test_the_by_hand_commands_of_the_multi_host_guide_parse(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_runtime import cli
    from proxy.cli import parse_args

    text = DOC.read_text().replace("\\\n", " ")
    commands = [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith("python -m ")]
    assert [c[2] for c in commands] == ["proxy", "prefill_node", "decode_node"]
    monkeypatch.setenv("PDCLUSTER_ADMIN_KEY", "set-as-the-guide-says")
    for c in commands:
        argv = [str(tiny_model) if a == "/models/deepseek" else a for a in c[3:]]
        if c[2] == "proxy":
            config, _ = parse_args(argv)
            assert config.registry.url == "redis://10.0.0.1:6379/0"
        else:
            node, _ = cli.parse(c[2].removesuffix("_node"), argv)
            assert node.registry.url == "redis://10.0.0.1:6379/0" and node.advertise_host.startswith("10.0.0.")
