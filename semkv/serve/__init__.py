"""`semkv serve`: the OpenAI-compatible server, in two processes. The web process (cli.py starts it; app.py: routes;
client.py: its end of the engine; protocol.py: request bodies; metrics.py: /metrics) and the engine process
(engine_core.py), which talk in the messages of messages.py over ZeroMQ."""
