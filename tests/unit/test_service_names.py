"""A scheduler address's host, read as a pod of the policy's namespace would resolve it."""

from __future__ import annotations

import pytest

from memops.decisions.service_names import service_of


@pytest.mark.parametrize(
    ("host", "service"),
    [
        ("dask-scheduler", "dask-scheduler"),
        ("dask-scheduler.team-a", "dask-scheduler"),
        ("dask-scheduler.team-a.svc", "dask-scheduler"),
        ("dask-scheduler.team-a.svc.cluster.local", "dask-scheduler"),
        ("dask-scheduler.team-a.svc.cluster.local.", "dask-scheduler"),  # fully qualified
        ("Dask-Scheduler.TEAM-A.svc", "dask-scheduler"),  # DNS is case-blind
        ("dask-scheduler.team-a.svc.corp.example", "dask-scheduler"),  # another cluster domain
        # Another namespace's Service: not this policy's to name (dialled as written, then vetted).
        ("dask-scheduler.team-b", None),
        ("dask-scheduler.team-b.svc.cluster.local", None),
        # Not a Service of the namespace's: an IP address, a name outside the cluster.
        ("10.96.0.12", None),
        ("::1", None),
        ("scheduler.example.com", None),
        ("dask-scheduler.team-a.pod", None),
        ("dask-scheduler.team-a.svc.-bad", None),
        ("-bad", None),
        ("a" * 64, None),  # longer than a label
        ("", None),
    ],
)
def test_which_service_a_host_names(host: str, service: str | None) -> None:
    assert service_of(host, "team-a") == service
