"""vitp: vision transformers for image and video generation with tensor, pipeline and data parallelism.

Packages, in import order: :mod:`vitp.config` / :mod:`vitp.utils` -> :mod:`vitp.parallel`
(model-agnostic TP/SP) -> :mod:`vitp.models` (the generator and its TP plan) ->
:mod:`vitp.objectives`, :mod:`vitp.data` -> :mod:`vitp.pipeline` (DeepSpeed stages) ->
:mod:`vitp.checkpoint` -> :mod:`vitp.eval`, :mod:`vitp.media` -> :mod:`vitp.train` (the
``Trainer``) -> :mod:`vitp.cli` (console entry points).
"""

__version__ = "0.1.0"

import sys as _sys

if "-m" in _sys.orig_argv and _sys.orig_argv[_sys.orig_argv.index("-m") + 1:][:1] == ["vitp.train"]:
    # ``python -m vitp.train`` (torchrun, deepspeed): handle Ctrl-C before the package's heavy
    # imports, as the vitp-train script does (vitp.cli.entry)
    from vitp import interrupt as _interrupt

    _interrupt.install()
