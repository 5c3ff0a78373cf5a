"""`fusedserve bench serve`: the service end to end under load, against an empty route and an eager-torch app.
cli.py parses the flags (no torch, no numpy) into plan.py's Plan, run.py runs it with loadgen.py's clients
(v2.py: the Open Inference Protocol's bodies), accounting.py checks that nothing was lost, report.py writes
the results; apps/ holds the comparison servers."""
