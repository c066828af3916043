"""loopline: RL post-training for language models.

`import loopline; loopline.train(config, reward_fn=...)`: the Python API (loopline.api), imported on first use so
that `import loopline.config` and the CLI's config checks stay free of torch.
"""

from __future__ import annotations

from typing import Any

from loopline.version import __version__

# loopline.api's names, served from the package (PEP 562)
API = ("train", "sft", "dpo", "rm", "evaluate", "generate", "export", "RunConfig", "RunResult", "Generation")
__all__ = ["__version__", "config", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        from loopline import api

        return getattr(api, name)
    if name == "config":  # `loopline.config.GRPOConfig(...)` right after `import loopline`
        import loopline.config  # not `from loopline import config`: that asks this function again

        return loopline.config
    raise AttributeError(f"module 'loopline' has no attribute {name!r}")
