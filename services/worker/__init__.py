"""Worker service: persistent batch, paged KV cache, model execution and sampling."""
