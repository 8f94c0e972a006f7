"""tokenmill: an LLM inference and serving engine (vLLM-compatible API)."""

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
