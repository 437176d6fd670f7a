"""pagedserve gateway: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of
the scheduler's serving.v1 gRPC API. CPU only; never imports torch or transformers."""
