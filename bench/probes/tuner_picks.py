"""Which config does the tuner pick under each timing policy, and how far do its picks spread over processes?

(a) Every candidate config of the tuner, timed as the tuner times it (kernels/tuning.py, time_candidates: one
    graph of a single call, cold with L2 cleared and hot back to back), for the shipped digits MLP (the
    whole-MLP kernel, kernels/mlp.py) in float16 and bfloat16 at every bucket 1-4096, and for each layer of
    the wide 1024-4096-4096-1024 MLP (kernels/linear.py) in float16 at batches 1, 32 and 256. A table per
    case: config, cold, hot, hot/cold; `HOT>1.5x` flags a candidate whose hot time exceeds 1.5x its cold.
(b) What each policy (cold, hot, both: `pick`) picks from those timings, and that pick's cold and hot time
    over the best candidate's on each count (its regret).
(c) The spread over fresh processes: P processes per policy (cold: the tuner before hot timing; both: the
    default now), each a new Python with an empty tuning cache and FUSEDSERVE_TUNING_TIMING set, run the
    real tuner on the digits MLP in float16 at every bucket and print their picks. Per bucket and policy:
    each process's pick, its hot time over the best candidate's hot time (both from (a)'s timings, so every
    process's pick is judged on one set of timings), and the worst over the processes, against 1.10 (issue
    19: every process picks within 10% of the best hot time).

Order and time: (a) for digits float16 first ((c) needs it), then (c), then the other cases. A case's next
bucket starts only with UNIT_MIN_S left of --time-limit; what does not fit is skipped and listed. (c)'s
processes share the time left to it equally (one that finishes early leaves its share to the next) and
alternate policies, so a cut leaves both equally covered; each stops between buckets at its share and
reports the buckets it tuned (smallest first). Compiles dominate on a cold Triton cache: every candidate of
the whole-MLP kernel is compiled once per dtype and specialisation of M, and (a) fills the cache that (c)'s
processes then read. So the default limit is expected to cover (a) for digits float16 and (c), and a second
run with `--cases digits-bfloat16,wide-float16 --processes 0` the rest.

    python -m bench.probes.tuner_picks --out DIR [--processes 4] [--time-limit 200]
        [--cases digits-float16,digits-bfloat16,wide-float16] [--wide-batches 1,32,256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

import torch

import kernels.linear as linear_mod
import kernels.mlp as mlp_mod
from kernels import tuning
from kernels.mlp import FusedMLP
from kernels.tuning import POLICIES, LaunchConfig, Times

from .common import REPO, digits_layers, main, tuned_by

BUCKETS = tuple(1 << i for i in range(13))  # 1 .. 4096, every bucket the tuner keys on
WIDE_BATCHES = (1, 32, 256)
CASES = ("digits-float16", "digits-bfloat16", "wide-float16")
SPREAD_POLICIES = ("cold", "both")  # before and after hot timing
HOT_FLAG = 1.5  # a candidate whose hot time exceeds this many times its cold is flagged
SPREAD_LIMIT = 1.10  # issue 19: every process's pick within 10% of the best candidate's hot time
MIN_WORKER_S = 20.0  # a shorter share would go mostly on starting the process (torch, CUDA, the model)
# A case's next bucket starts only with this much time left: on a cold Triton cache it compiles up to 33 configs
# (a first fused start, which tunes the digits MLP's 11 buckets, took about 100 s on an H200: bench/serve/run.py).
UNIT_MIN_S = 30.0
MARKER = "TUNER_PICKS_JSON "  # the worker's result line on stdout
DEVICE = torch.device("cuda")  # the worker's; tests run it on the CPU with a fake MLP
WORKER = "import sys; from bench.probes.tuner_picks import worker; worker(sys.argv[1:])"  # python -c, run in REPO

ABBREV = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "GROUP_M": "GM", "SPLIT": "SP", "SPLIT_K": "SK",
          "STAGES": "ST", "LEAD": "L", "PERSISTENT": "PERS"}  # fmt: skip


def short(config: LaunchConfig) -> str:
    """One config in a table cell, meta-parameters in ABBREV's order: 'BM16 BN32 SP8 ST2 L1 w4 s1'."""
    order = list(ABBREV)
    kwargs = sorted(config.kwargs, key=lambda kv: (order.index(kv[0]) if kv[0] in ABBREV else len(order), kv[0]))
    return " ".join([*(f"{ABBREV.get(k, k)}{v}" for k, v in kwargs), f"w{config.num_warps}", f"s{config.num_stages}"])


