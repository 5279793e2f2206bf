"""hetmoe: huge Mixture-of-Experts LLMs on one workstation, GPU and CPU as one machine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationOutput", "__version__"]

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM
    from hetmoe.engine.requests.sampler import GenerationOutput


def __getattr__(name: str) -> Any:
    # Lazy so that `import hetmoe` (and `hetmoe info`) stay fast and torch-free.
    if name == "LLM":
        from hetmoe.engine.engine import LLM

        return LLM
    if name == "GenerationOutput":
        from hetmoe.engine.requests.sampler import GenerationOutput

        return GenerationOutput
    raise AttributeError(f"module 'hetmoe' has no attribute {name!r}")
