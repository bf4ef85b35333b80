"""The spec models: what users may write, and the errors they get when they write it wrong."""

import datetime

import pydantic
import pytest

from memops import retirement, specs


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
    assert field in retirement.explain_invalid(info.value)


def test_tls_address_needs_a_secret() -> None:
    body = {**BASE, "count": 1, "scheduler": {"address": "tls://dask-scheduler:8786"}}
    with pytest.raises(pydantic.ValidationError) as info:
        specs.RetirementRequestSpec.model_validate(body)
    assert "scheduler.tls.secretName is required" in retirement.explain_invalid(info.value)
    body["scheduler"] = {"address": "tls://dask-scheduler:8786", "tls": {"secretName": "dask-client"}}
    assert specs.RetirementRequestSpec.model_validate(body).scheduler.tls is not None
