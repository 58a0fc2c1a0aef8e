"""The HTTP surface: the REST API and its admin twin, request validation, the server that runs
them (uvicorn, with its protocol limits), CORS, per-client rate limits and the request and
per-worker metrics."""
