"""The spec models: what users may write, and the errors they get when they write it wrong."""

import datetime

import pydantic
import pytest

from memops import specs
from memops.decisions import drain_decisions


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("90s", 90, id="seconds"),
        pytest.param("10m", 600, id="minutes"),
        pytest.param("1h30m", 5400, id="compound"),
        pytest.param("1.5s", 1.5, id="fraction"),
        pytest.param("250ms", 0.25, id="milliseconds"),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert specs.parse_duration(text) == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["ten", "10", "-5m", "5 m", "", "1d"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        specs.parse_duration(text)


BASE = {"scheduler": {"address": "tcp://dask-scheduler:8786"}, "workload": {"kind": "Deployment", "name": "w"}}


def test_defaults() -> None:
    spec = specs.RetirementRequestSpec.model_validate({**BASE, "count": 2})
    assert spec.timeout == "10m"
    assert spec.onTimeout is specs.OnTimeout.ABORT


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param({"count": 1, "workers": ["a"]}, "spec: set exactly one of spec.count and spec.workers", id="both"),
        pytest.param({}, "spec: set exactly one of spec.count and spec.workers", id="neither"),
        pytest.param({"count": 0}, "spec.count:", id="zero-count"),
        pytest.param({"count": 1, "timeout": "soon"}, "spec.timeout:", id="bad-duration"),
        pytest.param({"count": 1, "onTimeout": "Maybe"}, "spec.onTimeout:", id="bad-ontimeout"),
        pytest.param({"count": 1, "surprise": True}, "spec.surprise:", id="unknown-field"),
    ],
)
def test_invalid_specs_name_the_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        specs.RetirementRequestSpec.model_validate({**BASE, **extra})
    assert field in drain_decisions.explain_invalid(info.value)


def test_tls_address_needs_a_secret() -> None:
    body = {**BASE, "count": 1, "scheduler": {"address": "tls://dask-scheduler:8786"}}
    with pytest.raises(pydantic.ValidationError) as info:
        specs.RetirementRequestSpec.model_validate(body)
    assert "scheduler.tls.secretName is required" in drain_decisions.explain_invalid(info.value)
    body["scheduler"] = {"address": "tls://dask-scheduler:8786", "tls": {"secretName": "dask-client"}}
    assert specs.RetirementRequestSpec.model_validate(body).scheduler.tls is not None


ESCAPE = "../../kube-system/deployments/coredns"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param(
            {"count": 1, "workload": {"kind": "Deployment", "name": ESCAPE}}, "spec.workload.name:", id="path"
        ),
        pytest.param({"count": 1, "workload": {"kind": "Deployment", "name": "W"}}, "spec.workload.name:", id="upper"),
        pytest.param(
            {"count": 1, "workload": {"kind": "DaskWorkerGroup", "name": "a" * 254}}, "spec.workload.name:", id="long"
        ),
        pytest.param(
            {"count": 1, "scheduler": {"address": "tls://s:8786", "tls": {"secretName": "../kube-system/x"}}},
            "spec.scheduler.tls.secretName:",
            id="secret-path",
        ),
        pytest.param({"workers": ["p", "../q"]}, "spec.workers.1:", id="worker-path"),
        pytest.param({"workers": ["p", "q", "p"]}, "spec.workers: each pod may be named once", id="worker-twice"),
        pytest.param({"workers": [f"p-{i}" for i in range(1001)]}, "spec.workers:", id="too-many-workers"),
        pytest.param({"count": 1, "timeout": "100000000h"}, "spec.timeout:", id="timeout-overflow"),
        pytest.param({"count": 1, "timeout": "169h"}, "spec.timeout:", id="timeout-over-a-week"),
        pytest.param({"count": 1, "timeout": "1" * 40 + "s"}, "spec.timeout:", id="timeout-too-long-text"),
    ],
)
def test_names_sets_and_durations_are_bounded(extra: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        specs.RetirementRequestSpec.model_validate({**BASE, **extra})
    assert field in drain_decisions.explain_invalid(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"workers": ["dask-worker-7d9f8c6b5-x2k4p", "w.example"]}, id="pod-names"),
        pytest.param({"workers": [f"p-{i}" for i in range(1000)]}, id="a-thousand"),
        pytest.param({"count": 1, "timeout": "168h"}, id="a-week"),
        pytest.param({"count": 1, "timeout": "167h59m59.5s"}, id="just-under"),
        pytest.param({"count": 1, "workload": {"kind": "Deployment", "name": "a" * 253}}, id="longest-name"),
    ],
)
def test_what_is_within_the_bounds_is_accepted(extra: dict[str, object]) -> None:
    specs.RetirementRequestSpec.model_validate({**BASE, **extra})


@pytest.mark.parametrize("text", ["100000000h", "99999999999999999999h", "9" * 30 + "ms", "1" * 400 + "h"])
def test_parse_duration_never_overflows(text: str) -> None:
    with pytest.raises(ValueError):
        specs.parse_duration(text)


def test_parse_duration_with_a_maximum() -> None:
    assert specs.parse_duration("168h", specs.MAX_DURATION) == datetime.timedelta(days=7)
    with pytest.raises(ValueError, match="longer than the maximum duration, 168h"):
        specs.parse_duration("168h1ms", specs.MAX_DURATION)


POLICY = {"scheduler": {"address": "tcp://s:8786"}, "workload": {"kind": "Deployment", "name": "w"}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param({"workload": {"kind": "DaskWorkerGroup", "name": ESCAPE}}, "spec.workload.name:", id="workload"),
        pytest.param(
            {"scheduler": {"address": "tls://s:8786", "tls": {"secretName": ".."}}},
            "spec.scheduler.tls.secretName:",
            id="secret",
        ),
        pytest.param({"drain": {"timeout": "200h"}}, "spec.drain.timeout:", id="drain-over-a-week"),
        pytest.param({"recycle": {"maxAge": "8761h"}}, "spec.recycle.maxAge:", id="max-age-over-a-year"),
        pytest.param(
            {"recycle": {"growth": {"perHour": "5%", "window": "1000h"}}}, "spec.recycle.growth.window:", id="window"
        ),
    ],
)
def test_policy_names_and_durations_are_bounded(extra: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        specs.MemoryPolicySpec.model_validate({**POLICY, **extra})
    assert field in drain_decisions.explain_invalid(info.value)


def test_a_policy_may_recycle_after_a_year() -> None:
    spec = specs.MemoryPolicySpec.model_validate({**POLICY, "recycle": {"maxAge": "8760h"}})
    assert spec.recycle is not None and spec.recycle.maxAge == "8760h"