class Deadline:
    """Seconds left of a budget that started at construction."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return self.end - self.clock()


def analyze(timings: Mapping[LaunchConfig, tuple[float, float]]) -> dict:
    """(a) and (b) for one case: every candidate's cold, hot, hot/cold and flag (fastest cold first), and each
    policy's pick with its cold and hot time over the best on each count."""
    best = tuning.best_times(timings)
    rows = [
        {"config": short(c), "meta": c.to_json(), "cold_us": cold, "hot_us": hot,
         "hot_over_cold": hot / cold if cold > 0 else None, "hot_flag": hot > HOT_FLAG * cold}
        for c, (cold, hot) in sorted(timings.items(), key=lambda item: item[1][0])
    ]  # fmt: skip
    picks = {}
    for policy in POLICIES:
        chosen = tuning.pick(timings, policy)
        times = Times(*timings[chosen])
        cold_regret, hot_regret = tuning.regret(times, best)
        picks[policy] = {"config": short(chosen), "meta": chosen.to_json(), "cold_us": times.cold_us,
                         "hot_us": times.hot_us, "cold_regret": cold_regret, "hot_regret": hot_regret}  # fmt: skip
    return {"best_cold_us": best.cold_us, "best_hot_us": best.hot_us, "candidates": rows, "picks": picks}


def format_case(name: str, result: dict) -> list[str]:
    """The printed table of one case: candidates, then each policy's pick."""
    marks = {}
    for policy, p in result["picks"].items():
        marks.setdefault(p["config"], []).append(policy)
    lines = [f"{name}: {len(result['candidates'])} candidates (best cold {result['best_cold_us']:.2f} us, "
             f"best hot {result['best_hot_us']:.2f} us)",
             f"  {'config':42s} {'cold us':>8s} {'hot us':>8s} {'hot/cold':>8s}  flags"]  # fmt: skip
    for r in result["candidates"]:
        flags = (["HOT>1.5x"] if r["hot_flag"] else []) + [f"pick:{p}" for p in marks.get(r["config"], [])]
        ratio = f"{r['hot_over_cold']:8.2f}" if r["hot_over_cold"] is not None else f"{'-':>8s}"
        lines.append(f"  {r['config']:42s} {r['cold_us']:8.2f} {r['hot_us']:8.2f} {ratio}  {' '.join(flags)}")
    for policy, p in result["picks"].items():
        lines.append(f"  pick {policy:4s}: {p['config']:42s} cold {p['cold_us']:.2f} us ({p['cold_regret']:.2f}x "
                     f"best), hot {p['hot_us']:.2f} us ({p['hot_regret']:.2f}x best)")  # fmt: skip
    return lines


