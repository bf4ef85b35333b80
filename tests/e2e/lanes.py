"""Two lanes, one session sandbox: what the suite's two pytest-xdist workers share across processes.

The tests that run in a namespace of the session's sandbox are split in two groups by module
(:data:`LANE_B`): each worker runs one group, both in the one sandbox, which the first to need it
starts and the other attaches to (its state directory and pid in ``session.json``), once the
tests that own the cluster are done: they run first, in the first lane, while the second runs the
tests that need no real Node (real Nodes are one set per machine). Each worker says when its group
is done; the one that says it last stops the sandbox; the tests that read what the sandbox wrote
(``tests/packaging/test_rbac.py``) wait until then. Without xdist, or with one worker, there is
one group.

A test marked ``quiet`` has the sandbox to itself: every test of the session's sandbox holds
``tests.lock`` shared for its setup, call and teardown (and a spare namespace for its start), a
quiet test holds it exclusively; a turnstile keeps a quiet test from waiting behind the other
lane's next tests for ever.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

LANE_B = (
    "test_hpa.py",
    "test_metrics.py",
    "test_placement.py",
    "test_pods.py",
    "test_refusals.py",
    "test_replication.py",
    "test_safety_net.py",
    "test_tenancy.py",
    "test_upstream_controllers.py",
    "test_walkthrough.py",
)
"""The modules whose tests the second worker runs, after the tests that need no sandbox and those
that need a control plane only, beside the first lane's shared tests: modules whose tests read
statuses, refusals, results and losses with generous deadlines, not timings; none races the
nanny's memory check, the kernel's OOM kill or a Node's eviction threshold (placement's computation
runs slow tasks, so that the other lane's load only makes it longer while its workers are drained).
They are about a third of the shared tests' time: the first lane begins its shared tests after
the tests that own the cluster (about 11 minutes), the second after its own (about 15). Rehearsals
with three more modules here (churn and the shared spill's two) ended the shared tests a minute
sooner, and each had two timing tests fail under the doubled load. With ``test_retirement.py`` here
(3.5 minutes, when the first lane's tests took 34.8 in sum and the second's 28.5), the tests took
39.6 minutes instead of 36.3: the suite is CPU-bound on two cores, and the second lane's tests took
7.3 minutes longer in sum while the first lane's took no less. Modules that change what is one
per machine or per Node (the shared spill's two label a Node and mount a tmpfs at the one host path
the operator allows) are in one lane together, so that their tests never overlap.
xdist's scheduler sees only test ids, so each of these modules has shared tests only
(:func:`check`)."""

ONE = "a"
"""The group of every shared test where there is one lane."""

WAIT_SECONDS = 45 * 60
"""How long one lane waits for the other's tests on real Nodes (the shared tests' sandbox waits for
the tests that own the cluster; the last tests wait for the shared ones): their longest plausible
run, past which that lane is taken to have died."""


def in_lane_b(path: str | Path, lanes: int) -> bool:
    path = Path(path)
    return lanes > 1 and path.parent.name == "e2e" and path.name in LANE_B


def group(item: pytest.Item, lanes: int) -> str:
    return "b" if in_lane_b(str(item.fspath), lanes) else ONE


def lanes(config: pytest.Config) -> int:
    """How many workers run the tests (1 without xdist)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 1


def shared_directory(factory: pytest.TempPathFactory) -> Path:
    """A directory that every worker of this run sees: xdist's workers each have a base temporary
    directory inside one of the run's."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def flocked(path: Path, operation: int) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, operation)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Detached:
    """The session's sandbox process as a worker that did not start it sees it: by its pid. It is
    gone once its pid is, or is a zombie its parent has not reaped yet."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError, ProcessLookupError):
            state = "Z"
        if state in ("Z", "X"):
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.2)
        return 0


