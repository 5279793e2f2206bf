"""Server options: one frozen dataclass, the source of `hetmoe serve`'s defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Options of `hetmoe serve`; checked when built."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the user opens it up."""
    port: int = 8000
    """TCP port (0 picks a free one)."""
    api_key: str | None = None
    """When set, every route but /health and the chat page needs `Authorization: Bearer KEY`."""
    max_queue: int = 64
    """Requests waiting for a KV slot at most; one more is answered 429 at once."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 beyond)."""
    model_name: str | None = None
    """Name clients use in `model`; None: the MODEL argument as given."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
