"""deploy/kubernetes/: every manifest validates against the Kubernetes API schemas (strict:
no unknown fields) with kubernetes-validate, for the oldest and newest Kubernetes versions it
ships schemas of that are still common; and the parts agree with each other and with Duet
(the ConfigMap's duet.toml is accepted by `duet-gateway config`, /dev/shm holds the arenas,
probes and Services name ports the pod has, the probes use the health endpoints)."""

import pathlib
import subprocess
import tempfile

import kubernetes_validate
import pytest
import yaml

from conftest import ROOT, gateway_binary

DIR = ROOT / "deploy" / "kubernetes"
VERSIONS = ["1.30.0", "1.37.0"]


def documents():
    docs = []
    for path in sorted(DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def binary_units(text):
    """Bytes of a Kubernetes quantity or a Duet size (16G, 17Gi, 48Gi)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    docs = documents()
    kinds = {doc["kind"] for _, doc in docs}
    assert {"Namespace", "ConfigMap", "StatefulSet", "Service", "Ingress", "PodDisruptionBudget"} <= kinds, kinds
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} is not valid for Kubernetes {version}: {e.message} at {list(e.path)}")


def test_the_parts_agree_with_each_other_and_with_duet():
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in documents()}
    sts = docs[("StatefulSet", "duet")]
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The configuration is Duet's: the gateway accepts every key.
    toml = docs[("ConfigMap", "duet-config")]["data"]["duet.toml"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(toml)
        f.flush()
        out = subprocess.run([str(gateway_binary()), "config", "--print", "--config", f.name],
                             capture_output=True, text=True)
    assert out.returncode == 0, f"duet-gateway refuses the ConfigMap's duet.toml: {out.stderr}"
    config = dict(line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)
    assert config["listen"].strip('"').endswith(f":{ports['grpc']}")
    assert config["http_listen"].strip('"').endswith(f":{ports['http']}")
    assert int(config["drain_grace_secs"]) + 30 < pod["spec"]["terminationGracePeriodSeconds"], \
        "the grace period covers the draining health and the running requests' drain"

    # /dev/shm holds the arenas, and the memory limit holds /dev/shm.
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "shm")
    assert mount["mountPath"] == "/dev/shm" and shm["emptyDir"]["medium"] == "Memory"
    arenas = int(config["cpu_workers"]) * binary_units(config["kv_bytes"].strip('"'))
    assert binary_units(shm["emptyDir"]["sizeLimit"]) >= arenas
    assert binary_units(container["resources"]["limits"]["memory"]) > binary_units(shm["emptyDir"]["sizeLimit"])

    # Guaranteed QoS with integer CPUs (the static CPU manager's exclusive cores) and a GPU.
    res = container["resources"]
    assert res["requests"] == res["limits"] and str(res["limits"]["cpu"]).isdigit()
    assert res["limits"]["nvidia.com/gpu"] == "1"

    # The probes use the health endpoints; liveness does not (a full KV cache or a drain is
    # no reason to restart).
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["grpc"]["port"] == ports["grpc"]
    assert "httpGet" not in container["livenessProbe"] and "grpc" not in container["livenessProbe"]

    # The Services select the pods and name their ports; the ingresses use the Service.
    for name in ("duet", "duet-nodes"):
        svc = docs[("Service", name)]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    assert sts["spec"]["serviceName"] == "duet-nodes"
    for name in ("duet-http", "duet-grpc"):
        ing = docs[("Ingress", name)]
        assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$duet_session_key"
        backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend["name"] == "duet" and backend["port"]["name"] in ports
    assert "$duet_session_key" in docs[("ConfigMap", "ingress-nginx-controller")]["data"]["http-snippet"]

    # The node's kubelet configuration: static CPU manager, single-NUMA-node topology.
    kubelet = yaml.safe_load((DIR / "kubelet" / "kubelet-config.yaml").read_text())
    assert kubelet["kind"] == "KubeletConfiguration"
    assert (kubelet["cpuManagerPolicy"], kubelet["topologyManagerPolicy"]) == ("static", "single-numa-node")
