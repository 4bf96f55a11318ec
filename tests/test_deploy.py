"""The container and its replicas (Dockerfile, deploy/): what can be checked without a Docker daemon.

The image's command is run as it is (its port moved to a free one) and must serve; the compose file
and the Kubernetes manifest must run that same command, probe ``/health`` on its port and give the
SIGTERM drain more time than ``--drain-timeout``; the manifest must render with ``kubectl kustomize``
(no cluster needed) where kubectl is installed; every metric the Grafana dashboard reads must be one
the server exports. No image is built here (no daemon): docs/serving.md says what was not run.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serve import app
from serve.process import ServerProcess
from tests.tiny import TinyModel

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def dockerfile() -> dict[str, str]:
    """The Dockerfile's instructions (the last of each), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    instructions = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, rest = line.strip().partition(" ")
            instructions[name.upper()] = rest.strip()
    return instructions


def image_command() -> list[str]:
    return json.loads(dockerfile()["CMD"])


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def grace_seconds(duration: str) -> float:
    """Compose's durations: '45s', '1m30s'."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    return int(parts[1] or 0) * 60 + int(parts[2] or 0)


def test_the_image_runs_blocklab_serve_as_a_user_with_a_health_check():
    instructions, command = dockerfile(), image_command()
    assert command[:2] == ["blocklab", "serve"] and flag(command, "--host") == "0.0.0.0"
    assert instructions["EXPOSE"] == flag(command, "--port")
    assert instructions["USER"] not in ("root", "0")
    assert f"127.0.0.1:{flag(command, '--port')}/health" in instructions["HEALTHCHECK"]
    assert "-c requirements.lock" in instructions["RUN"]  # the pinned versions
    assert instructions["FROM"].startswith("python:3.11")  # the lock's Python (pyproject's [tool.uv])
    app.options(command[2:]).check()  # every flag of it is one blocklab serve takes


def test_compose_runs_replicas_of_that_command_behind_nginx():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    command, replicas = image_command(), compose["services"]["blocklab"]
    assert "command" not in replicas and "entrypoint" not in replicas  # the image's own command
    assert replicas["deploy"]["replicas"] >= 2
    assert "/health" in " ".join(replicas["healthcheck"]["test"])
    assert grace_seconds(replicas["stop_grace_period"]) > float(flag(command, "--drain-timeout"))
    assert replicas["stop_signal"] == dockerfile()["STOPSIGNAL"] == "SIGTERM"
    balancer = compose["services"]["nginx"]
    assert balancer["depends_on"]["blocklab"]["condition"] == "service_healthy"
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert f"blocklab:{flag(command, '--port')};" in nginx and "proxy_buffering off;" in nginx


def manifest() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "blocklab.yaml").read_text())}


def test_the_kubernetes_manifest_runs_that_command_with_probes_and_a_grace_period():
    command, docs = image_command(), manifest()
    deployment = docs["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == command
    assert deployment["spec"]["replicas"] >= 2
    port = int(flag(command, "--port"))
    assert {"name": "http", "containerPort": port} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(flag(command, "--drain-timeout"))
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert docs["Service"]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_manifest_renders_with_kubectl():
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered.stdout)}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget"}


def test_the_dashboard_reads_metrics_the_server_exports():
    client = TestClient(app.build(app.options([]), TinyModel()).app)  # nothing started
    exported = set()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
        exported |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    dashboard = json.loads((DEPLOY / "grafana" / "blocklab.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    read = {name for expr in expressions for name in re.findall(r"(?:vllm|blocklab):\w+", expr)}
    assert read and read <= exported, read - exported


@pytest.mark.slow
def test_the_image_command_serves():
    """The Dockerfile's CMD, as the container runs it (the builtin model, all interfaces), on a free port."""
    command = image_command()
    with ServerProcess(command[2:], host=None, startup_timeout=180) as server:  # --port: the free one
        answer = httpx.post(
            server.url + "/predict", json={"prompt": "def main(", "max_new_tokens": 2}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["tokens"]) == 2
