"""`semkv serve`: the OpenAI-compatible server (app.py: routes; worker.py: the engine thread; protocol.py: request bodies; metrics.py: /metrics)."""
