"""Keeps the whole benchmark inside one device call (--time-limit) by skipping torch.compile work last.

What a full H200 run costs, roughly: each case's non-compile providers 1-3 s (do_bench's 10+50 ms and
5 wall runs of ~10 ms per variant, interleaved with the other providers, plus our autotuning the first
time a dtype/act/bucket is seen); torch.compile 2-5 s a case; max-autotune 10-30 s for each new GEMM
shape (less for the second activation of a shape: inductor's autotune cache keys on the GEMM, not the
epilogue). 36 layer cases and 10 model cases with max-autotune everywhere would take 10-15 minutes, so:

- each section (layers, convs, models, in that order) gets a share of the time left when it starts, in proportion to
  what its cases cost with every provider (`section_shares`: a layer case ~7 s, a model case ~27 s, as the
  2026-11-23 H200 run spent them; a conv case ~8 s, not yet measured);
- non-compile providers always run (they are the comparison) until the section's hard limit: its share
  of the time plus 15% of the total (so slow layers cannot starve the models section);
- `compile` runs when its expected cost still leaves room for the rest of the section;
- `compile-max` runs when it leaves room for the rest of the section *including* `compile` there.

Expected costs are running means of what this section of the run measured, from the section's start
values below, per section: a model case costs several layer cases (ours tunes every layer of its batch
bucket; the digits MLP at batch 1: 17 s beside compile-max's 16 s, H200), and estimates carried over
from the layers would let compile-max take the time of the last wide-MLP cases. Once a hard limit has
passed, the section's remaining cases are recorded as skipped and the report is still written.
"""

from __future__ import annotations

import math
import time

START_ESTIMATE_S = {"base": 3.0, "compile": 5.0, "compile-max": 20.0}  # a layer case, H200
# A model case (H200): base 9-17 s, compile 0.2-0.6 s, compile-max 16-29 s.
MODEL_START_ESTIMATE_S = {"base": 12.0, "compile": 1.0, "compile-max": 25.0}
# A conv case (the wider CNN's layers alone; not yet measured): ours tunes the layer's bucket (~10 configs),
# cuDNN and its fused op are ready at once, compile and max-autotune as for a layer case.
CONV_START_ESTIMATE_S = {"base": 4.0, "compile": 4.0, "compile-max": 20.0}
# Seconds a case costs with every provider run (H200, 2026-11-23: 36 layer cases took 251 s of the 535, 10
# model cases 275 s; a conv case guessed from a layer case plus ours's tuning of a conv layer).
SECTION_CASE_S = {"layers": 7.0, "models": 27.0, "convs": 8.0}
HARD_GRACE = 0.15  # of the whole time limit: how far a section may run past its share


def section_shares(counts: dict[str, int]) -> dict[str, float]:
    """Each section's share of the time left when it starts, from its case count times SECTION_CASE_S, the
    sections in run order (the order of `counts`). A section takes its share of what is left then, so the
    shares of the sections still to come are renormalised: with 36 layer, 12 conv and 23 model cases (the
    default run), 252 : 96 : 621 s, the layers get 26% of the limit, the convs 96 / 717 = 13% of what is
    left after them, the models all of the rest."""
    cost = {k: n * SECTION_CASE_S[k] for k, n in counts.items() if n}
    shares, left = {}, sum(cost.values())
    for k, c in cost.items():
        shares[k] = c / left if left else 1.0
        left -= c
    return {k: shares.get(k, 0.0) for k in counts}


class Budget:
    def __init__(self, limit_s: float):
        self.start = time.perf_counter()
        self.deadline = self.start + limit_s if limit_s > 0 else math.inf
        self.section_deadline = self.deadline
        self.section_hard_deadline = self.deadline
        self._start = dict(START_ESTIMATE_S)
        self._seen: dict[str, list[float]] = {k: [] for k in START_ESTIMATE_S}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def expired(self) -> bool:
        """Past the section's hard limit (or the whole run's): the section's remaining cases are skipped."""
        return time.perf_counter() > min(self.deadline, self.section_hard_deadline)

    def start_section(self, share: float, start_estimates: dict[str, float] | None = None) -> None:
        """The section may use `share` of the time left (the layers leave the rest to the models). Its
        costs are estimated afresh, from `start_estimates` (default START_ESTIMATE_S) until measured."""
        self._start = dict(start_estimates or START_ESTIMATE_S)
        self._seen = {k: [] for k in self._start}
        now = time.perf_counter()
        if not math.isfinite(self.deadline):
            return
        self.section_deadline = now + (self.deadline - now) * share
        grace = (self.deadline - self.start) * HARD_GRACE
        self.section_hard_deadline = min(self.deadline, self.section_deadline + grace)

    def estimate(self, kind: str) -> float:
        seen = self._seen[kind]
        return sum(seen) / len(seen) if seen else self._start[kind]

    def record(self, kind: str, seconds: float) -> None:
        self._seen[kind].append(seconds)

    def skip_reason(self, provider: str, cases_after: int) -> str | None:
        """None if `provider` fits before the section deadline; else why it is skipped."""
        if provider not in ("compile", "compile-max") or not math.isfinite(self.section_deadline):
            return None
        need = self.estimate(provider) + (cases_after + 1) * self.estimate("base")
        if provider == "compile-max":
            need += cases_after * self.estimate("compile")
        left = self.section_deadline - time.perf_counter()
        if need <= left:
            return None
        return f"skipped: --time-limit (needs ~{need:.0f} s with the cases after it, {max(left, 0):.0f} s left)"