def spread(sweep: Mapping[int, Mapping[LaunchConfig, tuple[float, float]]], workers: list[dict]) -> dict:
    """(c): per policy and bucket, each process's pick judged on the parent's timings `sweep` ({bucket:
    {config: (cold, hot)}}): its hot and cold time over the best candidate's, the worst hot ratio over the
    processes, and whether that is within SPREAD_LIMIT. A pick the sweep did not time gets no ratio (and
    fails: it cannot be judged)."""
    out: dict[str, dict] = {}
    for policy in SPREAD_POLICIES:
        buckets = {}
        for bucket in sorted(sweep):
            best = tuning.best_times(sweep[bucket])
            rows = []
            for w in (w for w in workers if w.get("policy") == policy):
                got = w.get("buckets", {}).get(str(bucket))
                if got is None:
                    continue
                config = LaunchConfig.from_json(got["config"])
                timed = sweep[bucket].get(config)
                regret = tuning.regret(Times(*timed), best) if timed is not None else None
                rows.append({"process": w["process"], "config": short(config),
                             "hot_ratio": regret.hot_us if regret else None,
                             "cold_ratio": regret.cold_us if regret else None})  # fmt: skip
            if not rows:
                continue
            hot = [r["hot_ratio"] for r in rows]
            worst = None if None in hot else max(hot)
            buckets[str(bucket)] = {"processes": rows, "worst_hot_ratio": worst,
                                    "distinct_picks": len({r["config"] for r in rows}),
                                    "pass": worst is not None and worst <= SPREAD_LIMIT}  # fmt: skip
        judged = [b["worst_hot_ratio"] for b in buckets.values()]
        out[policy] = {"buckets": buckets, "limit": SPREAD_LIMIT,
                       "worst_hot_ratio": None if not judged or None in judged else max(judged),
                       "pass": bool(buckets) and all(b["pass"] for b in buckets.values())}  # fmt: skip
    return out


def format_spread(result: dict) -> list[str]:
    lines = []
    for policy, r in result.items():
        lines.append(f"spread, policy {policy}: each process's pick, hot over the best candidate's hot (cold ratio "
                     f"in brackets), limit {r['limit']:.2f}")  # fmt: skip
        for bucket, b in r["buckets"].items():
            cells = [
                f"p{p['process']} {p['config']} "
                + (f"{p['hot_ratio']:.2f}x ({p['cold_ratio']:.2f}x)" if p["hot_ratio"] is not None else "not timed")
                for p in b["processes"]
            ]
            worst = f"{b['worst_hot_ratio']:.2f}x" if b["worst_hot_ratio"] is not None else "-"
            lines.append(f"  bucket {int(bucket):4d}: worst {worst} {'pass' if b['pass'] else 'FAIL'}, "
                         f"{b['distinct_picks']} distinct | " + " | ".join(cells))  # fmt: skip
        worst = f"{r['worst_hot_ratio']:.2f}x" if r["worst_hot_ratio"] is not None else "-"
        lines.append(f"  policy {policy}: worst {worst} over {len(r['buckets'])} buckets: "
                     f"{'PASS' if r['pass'] else 'FAIL'}")  # fmt: skip
    return lines


def worker_result(stdout: str) -> dict | None:
    """The worker's result: the JSON on its last MARKER line, or None."""
    found = [line[len(MARKER) :] for line in stdout.splitlines() if line.startswith(MARKER)]
    return json.loads(found[-1]) if found else None


def key_shape(key: str) -> tuple[int, int] | None:
    """(K, N) of a linear layer's tuning key ('N4096|K1024|torch.float16|...'); None for another kernel's key."""
    m = re.match(r"N(\d+)\|K(\d+)\|", key)
    return (int(m.group(2)), int(m.group(1))) if m else None


def layer_name(key: str) -> str:
    """'K->N' of a linear layer's tuning key, or the key itself."""
    shape = key_shape(key)
    return f"{shape[0]}->{shape[1]}" if shape else key


def recording(module, record: list) -> contextlib.AbstractContextManager:
    """module's kernels time every candidate as the tuner does, append (key, timings) to record and take the
    `both` pick, bypassing the tuning cache, until the block ends."""

    def tune(scope, key, candidates, run, measure=None):
        timings = tuning.time_candidates(candidates, run, measure, f"{scope} {key}")
        record.append((key, timings))
        return tuning.pick(timings, "both")

    return tuned_by(module, tune)


