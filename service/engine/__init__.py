"""The engine: one process per GPU. It owns the model, its CUDA graphs and tuned kernels, and one batch queue that
every front end's requests join; it runs batches and sends each request's rows back. It never imports
`service.frontend`."""
