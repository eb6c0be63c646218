"""The Kubernetes and KServe manifests of docs/scale-out.md fit the server they deploy.

Every fenced ``yaml`` block of the page is parsed as Kubernetes does (``yaml.safe_load_all``).
For each container of the image the root ``Dockerfile`` builds: its ``args`` are valid
``llmserve serve`` arguments, it listens on the port its probes, Prometheus annotations,
Service and InferencePool name, and every probe and scrape path answers 200 on a server
started with those arguments (the echo backend stands in for the model).
"""

from __future__ import annotations

import re
import pytest
import yaml

from conftest import ROOT, run_cli

PAGE = ROOT / "docs" / "scale-out.md"
YAML_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)


def manifests() -> list[dict]:
    docs = []
    for block in YAML_BLOCK.findall(PAGE.read_text()):
        docs.extend(d for d in yaml.safe_load_all(block) if d)
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in manifests() if d["kind"] == kind]


def dockerfile() -> tuple[list[str], int]:
    """The image's entrypoint and the port it exposes."""
    text = (ROOT / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    exposed = re.search(r"^EXPOSE\s+(\d+)\s*$", text, re.M)
    assert entrypoint and exposed, "the Dockerfile names its ENTRYPOINT and EXPOSEs a port"
    return yaml.safe_load(entrypoint.group(1)), int(exposed.group(1))


def serve_args(container: dict) -> list[str]:
    """What the container runs: the image's ENTRYPOINT (``llmserve serve --host 0.0.0.0``) + args."""
    entrypoint, _ = dockerfile()
    assert "command" not in container, "the containers keep the image's entrypoint"
    assert entrypoint[:2] == ["llmserve", "serve"]
    return [*entrypoint[2:], *[str(a) for a in container.get("args", [])]]


def listening_port(args: list[str]) -> int:
    for i, arg in enumerate(args):
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
        if arg == "--port":
            return int(args[i + 1])
    return dockerfile()[1]  # the server's default port is the one the image exposes


def containers() -> list[tuple[str, dict, dict]]:
    """(manifest kind, the pod-level annotations, container) for every llmserve container."""
    out = []
    for doc in manifests():
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]
            out += [("Deployment", pod["metadata"].get("annotations", {}), c) for c in pod["spec"]["containers"]]
        elif doc["kind"] == "ClusterServingRuntime":
            out += [("ClusterServingRuntime", doc["spec"].get("annotations", {}), c) for c in doc["spec"]["containers"]]
    return out


def test_the_page_has_the_manifests():
    kinds = {d["kind"] for d in manifests()}
    assert {"Deployment", "Service", "ClusterServingRuntime", "InferenceService", "InferencePool",
            "HTTPRoute"} <= kinds, kinds
    assert len(containers()) == 2


@pytest.mark.parametrize("kind", ["Deployment", "ClusterServingRuntime"])
def test_container_args_are_valid_serve_flags(kind):
    for where, _, container in containers():
        if where != kind:
            continue
        entrypoint, _ = dockerfile()
        args = [str(a) for a in container.get("args", [])]
        if args and not args[0].startswith("-"):
            args = ["--model", *args]  # `config show` takes serve's MODEL argument as --model
        args = [*entrypoint[2:], *args]
        result = run_cli("config", "show", "--json", *args)
        assert result.returncode == 0, (kind, args, result.stderr)


def check_port(container: dict, port: object, where: str) -> None:
    """``port`` (a number or a port name) is the port the server listens on."""
    listening = listening_port(serve_args(container))
    declared = {p["containerPort"]: p.get("name") for p in container["ports"]}
    assert listening in declared, (where, listening, declared)
    assert port in (listening, declared[listening]) or str(port) == str(listening), (where, port, listening)


def test_probes_and_scrape_target_the_listening_port():
    for kind, notes, container in containers():
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, (kind, probe)
            check_port(container, container[probe]["httpGet"]["port"], f"{kind} {probe}")
        port = notes.get("prometheus.io/port") or notes.get("prometheus.kserve.io/port")
        assert port is not None, (kind, "no Prometheus port annotation")
        check_port(container, port, f"{kind} Prometheus annotation")


def test_service_and_pool_reach_the_deployment():
    (deployment,) = by_kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in by_kind("Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            check_port(container, port["targetPort"], "Service targetPort")
    for pool in by_kind("InferencePool"):
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for port in pool["spec"]["targetPorts"]:
            check_port(container, port["number"], "InferencePool targetPorts")
    (route,) = by_kind("HTTPRoute")
    pools = {p["metadata"]["name"] for p in by_kind("InferencePool")}
    assert {ref["name"] for rule in route["spec"]["rules"] for ref in rule["backendRefs"]} <= pools


def test_inference_service_uses_the_runtime():
    (runtime,) = by_kind("ClusterServingRuntime")
    (service,) = by_kind("InferenceService")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}


def test_probe_and_scrape_paths_answer_on_the_server(echo_app):
    """Each path the manifests probe or scrape answers 200 on a server given the same flags."""
    client, _ = echo_app()
    paths = set()
    for _, notes, container in containers():
        paths |= {container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
        paths.add(notes.get("prometheus.io/path") or notes["prometheus.kserve.io/path"])
    assert {"/health", "/ready", "/metrics"} <= paths
    for path in sorted(paths):
        assert client.get(path).status_code == 200, path
    assert client.get("/healthz").status_code == 404  # a path the server lacks would be caught

