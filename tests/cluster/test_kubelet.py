"""The local kubelet runs pods as real processes: env, restarts, preStop, SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from memops.cluster import kubelet, memstore
from memops.cluster.apiserver import BUILTIN_KINDS


@pytest.mark.parametrize(
    ("text", "variables", "expected"),
    [
        pytest.param("--name $(POD)", {"POD": "w-1"}, "--name w-1", id="expand"),
        pytest.param("$$(POD)", {"POD": "w-1"}, "$(POD)", id="escape"),
        pytest.param("$(MISSING)", {}, "$(MISSING)", id="unknown-stays"),
    ],
)
def test_expand(text: str, variables: dict[str, str], expected: str) -> None:
    assert kubelet.expand(text, variables) == expected


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[memstore.MemoryStore, kubelet.Kubelet]]:
    store = memstore.MemoryStore()
    for kind in BUILTIN_KINDS:
        store.register(kind)
    local = kubelet.Kubelet(store, run_dir=tmp_path)
    task = asyncio.create_task(local.run())
    yield store, local
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def python_pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "c",
        "command": [sys.executable, "-c", code],
        "env": [
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hello $(ME)"},
        ],
        **spec.pop("container", {}),
    }
    return {"metadata": {"name": name}, "spec": {"containers": [container], **spec}}


async def wait_for(predicate: Any, timeout: float = 10) -> Any:
    async with asyncio.timeout(timeout):
        while not (value := predicate()):
            await asyncio.sleep(0.02)
        return value


async def test_runs_the_container_with_its_env_and_reports_ready(node: Any, tmp_path: Path) -> None:
    store, _ = node
    await store.create(
        "pods", "default", python_pod("p", "import os,time; print(os.environ['GREETING'], flush=True); time.sleep(60)")
    )
    log = tmp_path / "pods" / "default_p.log"
    await wait_for(lambda: log.exists() and "hello p" in log.read_text())
    pod = await wait_for(
        lambda: (p := store.get("pods", "default", "p")) and p["status"].get("phase") == "Running" and p
    )
    await wait_for(
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in store.get("pods", "default", "p")["status"]["conditions"]
        )
    )
    assert pod["spec"]["nodeName"] == "local"


async def test_restarts_an_exited_container(node: Any) -> None:
    store, _ = node
    await store.create("pods", "default", python_pod("p", "raise SystemExit(3)"))

    def restarts() -> int:
        statuses = store.get("pods", "default", "p").get("status", {}).get("containerStatuses", [{}])
        return int(statuses[0].get("restartCount", 0))

    await wait_for(lambda: restarts() >= 1)


async def test_deletion_runs_prestop_then_sigterm_then_sigkill(node: Any, tmp_path: Path) -> None:
    store, _ = node
    marker = tmp_path / "prestop-ran"
    code = "import signal,time; signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True)); time.sleep(60)"
    body = python_pod(
        "p",
        code,
        terminationGracePeriodSeconds=1,
        container={
            "lifecycle": {"preStop": {"exec": {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}}}
        },
    )
    await store.create("pods", "default", body)
    await wait_for(lambda: (tmp_path / "pods" / "default_p.pid").exists())
    await asyncio.sleep(0.3)  # let the interpreter install its handler
    started = time.monotonic()
    await store.delete("pods", "default", "p")
    assert store.get("pods", "default", "p")["metadata"]["deletionTimestamp"]
    await wait_for(lambda: store.get("pods", "default", "p") is None, timeout=10)
    elapsed = time.monotonic() - started
    assert marker.exists(), "the preStop hook ran"
    assert "TERM" in (tmp_path / "pods" / "default_p.log").read_text(), "SIGTERM came first"
    assert 0.9 < elapsed < 5, "SIGKILL came when the grace period ran out"


async def test_shutdown_stops_every_container_at_once_and_restarts_none(tmp_path: Path) -> None:
    """A node shutdown: every container gets SIGTERM together, and one that exits is not started
    again (its supervisor would otherwise restart it, and the shutdown wait on the new one)."""
    store = memstore.MemoryStore()
    for kind in BUILTIN_KINDS:
        store.register(kind)
    local = kubelet.Kubelet(store, run_dir=tmp_path)
    task = asyncio.create_task(local.run())
    slow = (
        "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), sys.exit(0)));"
        " time.sleep(60)"
    )
    names = [f"p{i}" for i in range(6)]
    for name in names:
        # The first takes 2 s to stop; the others exit at once on SIGTERM, and meanwhile must stay down.
        code = slow if name == "p0" else "import time; time.sleep(60)"
        await store.create("pods", "default", python_pod(name, code))
    pid_files = [tmp_path / "pods" / f"default_{name}.pid" for name in names]
    await wait_for(lambda: all(f.exists() for f in pid_files))
    pids = [int(f.read_text()) for f in pid_files]
    await asyncio.sleep(0.5)  # let the first install its handler
    started = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        async with asyncio.timeout(8):  # a restarted container would cost a 10 s grace period
            await task
    assert time.monotonic() - started < 5, "SIGTERM to all at once, not one grace period after another"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    await asyncio.sleep(1)  # a restart would come 0.5 s after an exit
    assert [int((tmp_path / "pods" / f"default_{name}.pid").read_text()) for name in names] == pids, "none restarted"


def test_env_from_a_secret_key_is_decoded_and_a_missing_key_fails_the_start() -> None:
    pod = {"metadata": {"name": "p", "namespace": "default"}}
    secret = {"data": {"ca.crt": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()}}
    container = {"env": [{"name": "CA", "valueFrom": {"secretKeyRef": {"name": "tls", "key": "ca.crt"}}}]}
    assert kubelet.container_env(pod, container, lambda name: secret if name == "tls" else None) == {
        "CA": "-----BEGIN CERTIFICATE-----\n"
    }
    missing = {"env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "tls", "key": "tls.key"}}}]}
    with pytest.raises(ValueError, match=r"has no key 'tls\.key'"):
        kubelet.container_env(pod, missing, lambda name: secret)


async def test_each_pod_gets_its_own_ip_before_its_container_starts(node: Any, tmp_path: Path) -> None:
    """As on a cluster: status.podIP is set before the container runs (fieldRef status.podIP
    sees it), two pods never share one, and a deleted pod's IP is not handed out again at once."""
    store, local = node
    serve = (
        "import os,socket,time; s=socket.socket(); s.bind((os.environ['IP'], 0)); s.listen();"
        " print('bound', os.environ['IP'], flush=True); time.sleep(60)"
    )
    ip_env = {"env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}
    for name in ("a", "b"):
        await store.create("pods", "default", python_pod(name, serve, container=ip_env))
    ips = {}
    for name in ("a", "b"):
        log = tmp_path / "pods" / f"default_{name}.log"
        await wait_for(lambda: log.exists() and "bound" in log.read_text())  # noqa: B023
        pod = store.get("pods", "default", name)
        ips[name] = pod["status"]["podIP"]
        assert pod["status"]["podIPs"] == [{"ip": ips[name]}]
        assert f"bound {ips[name]}" in log.read_text(), "the container listened on its own pod IP"
    assert ips["a"] != ips["b"] and all(ip.startswith("127.1.") for ip in ips.values())
    await store.delete("pods", "default", "a", grace_period_seconds=0)
    await wait_for(lambda: ips["a"] not in local.ips_in_use)
    assert local.allocate_ip() not in ips.values()


@pytest.fixture
async def node_with_env(tmp_path: Path) -> AsyncIterator[tuple[memstore.MemoryStore, kubelet.Kubelet]]:
    """A node whose containers get an environment of their own (as an image's ENV would give)."""
    store = memstore.MemoryStore()
    for kind in BUILTIN_KINDS:
        store.register(kind)
    local = kubelet.Kubelet(store, run_dir=tmp_path, env={"FROM_THE_IMAGE": "only-in-the-container"})
    task = asyncio.create_task(local.run())
    yield store, local
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def dump_env(path: Path) -> str:
    return f"import json,os; open({str(path)!r}, 'w').write(json.dumps(dict(os.environ)))"


async def test_prestop_hook_and_probe_run_with_exactly_the_containers_environment(
    node_with_env: Any, tmp_path: Path
) -> None:
    """The hook execs in the container: same variables, same PATH (so a bare ``python`` is the
    container's), not the node agent's environment."""
    store, _ = node_with_env
    container_env, hook_env = tmp_path / "container.json", tmp_path / "hook.json"
    body = python_pod(
        "p",
        dump_env(container_env) + "; import time; time.sleep(60)",
        terminationGracePeriodSeconds=5,
        container={
            # A bare name, resolved on the container's PATH; the probe passes only where the
            # container's own variable is set.
            "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", dump_env(hook_env)]}}},
            "readinessProbe": {
                "exec": {"command": ["python", "-c", "import os; assert os.environ['FROM_THE_IMAGE']"]},
                "periodSeconds": 0.2,
            },
        },
    )
    await store.create("pods", "default", body)
    await wait_for(
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in store.get("pods", "default", "p").get("status", {}).get("conditions", [])
        )
    )
    await store.delete("pods", "default", "p")
    await wait_for(lambda: store.get("pods", "default", "p") is None, timeout=10)
    seen = json.loads(hook_env.read_text())
    assert seen == json.loads(container_env.read_text())
    assert seen["FROM_THE_IMAGE"] == "only-in-the-container"
    assert not store.list("events", "default"), "a hook that succeeds is not reported"


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["python", "-c", "raise SystemExit(1)"], id="exits-non-zero"),
        pytest.param(["memops-no-such-command"], id="cannot-start"),
    ],
)
async def test_a_failed_prestop_hook_is_an_event_and_the_grace_period_still_applies(
    node: Any, tmp_path: Path, command: list[str]
) -> None:
    store, _ = node
    # The container ignores SIGTERM: only SIGKILL at the end of the grace period stops it.
    code = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    body = python_pod(
        "p", code, terminationGracePeriodSeconds=3, container={"lifecycle": {"preStop": {"exec": {"command": command}}}}
    )
    created = await store.create("pods", "default", body)
    await wait_for(lambda: (tmp_path / "pods" / "default_p.pid").exists())
    await asyncio.sleep(0.3)  # let the interpreter install its handler
    started = time.monotonic()
    await store.delete("pods", "default", "p")
    events = await wait_for(lambda: store.list("events", "default"))
    assert store.get("pods", "default", "p") is not None, "the event comes while the pod terminates"
    await wait_for(lambda: store.get("pods", "default", "p") is None, timeout=10)
    assert time.monotonic() - started > 2.5, "a failed hook does not shorten the grace period"
    [event] = events
    assert (event["type"], event["reason"], event["message"]) == ("Warning", "FailedPreStopHook", "PreStopHook failed")
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "default",
        "name": "p",
        "uid": created["metadata"]["uid"],
        "fieldPath": "spec.containers{c}",
    }
    assert event["source"] == {"component": "kubelet", "host": "local"}