def sweep_digits(dtype: torch.dtype, deadline: Deadline, skipped: list) -> dict[int, dict]:
    """{bucket: {config: Times}} for the digits MLP in dtype, printing each bucket's table."""
    layers = digits_layers(dtype)
    mlp = FusedMLP(layers)
    out = {}
    for bucket in BUCKETS:
        if deadline.left() < UNIT_MIN_S:
            skipped.append(f"digits {str(dtype).removeprefix('torch.')} bucket {bucket}")
            continue
        t = time.monotonic()
        record: list = []
        x = torch.randn(bucket, layers[0].weight.shape[1], device="cuda").to(dtype)
        with recording(mlp_mod, record):
            mlp(x)
        torch.cuda.synchronize()
        ((_, timings),) = record
        out[bucket] = timings
        name = f"digits {str(dtype).removeprefix('torch.')} bucket {bucket}"
        print("\n".join(format_case(name, analyze(timings))), flush=True)
        print(f"  [{time.monotonic() - t:.0f} s]", flush=True)
    return out


def sweep_wide(deadline: Deadline, skipped: list, batches: tuple[int, ...] = WIDE_BATCHES) -> dict[str, dict]:
    """{case name: {config: Times}} per layer of the wide MLP in float16 at `batches`, as the service's
    fused executor runs it (one FusedLinear per layer)."""
    from bench.kernels.models import build_wide
    from service.model.executors import Executor

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        executor = Executor(build_wide(tmp, seed=0), "fused", torch.device("cuda"), torch.float16)
        for batch in batches:
            if deadline.left() < UNIT_MIN_S:
                skipped.append(f"wide float16 batch {batch}")
                continue
            t = time.monotonic()
            record: list = []
            x = torch.randn(batch, executor.model.input_shape[0], device="cuda").half()
            with recording(linear_mod, record), torch.inference_mode():
                executor.forward(x)
            torch.cuda.synchronize()
            for i, (key, timings) in enumerate(record):
                name = f"wide float16 batch {batch} layer {i} ({layer_name(key)})"
                out[name] = timings
                print("\n".join(format_case(name, analyze(timings))), flush=True)
            print(f"  [{time.monotonic() - t:.0f} s]", flush=True)
    return out


def run_spread(processes: int, deadline: Deadline, skipped: list) -> list[dict]:
    """(c): processes x SPREAD_POLICIES fresh workers, alternating policies, sharing the time left equally."""
    jobs = [(p, policy) for p in range(1, processes + 1) for policy in SPREAD_POLICIES]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (process, policy) in enumerate(jobs):
            left = deadline.left()
            if left < MIN_WORKER_S:
                skipped += [f"spread process {p} ({pol})" for p, pol in jobs[n:]]
                print(f"spread: {left:.0f} s left: skipping {len(jobs) - n} of {len(jobs)} processes", flush=True)
                break
            share = max(MIN_WORKER_S, left / (len(jobs) - n))
            env = {**os.environ, "FUSEDSERVE_TUNING": "true", "FUSEDSERVE_TUNING_TIMING": policy,
                   "FUSEDSERVE_TUNING_CACHE": os.path.join(tmp, f"tuning-{process}-{policy}.json")}  # fmt: skip
            argv = [sys.executable, "-c", WORKER, "--until", str(time.time() + share), "--process", str(process)]
            t = time.monotonic()
            try:
                proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=share + 60)
                got = worker_result(proc.stdout)
                error = None if got else f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
            except subprocess.TimeoutExpired:
                got, error = None, f"no result within {share + 60:.0f} s"
            got = got or {"policy": policy, "process": process, "buckets": {}, "error": error}
            results.append(got)
            tuned = sorted(int(b) for b in got["buckets"])
            print(f"spread: process {process} ({policy}): buckets {tuned or 'none'} in {time.monotonic() - t:.0f} s "
                  f"(share {share:.0f} s)" + (f"; skipped {got['skipped']}" if got.get("skipped") else "")
                  + (f"; {error}" if error else ""), flush=True)  # fmt: skip
    return results


