"""The operator's credentials end to end: a bound token rotated and revoked under a running
operator, and a kubeconfig whose user is an exec credential plugin.

The sandbox's operator reads its ServiceAccount's token from ``DIR/operator-token`` (its
kubeconfig's ``tokenFile``), a token bound to a Secret, as a pod's projected token is bound to
the pod. Rotating it here is what the kubelet does: a new token where the old one was, then the
old one revoked (its Secret deleted, which the API server checks on every request).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import distributed
import pytest
import yaml
from memops_sandbox import install

from tests.e2e import audit
from tests.e2e.conftest import Sandbox, retirement_request
from tests.e2e.data import scatter_unique

CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
"""Where the API server's audit log names the token a request came with (``JTI=<jti>``)."""


def jti(token: str) -> str:
    claims = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))["jti"])


def credential_ids(sandbox: Sandbox, user: str, received_after: datetime.datetime | None = None) -> set[str]:
    """The tokens that ``user``'s requests (received after ``received_after``) came with.

    A watch that began before is left out: it goes on under the token it began with (the API
    server authenticates a request once, when it arrives), and is audited when it ends."""
    found: set[str] = set()
    for line in audit.lines(sandbox.audit_log):
        event = json.loads(line)
        if (event.get("user") or {}).get("username") != user:
            continue
        received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"])
        if received_after is None or received > received_after:
            found.update((event["user"].get("extra") or {}).get(CREDENTIAL_ID, []))
    return found


def account_of(user: str) -> str:
    """``memops`` of ``system:serviceaccount:memops-system:memops``."""
    return user.rsplit(":", 1)[1]


def retire_one(sandbox: Sandbox, name: str, pod: str) -> dict[str, Any]:
    sandbox.apply(retirement_request(name, scheduler={"address": sandbox.scheduler_address}, workers=[pod]))
    return finished(sandbox, name, pod)


def finished(sandbox: Sandbox, name: str, pod: str) -> dict[str, Any]:
    """The request's status once it has finished, which is to have retired ``pod`` and no other."""
    done = sandbox.wait_phase(name, "Succeeded", "Failed")
    status: dict[str, Any] = done["status"]
    assert status["phase"] == "Succeeded", status
    assert [(w["pod"], w["state"]) for w in status["workers"]] == [(pod, "Retired")], status
    return status


pytestmark = pytest.mark.owns_cluster(
    "it runs the operator as a process of its own, with credentials it rotates and revokes"
)


@pytest.mark.parametrize("where", ["token-file", "kubeconfig"])
def test_the_operator_keeps_working_when_its_bound_token_is_rotated_and_revoked(
    sandbox_factory: Any, where: str
) -> None:
    """The operator as a process of this machine (``memops run`` outside the cluster) on its
    ServiceAccount's kubeconfig. ``token-file``: its token in a file as a pod's is (the kubelet
    writes the new one there). ``kubeconfig``: a kubeconfig that holds the token itself, rewritten
    with the new one (Kopf read it again on a 401; memops did not)."""
    sandbox: Sandbox = sandbox_factory(4, operator=False)
    kubeconfig = sandbox.state_dir / "operator-kubeconfig"
    user = audit.kubeconfig_user(kubeconfig)
    token_file = sandbox.state_dir / install.TOKEN_FILE
    old = token_file.read_text()
    if where == "kubeconfig":
        install.write_token(kubeconfig, with_user(sandbox, user, {"token": old}))
    operator = sandbox.start_operator(process=True)
    assert operator is not None
    operator_pid = operator.pid
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 2))
        retire_one(sandbox, "before", pods[0])
        assert credential_ids(sandbox, user) == {f"JTI={jti(old)}"}

        # The kubelet's rotation: a new token where the old one was, then the old one revoked.
        secret = f"{install.TOKEN_SECRET}-2"
        sandbox.kubectl("create", "secret", "generic", secret, "-n", install.NAMESPACE)
        new = sandbox.kubectl(
            "create",
            "token",
            account_of(user),
            "-n",
            install.NAMESPACE,
            "--bound-object-kind=Secret",
            f"--bound-object-name={secret}",
            "--duration=1h",
        ).stdout.strip()
        if where == "token-file":
            install.write_token(token_file, new)
        else:
            install.write_token(kubeconfig, with_user(sandbox, user, {"token": new}))
        since = len(audit.lines(sandbox.audit_log))
        sandbox.kubectl("delete", "secret", install.TOKEN_SECRET, "-n", install.NAMESPACE)
        # A request under way while the API server comes to refuse the old token (it caches a
        # token's success for a few seconds): memops' own calls (claim, annotate, /scale, the
        # status mid-drain, events) and Kopf's meet the 401 wherever they are.
        sandbox.apply(retirement_request("after", scheduler={"address": sandbox.scheduler_address}, workers=[pods[1]]))

        probe = sandbox.state_dir / "revoked-kubeconfig"
        probe.write_text(with_user(sandbox, user, {"token": old}))

        def old_token_refused() -> bool:
            answer = sandbox.kubectl("--kubeconfig", str(probe), "get", "--raw", "/api", check=False)
            return answer.returncode != 0 and "Unauthorized" in answer.stderr

        sandbox.wait_for(old_token_refused, timeout=60, what="the API server to refuse the revoked token")
        revoked = datetime.datetime.now(datetime.UTC)
        finished(sandbox, "after", pods[1])
        # And one begun after it.
        retire_one(sandbox, "later", pods[2])
        holdings.assert_all_correct()

    assert sandbox.pods() == pods[3:] and sandbox.replicas() == 1
    os.kill(operator_pid, 0)  # still running: no restart
    assert operator.poll() is None
    log = sandbox.operator_log()
    # Each line without its time (whose milliseconds may read 401) and without the operator's own
    # access log (what its server answered, not what the API server answered it).
    said = [
        re.sub(r"^\S*\s*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", line)
        for line in log.splitlines()
        if "aiohttp.access" not in line
    ]
    assert not [line for line in said if re.search(r"\b401\b", line) or "Unauthorized" in line], (
        "no handler retried, nothing failed"
    )
    after = audit.requests(sandbox.audit_log, user, since=since)
    # memops' own requests (/scale, the status mid-drain) and Kopf's (its annotations on the
    # request), all with the new token, none refused (a refused one has no user: it is not here).
    assert ("apps", "deployments/scale", "patch", "default") in after, after
    assert ("memops.dev", "retirementrequests/status", "patch", "default") in after, after
    assert ("memops.dev", "retirementrequests", "patch", "default") in after, after
    assert credential_ids(sandbox, user, revoked) == {f"JTI={jti(new)}"}


