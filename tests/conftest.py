"""Suite-wide fixtures.

``audit_log``: every ``memops sandbox`` of the run appends its API requests to one audit log.
Sets ``$MEMOPS_AUDIT_LOG`` (unless it is already set) for the whole session, before any
sandbox starts; the sandboxes inherit it. ``tests/packaging/test_rbac.py``, which runs after
``tests/e2e``, reads the operator's requests from it and checks the shipped RBAC against them.

Two lanes (pytest-xdist, two workers; :class:`SandboxLane`): the first runs the tests that start
real Nodes of their own (one at a time: real Nodes are one set per machine), then most of the tests
in a namespace of the session's sandbox, which starts once those are done, then
``tests/packaging/test_rbac.py`` (it reads what ``tests/e2e`` wrote); the second runs the folders
that start no control plane (:data:`NO_SANDBOX`, while CI builds the sandbox's binaries on a cold
machine), then those that start a control plane but no real Node (:data:`PLANE_ONLY`), then the
rest of the shared tests (:data:`tests.e2e.lanes.LANE_B`) in the same sandbox. Without xdist
(``-n 0``) the same order in one process.

``plane``: an upstream control plane (kube-apiserver, etcd, the controller manager; no node),
one per test module that asks for it; its state directory is yielded. Nothing is mocked.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import build, upstream
from memops_sandbox import common as sandbox
from xdist.scheduler import LoadScopeScheduling

from tests.e2e import conftest as e2e
from tests.e2e import lanes as e2e_lanes

NO_SANDBOX = (
    "unit",
    "fuzz",
    "scheduler",
    "packaging/test_argocd.py",
    "packaging/test_helm.py",
    "packaging/test_image.py",
    "packaging/test_kustomize.py",
    "sandbox/test_build.py",
    "sandbox/test_image_store.py",
    "sandbox/test_install.py",
    "sandbox/test_nodeagent_net.py",
    "sandbox/test_nodeagent_volumes.py",
)
"""The test folders and files that start no control plane: they run first, so that CI can build
the sandbox's binaries meanwhile (a test that needs them waits for the build's lock)."""
PLANE_ONLY = (
    "controllers",
    "sandbox/test_controlplane.py",
    "sandbox/test_credentials.py",
    "sandbox/test_nodeagent.py",
    "sandbox/test_upstream_sandbox.py",
    "e2e/test_node_agent.py",
)
"""The test folders and files that start a control plane but no real Node (the ``plane`` fixture:
etcd, kube-apiserver and the controller manager on free ports of the loopback, a state directory of
their own; or a sandbox of the node agent's process Nodes, whose pods have loopback addresses):
they may run beside a sandbox of real Nodes, so they go to the other lane, after
:data:`NO_SANDBOX`. Real Nodes are one set per machine (bridges, cgroup root, kube-proxy's rules)."""


TESTS = Path(__file__).resolve().parent


def _kind(path: Path) -> int:
    """0: no control plane (:data:`NO_SANDBOX`); 1: a control plane only (:data:`PLANE_ONLY`); 2: the
    rest, which may start real Nodes."""
    path = path.resolve()
    if not path.is_relative_to(TESTS):
        return 2
    inside = path.relative_to(TESTS)
    if any(inside.is_relative_to(free) for free in NO_SANDBOX):
        return 0
    return 1 if any(inside.is_relative_to(plane) for plane in PLANE_ONLY) else 2


def _owns(item: pytest.Item) -> bool:
    """An end-to-end test that starts real Nodes of its own (``owns_cluster``)."""
    path = Path(str(item.fspath)).resolve()
    return _kind(path) == 2 and path.is_relative_to(TESTS / "e2e") and not e2e.shares_the_cluster(item)


def _order(item: pytest.Item, lanes: int) -> int:
    kind = _kind(Path(str(item.fspath)))
    if kind == 0:
        return 0
    if _owns(item):
        # The first lane's first: while the second runs the tests that need no real Node, and
        # before the session's sandbox starts (real Nodes are one set per machine).
        return 1
    if kind == 1:
        # The second lane's, after the tests that start no control plane: beside the first lane's
        # real Nodes, while the second lane's shared tests could not start yet.
        return 2
    if not e2e.shares_the_cluster(item):
        return 5  # what reads the session's audit log (test_rbac.py), once the sandbox has stopped
    return 3 if e2e_lanes.in_lane_b(str(item.fspath), lanes) else 4


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each group keeps its order.
    count = e2e_lanes.lanes(config)
    items.sort(key=lambda item: _order(item, count))
    owners = any(_owns(item) for item in items)
    e2e.CLUSTER.plan(config, config._tmp_path_factory, items, owners=owners)  # type: ignore[attr-defined]


class SandboxLane(LoadScopeScheduling):
    """xdist's scope scheduling with two scopes where there are two workers: the first lane's (every
    test that starts real Nodes of its own, then the shared tests not in
    :data:`tests.e2e.lanes.LANE_B`, then ``test_rbac.py``), and the second's (the tests that start no
    sandbox, those that start a control plane only, then :data:`tests.e2e.lanes.LANE_B`'s). Each
    worker takes one; both use the session's sandbox meanwhile. With one worker, as before: the
    sandbox's tests in one scope, every other test a scope of its own."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        kind = _kind(TESTS.parent / module)
        if self.numnodes > 1:
            second = kind < 2 or e2e_lanes.in_lane_b(module, self.numnodes)
            return "second lane" if second else "sandbox"
        if kind == 2:
            return "sandbox"
        # A module's tests together: a control plane per module (the ``plane`` fixture's scope).
        return module if kind == 1 else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called where it runs the tests
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SandboxLane:
    return SandboxLane(config, log)


_BUILT = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Before the first test that needs a control plane (the control plane's binaries), and the
    first that may start real Nodes (theirs and the images too), outside every test's timeout
    (this wrapper runs before pytest-timeout's), wait for what the sandbox runs: CI builds it
    beside the tests that need none, and a cold build can outlast them. A build that fails here is
    left to the fixtures, which skip or fail with its reason."""
    kind = _kind(Path(str(item.fspath)))
    shared = kind == 2 and e2e.shares_the_cluster(item)
    if _owns(item):
        e2e.CLUSTER.own()
    else:
        e2e.CLUSTER.owners_done()  # a no-op unless this lane ran tests that own the cluster
    if shared:
        assert e2e.CLUSTER.session is not None
        # The other lane's tests that own the cluster may still run (on a cold machine they start
        # after the build): waited for here, not in the test's time.
        e2e.CLUSTER.session.wait_owners()
        e2e.CLUSTER.enter(item, nextitem)
    elif not _owns(item):
        e2e.CLUSTER.leave()  # this lane's shared tests are done (a no-op until it ran one)
        if kind == 2:
            e2e.CLUSTER.release()  # the session's sandbox has stopped: every lane's shared tests are done
    if kind > item.session.stash.get(_BUILT, 0):
        item.session.stash[_BUILT] = kind
        sandbox.built(real_nodes=kind == 2)
    if not shared:
        return (yield)
    assert e2e.CLUSTER.session is not None
    with e2e.CLUSTER.session.running(quiet=item.get_closest_marker("quiet") is not None):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's audit log (it may not exist yet: no sandbox has started)."""
    preset = os.environ.get(sandbox.AUDIT_LOG_ENV)
    # One for both lanes: the session's sandbox, which either may start, appends to it.
    path = Path(preset) if preset else e2e_lanes.shared_directory(tmp_path_factory) / "api-audit.jsonl"
    os.environ[sandbox.AUDIT_LOG_ENV] = str(path)
    try:
        yield path
    finally:
        if preset is None:
            os.environ.pop(sandbox.AUDIT_LOG_ENV, None)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The control plane's state directory (its admin kubeconfig is ``kubeconfig``); skipped, with
    the reason, where its binaries cannot be built."""
    try:
        build.ensure()
    except build.BuildError as error:
        pytest.skip(f"the control plane's binaries cannot be built here: {error}")
    state_dir = tmp_path_factory.mktemp("plane") / "plane"
    process = upstream.launch_plane(state_dir)
    try:
        yield state_dir
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