class Session:
    """The record that the workers share: the sandbox (state directory and pid) while it runs, the
    groups of this run, and those done."""

    def __init__(self, directory: Path, groups: set[str], *, owners: bool = False):
        self.file = directory / "session.json"
        self.lock = directory / "session.lock"
        self.tests = directory / "tests.lock"
        self.turnstile = directory / "turnstile.lock"
        self.groups = groups
        self.owners = owners
        """Whether the run has tests that own the cluster: they run first, and the sandbox starts
        once they are done."""

    def _read(self) -> dict[str, Any]:
        return json.loads(self.file.read_text()) if self.file.exists() else {"done": []}

    def _write(self, record: dict[str, Any]) -> None:
        temporary = self.file.with_suffix(".tmp")
        temporary.write_text(json.dumps(record))
        temporary.replace(self.file)

    def owners_done(self) -> None:
        """The tests that own the cluster are done (or their lane ended): real Nodes are free."""
        with flocked(self.lock, fcntl.LOCK_EX):
            self._write({**self._read(), "owners_done": True})

    def wait_owners(self) -> None:
        """Until the tests that own the cluster are done, where the run has any."""
        deadline = time.monotonic() + WAIT_SECONDS
        while self.owners:
            with flocked(self.lock, fcntl.LOCK_SH):
                record = self._read()
            if record.get("owners_done"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tests that own the cluster did not end within {WAIT_SECONDS} s: {record}")
            time.sleep(1)

    def attach(self, start: Callable[[], tuple[Path, int]]) -> tuple[Path, int, bool]:
        """The running sandbox's state directory and pid, and whether this call started it: once
        the tests that own the cluster are done."""
        self.wait_owners()
        with flocked(self.lock, fcntl.LOCK_EX):
            record = self._read()
            if record.get("pid") and not record.get("stopped"):
                return Path(record["state_dir"]), int(record["pid"]), False
            state_dir, pid = start()
            self._write({**record, "state_dir": str(state_dir), "pid": pid, "stopped": False})
            return state_dir, pid, True

    def done(self, mine: set[str], stop: Callable[[int], None], *, finished: str = "", lanes: int = 1) -> None:
        """Mark ``mine`` done (and with ``finished``, that worker's session ended); when every
        group of the run is, or every worker's session ended (a run cut short), stop the
        sandbox: ``stop`` gets its pid."""
        with flocked(self.lock, fcntl.LOCK_EX):
            record = self._read()
            record["done"] = sorted(set(record["done"]) | mine)
            record["finished"] = sorted(set(record.get("finished", [])) | ({finished} if finished else set()))
            over = self.groups <= set(record["done"]) or len(record["finished"]) >= lanes
            if over and record.get("pid") and not record.get("stopped"):
                stop(int(record["pid"]))
                record["stopped"] = True
            self._write(record)

    def wait_stopped(self) -> None:
        """Until every group of the run is done and the sandbox (if it started) has stopped."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            with flocked(self.lock, fcntl.LOCK_SH):
                record = self._read()
            if self.groups <= set(record["done"]) and (not record.get("pid") or record.get("stopped")):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other lane's shared tests did not end within {WAIT_SECONDS} s: {record}")
            time.sleep(1)

    @contextlib.contextmanager
    def running(self, *, quiet: bool) -> Iterator[None]:
        """A shared test's hold on the sandbox: shared, or (``quiet``) exclusive."""
        if quiet:
            with flocked(self.turnstile, fcntl.LOCK_EX), flocked(self.tests, fcntl.LOCK_EX):
                yield
            return
        with flocked(self.turnstile, fcntl.LOCK_EX):
            pass  # a quiet test waiting holds it: the next shared test waits behind it
        with flocked(self.tests, fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """A spare namespace's start: shared, and past the turnstile (the test it is for may hold
        the lock already; a quiet test waits for it)."""
        with flocked(self.tests, fcntl.LOCK_SH):
            yield


def check(items: list[pytest.Item], shares: Callable[[pytest.Item], bool]) -> None:
    """:data:`LANE_B`'s modules have shared tests only: xdist's scheduler puts a module's tests in a
    lane by its name."""
    wrong = [item.nodeid for item in items if in_lane_b(str(item.fspath), 2) and not shares(item)]
    if wrong:
        raise pytest.UsageError(f"tests/e2e/lanes.py: LANE_B's modules must have shared tests only: {wrong}")


def stop_process(process: Any) -> None:
    """SIGTERM, then the process group's SIGKILL a minute later."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
