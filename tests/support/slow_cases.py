"""Write tests/slow_cases.txt from pytest's `--durations=0` report on standard input: every case whose
setup, call and teardown together took at least THRESHOLD seconds (first argument, default 1.5, for an idle
machine). `make durations` runs it; tests/conftest.py marks the listed cases `slow`."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

HEADER = """# Test cases `make test-fast` leaves out: each took {threshold:g} s or more of one core in a timed run of
# the suite on two workers. tests/conftest.py marks them `slow`; `make test` runs them. Regenerate after
# the suite changes shape with `make durations` (tests/support/slow_cases.py).
"""
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S.*)$")


def main() -> None:
    threshold = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    seconds: Counter[str] = Counter()
    for line in sys.stdin:
        m = LINE.match(line.strip())
        if m:
            seconds[m.group(2)] += float(m.group(1))
    slow = sorted(case for case, s in seconds.items() if s >= threshold)
    out = Path(__file__).resolve().parents[1] / "slow_cases.txt"
    out.write_text(HEADER.format(threshold=threshold) + "".join(f"{case}\n" for case in slow))
    print(f"{len(slow)} cases of {len(seconds)} timed took {threshold:g} s or more: {out}")


if __name__ == "__main__":
    main()
