"""Issue F (part): the deploy/ manifests load and carry what their tools require, with no secret
in any file and every site-specific value marked. The Ray cluster-launcher YAML is checked with
Ray's own schema (offline); KubeRay has no schema in any Python package, so its required fields
are checked here by hand, after the ray.io/v1 API reference."""

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _load(name):
    return yaml.safe_load((DEPLOY / name).read_text())


def _load_all(name):
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def test_ray_cluster_launcher_yaml_passes_rays_schema_and_is_secure_by_default():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = _load("ray-cluster.yaml")
    validate_config(prepare_config(copy.deepcopy(cfg)))  # Ray's ray-schema.json and its own consistency checks
    bad = copy.deepcopy(cfg)
    bad["available_node_types"]["gpu_worker"]["bogus"] = 1
    with pytest.raises(Exception, match="bogus"):
        validate_config(prepare_config(bad))  # the check has teeth
    gpu = cfg["available_node_types"]["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1 and cfg["head_node_type"] == "head"
    head = " ".join(cfg["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head and "--dashboard-host=127.0.0.1" in head
    assert all("RAY_AUTH_MODE=token" in c for c in cfg["worker_start_ray_commands"] if "ray start" in c)
    for key in ("head_setup_commands", "worker_setup_commands"):  # the token: never readable by others
        assert any(c.startswith("umask 077 && ") and "auth_token" in c for c in cfg[key])
        assert any("chmod 600 ~/.ray/auth_token" in c for c in cfg[key])
    # Nothing open to the outside: no public addresses, and a security group made beforehand on
    # every node type. A group the launcher makes itself gets SSH from 0.0.0.0/0 (Ray 2.60,
    # ray/autoscaler/_private/aws/config.py: _create_default_ssh_inbound_rules), whatever
    # provider.security_group.IpPermissions says; the launcher makes none where every node type
    # names its SecurityGroupIds (_configure_security_group).
    assert cfg["provider"]["use_internal_ips"] is True and "security_group" not in cfg["provider"]
    for node_type in cfg["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"] and node_type["node_config"]["SubnetIds"]
    # The jobs' environment (tracking server, credentials, shared storage) is on every node, from
    # a file only its owner reads, and reaches the workers through `ray start`.
    setup = " ".join(cfg["setup_commands"])
    assert "umask 077 && " in setup and "job.env" in setup and "DP_STORAGE_PATH=/mnt/dp_runs" in setup
    for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        assert "ray start" not in c or "set -a && . ~/.dp-platform/job.env && set +a && " in c


def _check_pod_template(template, gpu: bool):
    containers = template["spec"]["containers"]
    assert containers and all(c["name"] and c["image"] for c in containers)
    for c in containers:
        res = c["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
        if gpu:
            assert (
                int(res["limits"]["nvidia.com/gpu"]) >= 1
                and res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"]
            )


def _check_ray_cluster_spec(spec):
    assert spec["rayVersion"].startswith("2.")
    assert spec["authOptions"] == {"mode": "token", "secretName": "ray-auth-token"}
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict) and head["serviceType"] == "ClusterIP"
    _check_pod_template(head["template"], gpu=False)
    groups = spec["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert g["groupName"] and isinstance(g["rayStartParams"], dict)
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        _check_pod_template(g["template"], gpu=True)
        assert any(t["key"] == "nvidia.com/gpu" for t in g["template"]["spec"]["tolerations"])


def test_kuberay_raycluster_has_a_gpu_worker_group_and_token_auth():
    doc = _load("kuberay/raycluster.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster") and doc["metadata"]["name"]
    _check_ray_cluster_spec(doc["spec"])
    assert doc["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"  # port-forward only


def test_kuberay_rayjob_runs_the_training_entrypoint_on_its_own_cluster():
    doc = _load("kuberay/rayjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    spec = doc["spec"]
    _check_ray_cluster_spec(spec["rayClusterSpec"])
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] == 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env["env_vars"], dict)
    # The entrypoint is a valid training command: its config file exists and every flag parses and validates.
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "pipelines.train"]
    from pipelines.config import load_config
    from pipelines.train import build_parser

    args = vars(build_parser().parse_args(argv[3:]))
    path = args.pop("config")
    args.pop("resume")
    assert (CONFIGS.parent / path).is_file()
    load_config(CONFIGS.parent / path, args).validate()


def _pod_templates(doc) -> list[tuple[str, dict]]:
    """(role, pod template) of every pod a RayCluster or RayJob manifest makes."""
    spec = doc["spec"]
    out = []
    if doc["kind"] == "RayJob":
        out.append(("submitter", spec["submitterPodTemplate"]))
        spec = spec["rayClusterSpec"]
    out.append(("head", spec["headGroupSpec"]["template"]))
    out += [("worker", g["template"]) for g in spec["workerGroupSpecs"]]
    return out


def _walk(obj):
    yield obj
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    for child in children:
        yield from _walk(child)


def test_ray_pods_run_unprivileged_and_only_the_autoscaling_head_holds_an_api_token():
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        doc = _load(name)
        for node in _walk(doc):
            if isinstance(node, dict):
                assert not node.get("hostNetwork") and not node.get("privileged") and not node.get("hostPID"), name
        for role, template in _pod_templates(doc):
            pod = template["spec"]
            sec = pod["securityContext"]
            assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0, (name, role)
            assert sec["seccompProfile"] == {"type": "RuntimeDefault"}, (name, role)
            for c in pod["containers"]:
                assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
                assert {"cpu", "memory"} <= set(c["resources"]["limits"]), (name, role)
            # the in-tree autoscaler (a sidecar KubeRay adds to the head) needs the Kubernetes API
            autoscaled = doc["kind"] == "RayCluster" and doc["spec"].get("enableInTreeAutoscaling") and role == "head"
            assert pod.get("automountServiceAccountToken", True) is bool(autoscaled), (name, role)
    job = yaml.safe_load(_load("kuberay/rayjob.yaml")["spec"]["runtimeEnvYAML"])
    assert "working_dir" not in job  # the code is the image's: nothing fetched at run time from a tag


def test_network_policies_fence_each_clusters_pods_and_the_metadata_service():
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["dp-platform/ray-cluster"]: p
        for p in _load_all("kuberay/networkpolicy.yaml")
    }
    clusters = {"kuberay/raycluster.yaml": "dp-platform", "kuberay/rayjob.yaml": "dp-train"}
    assert set(policies) == set(clusters.values())
    for name, cluster in clusters.items():  # every Ray pod carries the label its policy selects
        for role, template in _pod_templates(_load(name)):
            labels = template["metadata"]["labels"]
            if role == "submitter":
                assert labels == {"dp-platform/ray-job-submitter": cluster}
            else:
                assert labels["dp-platform/ray-cluster"] == cluster, (name, role)
    for cluster, doc in policies.items():
        assert (doc["apiVersion"], doc["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
        spec = doc["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        for rule in spec["ingress"]:
            if "ports" in rule:  # from outside the cluster: the Jobs API only
                assert [p["port"] for p in rule["ports"]] == [8265], cluster
                for peer in rule["from"]:
                    assert peer.get("namespaceSelector") or peer.get("podSelector"), cluster  # never everyone
                    assert peer.get("namespaceSelector") != {} and peer.get("podSelector") != {}, cluster
            else:  # every port: this cluster's own pods, and nobody else
                assert rule["from"] == [{"podSelector": {"matchLabels": {"dp-platform/ray-cluster": cluster}}}]
        blocks = [peer["ipBlock"] for rule in spec["egress"] for peer in rule["to"] if "ipBlock" in peer]
        assert blocks and all("169.254.169.254/32" in b.get("except", []) for b in blocks), cluster


def test_no_secret_in_any_deploy_or_config_file_and_site_values_are_marked():
    files = [
        p
        for p in list(DEPLOY.rglob("*")) + list(CONFIGS.rglob("*"))
        if p.is_file() and p.suffix in (".yaml", ".yml", ".ini", ".conf", ".env", ".sh")
    ]
    assert len(files) >= 4
    secretish = re.compile(
        r"(password|passwd|secret_key|token)\s*[:=]\s*['\"]?(?!\$|\.\.\.|<|\{)[A-Za-z0-9+/_\-]{8,}|AKIA[0-9A-Z]{16}|postgresql(\+\w+)?://[^:\s/@]+:[^@\s$]+@",
        re.IGNORECASE,
    )
    for leak in (
        "password: hunter2hunter2",
        "MLFLOW_TRACKING_PASSWORD=s3cretvalue",
        "postgresql://dp:s3cret@db:5432/mlflow",
        "postgresql+psycopg2://dp:s3cret@db/mlflow",
        "aws_key AKIAABCDEFGHIJKLMNOP",
        'token: "f0e1d2c3b4a59687"',
    ):
        assert secretish.search(leak), leak  # the scan has teeth
    for fine in (
        "--from-literal=MLFLOW_TRACKING_PASSWORD=...",
        "secretName: ray-auth-token",
        "postgresql://dp@127.0.0.1:5432/x",
        "postgresql+psycopg2://mlflow@/mlflow?host=/var/run/postgresql",
    ):
        assert not secretish.search(fine), fine
    secret_name = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|_KEY$|CREDENTIAL", re.IGNORECASE)

    def literal_secrets(docs) -> list[str]:  # Kubernetes env entries that carry a value in the file
        return [
            node["name"]
            for doc in docs
            for node in _walk(doc)
            if isinstance(node, dict) and "value" in node and secret_name.search(str(node.get("name", "")))
        ]

    assert literal_secrets([{"env": [{"name": "MLFLOW_TRACKING_PASSWORD", "value": "s3cretvalue123"}]}])  # teeth
    assert literal_secrets([{"env": [{"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}]}])
    assert not literal_secrets([{"env": [{"name": "MLFLOW_TRACKING_URI", "value": "https://m"}]}])
    for f in files:
        text = f.read_text()
        assert not secretish.search(text), f"{f}: {secretish.search(text).group(0)}"
        if f.suffix in (".yaml", ".yml"):
            assert not literal_secrets(yaml.safe_load_all(text)), f"{f}: {literal_secrets(yaml.safe_load_all(text))}"
        if f.parent.name != "configs":
            assert "SITE" in text, f"{f} marks no site-specific value"


def test_the_shipped_training_config_is_the_main_job():
    from pipelines.config import TrainConfig, load_config

    cfg = load_config(CONFIGS / "digits.yaml")
    cfg.validate()
    default = TrainConfig()
    for key in ("dataset", "model", "lot_size", "epochs", "target_epsilon", "target_delta", "clip_norm", "num_workers"):
        assert getattr(cfg, key) == getattr(default, key), key


def test_mlflow_server_script_needs_its_secrets_from_the_environment_and_binds_loopback(tmp_path):
    import os
    import subprocess

    script = DEPLOY / "mlflow" / "mlflow-server.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode != 0 and "MLFLOW_AUTH_ADMIN_PASSWORD" in res.stderr
    text = script.read_text()
    assert '--host "${MLFLOW_HOST:-127.0.0.1}"' in text and "--app-name basic-auth" in text
    import configparser

    ini = configparser.ConfigParser()
    ini.read(DEPLOY / "mlflow" / "basic_auth.ini")
    assert ini["mlflow"]["database_uri"].startswith("postgresql") and "admin_password" not in ini["mlflow"]
    assert ini["mlflow"]["default_permission"] == "NO_PERMISSIONS"  # no account reads another team's runs
    storage = yaml.safe_load((DEPLOY / "optuna.yaml").read_text())["storage"]
    assert storage.startswith("postgresql") and "@" in storage and ":" not in storage.split("://", 1)[1].split("@")[0]
