"""Sum a py-spy raw profile (`py-spy record -f raw`): the top frames by own samples, then by inclusive samples."""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def main(path: str, top: int = 25) -> None:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")
        own[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    print(f"{total} samples")
    for title, counter in (("own", own), ("inclusive", incl)):
        print(f"-- {title}")
        for frame, n in counter.most_common(top):
            print(f"{100 * n / max(total, 1):5.1f}% {frame[:160]}")


if __name__ == "__main__":
    main(sys.argv[1])
