"""`infinigen-rt serve`: an OpenAI-compatible HTTP server over the engine (needs the `serve` extra).

protocol.py (request models, errors, response bodies) -> scheduler.py (one thread owns the engine, batches)
-> metrics.py (Prometheus text) -> routes.py (the routes, streaming, auth) -> app.py (the FastAPI app: body
limit, error objects). Only app.py, routes.py and protocol.py import fastapi/pydantic; the CLI imports them when
`serve` runs.
"""
