"""The comparison servers of `bench serve` (run under uvicorn, 1 or N workers): `empty` (the ceiling: FastAPI
+ orjson with no model) and `eager` (the naive app: eager torch per request)."""
