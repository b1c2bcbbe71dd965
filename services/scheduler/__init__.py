"""Engine core: request queues, token budget, KV block accounting and prefix caching."""
