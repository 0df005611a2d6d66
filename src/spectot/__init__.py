"""spectot: lossless speculative acceleration of tree-search reasoning with LLMs.

Heavy modules (torch, transformers) load on first use, so ``import spectot`` and ``spectot --help``
stay instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from spectot.pipeline import Generation, Pipeline

__all__ = ["Generation", "Pipeline", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "Generation"):
        from spectot import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
