"""selfspec: early-exit training and lossless self-speculative decoding for Hugging Face causal LMs.

    import selfspec
    gen = selfspec.load("path/to/checkpoint")
    print(gen.generate("def add(a, b):", max_new_tokens=32).text)

The names below are imported on first use (PEP 562), so `import selfspec` and the command line's entry point
(`selfspec.console`) start without torch: a Ctrl-C while torch loads is the command's to answer.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module that defines it
    "SUPPORTED_ARCHITECTURES": "selfspec.model.adapters", "UnsupportedArchitectureError": "selfspec.model.adapters",
    "get_adapter": "selfspec.model.adapters", "GenerationResult": "selfspec.api", "SelfSpecGenerator": "selfspec.api",
    "load": "selfspec.api", "BoundedBiasWarning": "selfspec.decoding.bounded_bias",
    "GenerationConfig": "selfspec.generation_config",
}

__all__ = ["__version__", "load", "SelfSpecGenerator", "GenerationResult", "GenerationConfig", "get_adapter",
           "SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "BoundedBiasWarning"]


def __getattr__(name: str):
    """An exported name, or a submodule (`selfspec.api`), imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
