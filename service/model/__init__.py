"""The model: its on-disk format, a graph of ops (spec), loading (loader), the importers that write that format
from an ONNX file (onnx_import) or a torch module (torch_import, export), fusion planning (planner), and the two
executors that run the same plan fused (Triton) or unfused (torch)."""
