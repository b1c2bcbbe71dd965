"""The frontend's HTTP API beside its gRPC API: OpenAI-compatible endpoints,
``/metrics`` and the live dashboard, served by uvicorn on the frontend's event
loop and sharing its AsyncLLM (see ``app.py`` for the routes)."""
