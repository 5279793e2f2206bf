"""OpenAI-compatible HTTP server, SSE streaming and the static chat page."""
