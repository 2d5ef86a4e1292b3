"""pdcluster's native MLA engine (DeepSeek-V2/V3) with a vLLM-shaped offline API.

``LLM``, ``RequestOutput`` and ``SamplingParams`` are imported on first use, so processes that
only need a light part of the package (the proxy: ``engine.tokenizer``) do not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
