"""vitp: vision transformers for image and video generation with tensor, pipeline and data parallelism.

Packages, in import order: :mod:`vitp.config` / :mod:`vitp.utils` -> :mod:`vitp.parallel`
(model-agnostic TP/SP) -> :mod:`vitp.models` (the generator and its TP plan) ->
:mod:`vitp.objectives`, :mod:`vitp.data` -> :mod:`vitp.pipeline` (DeepSpeed stages) ->
:mod:`vitp.checkpoint` -> :mod:`vitp.eval`, :mod:`vitp.media` -> :mod:`vitp.train` (the
``Trainer``) -> :mod:`vitp.cli` (console entry points).
"""

__version__ = "0.1.0"
