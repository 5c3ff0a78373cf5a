"""The model: its on-disk format (spec), loading (loader), fusion planning (planner), and the two
executors that run the same plan fused (Triton) or unfused (torch)."""
