"""bench/serve/ab.py's pure parts: the systems' command lines, a switch's delay from the probe's answers, the
targets' ratios over rounds and the report. The runs themselves need a GPU host (bench/README.md)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.serve.ab import SYSTEMS, compare, report, serve_args, switch_delay


def test_the_systems_are_fused_ab_and_ab_with_a_shadow():
    assert serve_args("fused") == ["--mode", "fused"] and serve_args("ab") == ["--mode", "ab"]
    assert serve_args("ab_shadow") == ["--mode", "ab", "--shadow-every", "16"]
    assert serve_args("unfused") == ["--mode", "unfused"] and SYSTEMS == ("fused", "ab", "ab_shadow")


def test_a_switch_takes_effect_at_the_answer_after_which_all_are_in_the_new_mode():
    answers = [  # (sent, answered, status, mode)
        (0.0, 0.01, 200, "fused"),
        (1.0, 1.01, 200, "fused"),  # sent after the signal at 0.9, still fused: the old mode took it
        (1.1, 1.2, 200, "unfused"),
        (1.15, 1.25, 200, "fused"),  # an old-mode answer after a new one: the switch is not done yet
        (1.3, 1.4, 200, "unfused"),
        (2.0, 2.05, 200, "fused"),  # after the next signal (1.95): not this switch's
    ]
    assert abs(switch_delay(answers, 0.9, "unfused", 1.95) - 0.5) < 1e-9
    assert abs(switch_delay(answers, 1.95, "fused") - 0.1) < 1e-9
    assert switch_delay(answers, 0.9, "ab", 1.95) is None


def test_targets_compare_the_median_of_the_rounds():
    args = SimpleNamespace(rows=(1,), connections=(64,))
    results = [
        {"system": s, "rows": 1, "connections": 64, "req_per_s": v, "round": r}
        for r, (f, a, sh) in enumerate([(100, 96, 95), (100, 90, 89), (100, 97, 96)])
        for s, v in (("fused", f), ("ab", a), ("ab_shadow", sh))
    ]
    got = {row["ratio"]: (round(row["value"], 3), row["met"]) for row in compare(results, args)}
    assert got == {"ab/fused": (0.96, True), "ab_shadow/ab": (0.99, True)}
    for r in results:
        r.update(p50_ms=1.0, p99_ms=2.0, sent=10, answered=10, ok=True, problems=[])
    doc = {"gpu": "h100", "workers": 8, "command": "python -m bench.serve.ab", "targets": {"switch_s": 2.0},
           "summary": compare(results, args), "results": results}  # fmt: skip
    text = report(doc)
    assert "| 1 | 64 | ab/fused | 0.960 | ≥ 0.95 | yes |" in text and text.count("| fused | 1 | 64 |") == 3
