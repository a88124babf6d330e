"""nanovllm: a small offline LLM inference engine with vLLM's API.

`LLM` is imported lazily so that the metadata modules (sequence, block manager, scheduler) stay importable without
torch.
"""
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    if name == "LLM":
        from nanovllm.llm import LLM
        return LLM
    if name == "__version__":
        from nanovllm.version import package_version
        return package_version()
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
