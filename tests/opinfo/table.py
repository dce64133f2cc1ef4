"""Run the whole OpInfo sweep and print its table (the one in docs/opinfo.md).

    python -m tests.opinfo.table                      # the table, per op family, both ways
    python -m tests.opinfo.table --details            # and every sample that is not a pass, with its reason
    python -m tests.opinfo.table --ops add,mul --json out.json
    python -m tests.opinfo.table --bf16 --details      # the sweep under autocast bf16 (tests/opinfo/autocast.py)

Run it from the repository root with the checkout's ``src`` on ``PYTHONPATH``. One thread (the sweep runs
op by op; about 10 minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from tests.opinfo import harness

STATUSES = ("pass", "fallback", "error", "wrong", "skip")


def table(results) -> str:
    """The markdown table: per family and mode, how many samples are in each status, and the totals."""
    counts: dict[tuple[str, str], Counter] = {}
    for r in results:
        counts.setdefault((r.family, r.mode), Counter())[r.status] += 1
    families = sorted({f for f, _ in counts})
    lines = ["| family | way | " + " | ".join(STATUSES) + " | pass share |",
             "|---|---|" + "---:|" * (len(STATUSES) + 1)]
    for mode in harness.MODES:
        for fam in [*families, "**total**"]:
            if fam == "**total**":
                c = sum((counts.get((f, mode), Counter()) for f in families), Counter())
            else:
                c = counts.get((fam, mode))
                if c is None:
                    continue
            compared = sum(c[s] for s in STATUSES if s != "skip")
            share = f"{100 * c['pass'] / compared:.0f}%" if compared else "-"
            lines.append(f"| {fam} | {mode} | " + " | ".join(str(c[s]) for s in STATUSES) + f" | {share} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", help="comma-separated op names (default: every swept op)")
    parser.add_argument("--details", action="store_true", help="list every sample that is not a pass")
    parser.add_argument("--json", help="also write every result to this JSON file")
    parser.add_argument("--progress", action="store_true", help="print each result as it comes")
    parser.add_argument("--bf16", action="store_true",
                        help="under torch.autocast('cpu', dtype=torch.bfloat16) against float64 (autocast.py)")
    args = parser.parse_args(argv)
    names = args.ops.split(",") if args.ops else None
    start = time.time()

    def progress(r):
        extra = f" [{r.kind} {r.ran} {r.worst}]" if args.bf16 else ""
        print(f"{time.time() - start:7.1f}s {r.op} #{r.index} {r.mode}: {r.status} {r.reason}{extra}",
              file=sys.stderr, flush=True)

    if args.bf16:
        from tests.opinfo import autocast

        results = list(autocast.sweep(names, progress=progress if args.progress else None))
    else:
        results = list(harness.sweep(names, progress=progress if args.progress else None))
    ops = {r.op for r in results}
    samples = len({(r.op, r.index) for r in results})
    print(f"{len(ops)} ops, {samples} samples, each run both ways ({time.time() - start:.0f} s)\n")
    print(table(results))
    if args.details:
        print()
        for r in results:
            if r.status != "pass":
                print(f"- {r.status} {r.op} #{r.index} ({r.mode}): {r.reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
