"""`jaxinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

app.py builds the ASGI app (routes, auth, error envelopes); protocol.py declares the request bodies;
params.py maps them to SamplingParams; completions.py and chat.py run them and build responses and SSE
streams; metrics.py exports Prometheus metrics; main.py is the command line. The server's dependencies are
the `serve` extra (`pip install -e .[serve]`); nothing here is imported by the rest of jaxinfer.
"""
