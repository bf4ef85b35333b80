"""Retire one worker holding SIZE of unique data: memops (a RetirementRequest) against its anchors.

The one-worker case of ``throughput.py`` (16 MiB keys), with the same phases and instruments,
measured in the same sandbox and the same run:

- raw (anchor): ``Client.replicate`` of the same bytes to other workers, without the AMM;
- stock (anchor): the scheduler's ``retire_workers`` called directly, which is what memops drives;
- memops: a RetirementRequest for that worker, applied with kubectl.

"drain" is first byte in flight -> last key in memory on its recipient, recorded inside the
workers, the same way for stock and memops; the ratio that matters is memops' drain rate over
stock's (``memops/stock``, goal at least 0.95).

    python bench/retire_1gib.py                  # 1 GiB, 5 runs
    python bench/retire_1gib.py --size-mib 64 --runs 1   # the small pass CI runs
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import throughput


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    scenario = throughput.Scenario(args.size_mib * throughput.MIB, 16 * throughput.MIB, 1)
    [phases] = throughput.measure([scenario], args.runs).values()
    gib = scenario.keys * scenario.key_size / throughput.GIB
    median = throughput.median
    print(f"\nRetire one worker holding {scenario.label.split(',')[0]}; median of {args.runs} runs, same sandbox\n")
    rows = [
        [
            "raw worker-to-worker copy, `replicate` (anchor)",
            f"{median(p.raw for p in phases):.3f}",
            f"{median(gib / p.raw for p in phases):.2f}",
            f"{median(p.stock_drain / p.raw for p in phases):.2f}",
        ],
        [
            "stock `retire_workers`: drain (anchor)",
            f"{median(p.stock_drain for p in phases):.3f}",
            f"{median(gib / p.stock_drain for p in phases):.2f}",
            "1.00",
        ],
        [
            "memops RetirementRequest: drain",
            f"{median(p.memops_drain for p in phases):.3f}",
            f"{median(gib / p.memops_drain for p in phases):.2f}",
            f"{median(p.stock_drain / p.memops_drain for p in phases):.2f}",
        ],
        ["stock: call -> first byte", f"{median(p.stock_first for p in phases):.3f}", "", ""],
        ["stock: call -> returned (worker closed)", f"{median(p.stock_return for p in phases):.3f}", "", ""],
        ["memops: `kubectl apply` -> first byte", f"{median(p.memops_first for p in phases):.3f}", "", ""],
        [
            "memops: `kubectl apply` -> `Succeeded` (pod gone)",
            f"{median(p.memops_succeeded for p in phases):.3f}",
            "",
            "",
        ],
    ]
    print(throughput.markdown(["measure", "seconds", "GiB/s", "rate vs stock"], rows))
    print("\n'rate vs stock' is the median over runs of the rate's ratio to stock's in the same run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
