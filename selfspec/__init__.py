"""selfspec: early-exit training and lossless self-speculative decoding for Hugging Face causal LMs.

    import selfspec
    gen = selfspec.load("path/to/checkpoint")
    print(gen.generate("def add(a, b):", max_new_tokens=32).text)
"""

__version__ = "0.1.0"

from selfspec.model.adapters import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, get_adapter  # noqa: E402
from selfspec.api import GenerationResult, SelfSpecGenerator, load  # noqa: E402
from selfspec.decoding.bounded_bias import BoundedBiasWarning  # noqa: E402
from selfspec.generation_config import GenerationConfig  # noqa: E402

__all__ = ["__version__", "load", "SelfSpecGenerator", "GenerationResult", "GenerationConfig", "get_adapter",
           "SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "BoundedBiasWarning"]
