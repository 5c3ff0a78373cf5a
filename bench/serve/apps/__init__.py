"""The comparison servers of `bench serve`, 1 or N workers each: under uvicorn, `empty` (the HTTP ceiling: FastAPI
+ orjson with no model) and `eager` (the naive app: eager torch per request); on their own, `empty_grpc` (the gRPC
ceiling: grpc.aio with the Open Inference Protocol's service and no model)."""
