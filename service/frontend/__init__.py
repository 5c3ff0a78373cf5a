"""The front end: one of FUSEDSERVE_WORKERS processes. It serves HTTP (FastAPI, with /predict and the Open Inference
Protocol's REST routes ahead of FastAPI at the ASGI level) and gRPC, parses and validates each request, and hands
its rows to an engine over the link. It never imports `service.engine`, nor torch but for a model that takes encoded
images, whose files it decodes and resizes (service/frontend/images.py)."""