def exec_plugin(directory: Path, token: str) -> Path:
    """An exec credential plugin (as ``aws eks get-token`` is one) that hands out ``token`` for an
    hour and counts its runs in ``DIR/plugin-runs``."""
    (directory / "plugin-token").write_text(token)
    script = directory / "credential-plugin"
    script.write_text(
        f"""#!{sys.executable}
import datetime, json, os, pathlib
here = pathlib.Path({str(directory)!r})
request = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert request["apiVersion"] == "client.authentication.k8s.io/v1", request
with (here / "plugin-runs").open("a") as runs:
    runs.write("run\\n")
expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
status = {{"token": (here / "plugin-token").read_text().strip()}}
status["expirationTimestamp"] = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}}))
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def with_user(sandbox: Sandbox, user: str, credentials: dict[str, Any]) -> str:
    """The operator's kubeconfig, its user's credentials replaced by ``credentials``."""
    config = yaml.safe_load((sandbox.state_dir / "operator-kubeconfig").read_text())
    (entry,) = config["users"]
    assert entry["name"] == user
    entry["user"] = credentials
    return yaml.safe_dump(config)


def test_memops_run_and_kubectl_log_in_through_an_exec_plugin(sandbox_factory: Any) -> None:
    sandbox: Sandbox = sandbox_factory(2, operator=False)
    user = audit.kubeconfig_user(sandbox.state_dir / "operator-kubeconfig")
    token = sandbox.kubectl("create", "token", account_of(user), "-n", install.NAMESPACE, "--duration=1h").stdout
    plugin = exec_plugin(sandbox.state_dir, token.strip())
    # The operator's kubeconfig, its token replaced by the plugin: `memops run` reads this one.
    exec_user = {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin), "interactiveMode": "Never"}
    (sandbox.state_dir / "operator-kubeconfig").write_text(with_user(sandbox, user, {"exec": exec_user}))
    since = len(audit.lines(sandbox.audit_log))
    sandbox.start_operator(process=True)
    pods = sandbox.pods()
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 2))
        retire_one(sandbox, "through-plugin", pods[0])
        holdings.assert_all_correct()
    assert audit.requests(sandbox.audit_log, user, since=since), "the operator's requests came as its account"
    assert credential_ids(sandbox, user) == {f"JTI={jti(token.strip())}"}
    runs = (sandbox.state_dir / "plugin-runs").read_text().splitlines()
    assert 1 <= len(runs) <= 2, "Kopf and memops share what the plugin gave, for the hour it is valid"
    assert sandbox.operator is not None and sandbox.operator.poll() is None
    assert "LoginError" not in sandbox.operator_log()

    # kubectl reads the same kubeconfig the same way.
    listed = sandbox.kubectl(
        "--kubeconfig", str(sandbox.state_dir / "operator-kubeconfig"), "get", "retirementrequests", "-A", "-o", "json"
    )
    assert [item["metadata"]["name"] for item in json.loads(listed.stdout)["items"]] == ["through-plugin"]
    assert len((sandbox.state_dir / "plugin-runs").read_text().splitlines()) == len(runs) + 1
