"""pdcluster's native MLA engine (DeepSeek-V2/V3) with a vLLM-shaped offline API."""

from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
