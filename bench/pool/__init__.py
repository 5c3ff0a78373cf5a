"""`fusedserve bench pool`: AvgPool2D + ReLU, ours against the CPU, torch and torch.compile. cli.py parses the
flags (no torch), run.py runs them."""
