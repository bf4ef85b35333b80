"""Helm values for the chart the sandbox installs, as ``memops sandbox --set`` gives them."""

from __future__ import annotations

from typing import Any

import pytest
from memops_sandbox import install


@pytest.mark.parametrize(
    ("settings", "values"),
    [
        pytest.param([], {}, id="none"),
        pytest.param(["rbac.daskWorkerGroups=true"], {"rbac": {"daskWorkerGroups": True}}, id="nested-bool"),
        pytest.param(
            ["rbac.schedulerTLS=true", "rbac.daskWorkerGroups=false", "replicas=2"],
            {"rbac": {"schedulerTLS": True, "daskWorkerGroups": False}, "replicas": 2},
            id="several",
        ),
        pytest.param(["image.tag=v1=2"], {"image": {"tag": "v1=2"}}, id="equals-in-value"),
    ],
)
def test_chart_values(settings: list[str], values: dict[str, Any]) -> None:
    assert install.chart_values(settings) == values


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param("rbac.daskWorkerGroups", id="no-value"),
        pytest.param("=true", id="no-key"),
        pytest.param("rbac..x=1", id="empty-part"),
    ],
)
def test_chart_values_refuses_what_is_not_key_value(setting: str) -> None:
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        install.chart_values([setting])


def test_chart_values_refuses_a_key_under_a_value() -> None:
    with pytest.raises(ValueError, match="set to a value already"):
        install.chart_values(["rbac=1", "rbac.x=2"])


def test_the_operator_gets_the_charts_shared_spill_roots() -> None:
    """``memops sandbox --set sharedSpill.hostRoots=[...]`` allows those host directories, as the
    chart's Deployment would; by default none."""
    assert install.operator_flags(install.render_chart()) == []
    values = install.chart_values(["sharedSpill.hostRoots=[/var/lib/memops/spill, /dev/shm/memops]"])
    assert install.operator_flags(install.render_chart(values)) == [
        "--shared-spill-host-root=/dev/shm/memops",
        "--shared-spill-host-root=/var/lib/memops/spill",
    ]
