"""`fusedserve bench kernels`: ours against eager, F.linear, cuBLASLt, cuDNN and torch.compile, per layer, conv and
model. cli.py parses the flags (no torch), run.py runs them; timing.py measures, providers.py, models.py and
convs.py say what is compared, report.py, results.py, targets.py and plot.py write the results."""