def sweep(args: argparse.Namespace) -> dict:
    deadline = Deadline(args.time_limit)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    skipped: list[str] = []
    out: dict = {"time_limit_s": args.time_limit, "processes": args.processes, "cases": {}}

    def record(prefix: str, timings_by_case: Mapping) -> None:
        for name, timings in timings_by_case.items():
            out["cases"][f"{prefix}{name}"] = analyze(timings)

    digits16 = {}
    if "digits-float16" in cases:
        digits16 = sweep_digits(torch.float16, deadline, skipped)
        record("digits float16 bucket ", digits16)
    if args.processes > 0:
        if digits16:
            workers = run_spread(args.processes, deadline, skipped)
            out["workers"] = workers
            out["spread"] = spread(digits16, workers)
            print("\n".join(format_spread(out["spread"])), flush=True)
        else:
            skipped.append("spread (needs the digits-float16 sweep)")
    if "digits-bfloat16" in cases:
        record("digits bfloat16 bucket ", sweep_digits(torch.bfloat16, deadline, skipped))
    if "wide-float16" in cases:
        record("", sweep_wide(deadline, skipped, args.wide_batches))
    out["skipped"] = skipped
    if skipped:
        print(f"skipped (--time-limit {args.time_limit:.0f} s): {', '.join(skipped)}", flush=True)
    return out


def worker(argv: list[str]) -> None:
    """One process of (c): the real tuner (the environment sets its policy and an empty cache) on the digits
    MLP in float16 at every bucket, until --until; prints its picks as one MARKER line of JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--until", type=float, required=True)  # time.time() at which to stop between buckets
    p.add_argument("--process", type=int, required=True)
    args = p.parse_args(argv)
    t0 = time.time()
    policy = tuning.timing_policy()
    timed: list = []  # what the tuner's time_candidates returned, call by call
    real = tuning.time_candidates

    def time_candidates(*a, **k):
        timed.append(real(*a, **k))
        return timed[-1]

    tuning.time_candidates = time_candidates  # tune() still runs whole: cache, pick, put
    layers = digits_layers(torch.float16)
    mlp = FusedMLP(layers)
    picks, skipped = {}, []
    for bucket in BUCKETS:
        if time.time() > args.until:
            skipped.append(bucket)
            continue
        x = torch.randn(bucket, layers[0].weight.shape[1], device=DEVICE).half()
        before = len(timed)
        mlp(x)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        if len(timed) != before + 1:
            raise RuntimeError(f"bucket {bucket}: the tuner timed {len(timed) - before} sets of candidates, not 1")
        config = mlp._configs[(bucket, "ieee")]
        timings = timed[-1]
        own = tuning.regret(timings[config], tuning.best_times(timings))
        picks[str(bucket)] = {"config": config.to_json(), "short": short(config), "cold_us": timings[config].cold_us,
                              "hot_us": timings[config].hot_us, "own_cold_regret": own.cold_us,
                              "own_hot_regret": own.hot_us,
                              "same_timings": {pol: short(tuning.pick(timings, pol)) for pol in POLICIES}}  # fmt: skip
        print(f"process {args.process} ({policy}) bucket {bucket}: {short(config)}", file=sys.stderr, flush=True)
    result = {"policy": policy, "process": args.process, "buckets": picks, "skipped": skipped,
              "elapsed_s": time.time() - t0}  # fmt: skip
    print(MARKER + json.dumps(result), flush=True)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, default=4, help="fresh processes per policy for the spread (0: none)")
    # 200 s: with the imports and the last bucket's overrun the probe ends within bench/gpu_session.sh's 240 s
    p.add_argument("--time-limit", type=float, default=200.0, help="seconds; work that does not fit is skipped")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--wide-batches", type=batch_list, default=WIDE_BATCHES,
                   help=f"the wide MLP's batches [{','.join(map(str, WIDE_BATCHES))}]")  # fmt: skip


def batch_list(text: str) -> tuple[int, ...]:
    """'1,16,256' -> (1, 16, 256); argparse reports a ValueError as a usage error naming the option."""
    batches = tuple(int(b) for b in text.split(",") if b.strip())
    if not batches or min(batches) < 1:
        raise ValueError(text)
    return batches


if __name__ == "__main__":
    main("tuner_picks", sweep, options)
