"""``memops sandbox``'s flags for real Nodes are refused with the process node agent, before anything starts."""

from __future__ import annotations

import pytest

from memops import cli


@pytest.mark.parametrize(
    "flag", [["--node-memory", "2Gi"], ["--eviction-threshold", "768Mi"], ["--swap", "1Gi"]], ids=lambda f: f[0]
)
def test_a_real_node_flag_with_the_node_agent_is_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sandbox", "--node-agent", *flag]) == 2
    assert "need real Nodes" in capsys.readouterr().err
