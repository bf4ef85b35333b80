"""Dask's own tests, stock and with memops' agent installed on every scheduler (every feature off).

memops promises that a feature a policy does not ask for changes no scheduling decision. The
strongest check of that is dask/distributed's own test suite: this runs chosen modules of it twice
against the installed ``distributed``, once stock (the anchor) and once with every scheduler the
tests start carrying what memops leaves on a scheduler whose policy asks for nothing (the agent's
handler and the departures plugin, through a scheduler preload: ``bench/dask_preload.py``), and
prints both outcomes side by side. A test that passes stock and fails with the agent is run again,
alone, in both modes (``--again`` times): one that fails every time with the agent and passes
stock is a difference, and the exit status is 1.

Dask's tests are not in its wheel or sdist, so ``--source`` names a checkout of dask/distributed
(its root: ``conftest.py``, ``pyproject.toml`` and ``distributed/tests``), as near the installed
version as there is. The run copies the installed package and that checkout's tests side by side
into a scratch directory, so that the code under test is the installed one::

    git clone https://github.com/dask/distributed /tmp/distributed   # a tag near the installed version
    python bench/dask_own_tests.py --source /tmp/distributed
    python bench/dask_own_tests.py --source /tmp/distributed --modules test_scheduler.py test_worker_memory.py

"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import distributed

PRELOAD = Path(__file__).resolve().parent / "dask_preload.py"
MODULES = ("test_scheduler.py", "test_worker_memory.py")


def scratch_tree(source: Path, into: Path) -> Path:
    """The installed ``distributed`` with ``source``'s tests inside it, and ``source``'s pytest set-up."""
    tests = source / "distributed" / "tests"
    if not tests.is_dir():
        raise SystemExit(f"--source: {tests} is not a directory (a checkout of dask/distributed is needed)")
    shutil.copytree(
        Path(distributed.__file__).parent, into / "distributed", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(tests, into / "distributed" / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy(source / name, into / name)
    return into


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed, failed, error or skipped, from pytest's JUnit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[test] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed").replace(
            "failure", "failed"
        )
    return found


def node_id(test: str) -> str:
    """A JUnit test id (``distributed.tests.test_x::test_y[p]``) as pytest's node id."""
    module, name = test.split("::", 1)
    return module.replace(".", "/") + ".py::" + name


def run(
    tree: Path, targets: list[str], *, agent: bool, junit: Path, timeout: int, slow: bool = False
) -> tuple[dict[str, str], int, float]:
    """One pytest run: its outcomes, how many schedulers the preload reached, and its seconds."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PYTEST_ADDOPTS", None)
    log = junit.with_suffix(".schedulers")
    log.write_text("")
    if agent:
        env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"] = repr([str(PRELOAD)])
        env["MEMOPS_PRELOAD_LOG"] = str(log)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--timeout={timeout}"]
    if slow:
        command.append("--runslow")
    started = time.monotonic()
    subprocess.run(
        [*command, f"--junitxml={junit}", *targets], cwd=tree, env=env, stdout=subprocess.DEVNULL, check=False
    )
    seconds = time.monotonic() - started
    if not junit.exists():
        raise SystemExit(f"pytest wrote no report for {' '.join(targets)}")
    return outcomes(junit), len(log.read_text().split()), seconds


def tally(found: dict[str, str]) -> dict[str, int]:
    return {kind: sum(1 for v in found.values() if v == kind) for kind in ("passed", "failed", "error", "skipped")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a checkout of dask/distributed")
    parser.add_argument("--modules", nargs="+", default=list(MODULES), help="modules of distributed/tests")
    parser.add_argument("--again", type=int, default=2, help="runs of each differing test again, alone")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--runslow", action="store_true", help="the tests Dask marks slow too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dask-own-tests-") as scratch:
        tree = scratch_tree(args.source.resolve(), Path(scratch))
        targets = [f"distributed/tests/{m}" for m in args.modules]

        def once(targets: list[str], agent: bool, report: str) -> tuple[dict[str, str], int, float]:
            junit = Path(scratch) / report
            return run(tree, targets, agent=agent, junit=junit, timeout=args.timeout, slow=args.runslow)

        print(f"distributed {distributed.__version__} (installed), tests from {args.source}: {' '.join(args.modules)}")
        results = {}
        for mode, agent in (("stock", False), ("memops agent", True)):
            results[mode] = once(targets, agent, f"{mode.split()[0]}.xml")
        print("\n| mode | passed | failed | error | skipped | schedulers with the agent | minutes |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode, (found, schedulers, seconds) in results.items():
            t = tally(found)
            counts = " | ".join(str(t[kind]) for kind in ("passed", "failed", "error", "skipped"))
            print(f"| {mode} | {counts} | {schedulers} | {seconds / 60:.1f} |")
        stock, memops = results["stock"][0], results["memops agent"][0]
        if results["memops agent"][1] == 0:
            print("\nthe preload reached no scheduler: the run with the agent proves nothing")
            return 1
        worse = sorted(t for t, v in memops.items() if v in ("failed", "error") and stock.get(t) == "passed")
        better = sorted(t for t, v in stock.items() if v in ("failed", "error") and memops.get(t) == "passed")
        both = sorted(t for t, v in stock.items() if v in ("failed", "error") and memops.get(t) in ("failed", "error"))
        for title, tests in (("failed stock and with the agent", both), ("failed stock only", better)):
            if tests:
                print(f"\n{title} ({len(tests)}):", *(f"  {t}" for t in tests), sep="\n")
        differences = []
        for test in worse:
            again = [once([node_id(test)], True, f"again-{i}.xml")[0] for i in range(args.again)]
            stock_again = once([node_id(test)], False, "again-stock.xml")[0]
            passes = sum(1 for found in again if found.get(test) == "passed")
            verdict = "flaky" if passes else "DIFFERENCE"
            print(f"\nfailed with the agent only: {test}: run again alone, {passes} of {args.again} passed with it,")
            print(f"  and stock it {stock_again.get(test)}: {verdict}")
            if not passes and stock_again.get(test) == "passed":
                differences.append(test)
        print(f"\n{len(differences)} test(s) pass stock and fail with memops' agent installed")
        return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
