"""fusedserve's HTTP service: configuration, model loading and planning, batching, metrics, routes."""
