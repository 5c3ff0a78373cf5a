"""`fusedserve bench zoo`: torchvision's classification families (families.py) exported three ways
(exporters.py), imported, planned and checked against onnxruntime on the CPU (check.py, run.py), or timed on a GPU
(gpu.py); report.py writes the JSON and the markdown. cli.py parses the flags (no torch)."""
