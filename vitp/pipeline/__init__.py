"""The generator as DeepSpeed pipeline stages, and full weights sliced into them."""
from .stages import BlockPipe, EmbedPipe, FinalPipe, build_parallel_pipeline, build_pipeline, stage_blocks
from .weights import full_shape, load_full_state

__all__ = ["BlockPipe", "EmbedPipe", "FinalPipe", "build_parallel_pipeline", "build_pipeline", "full_shape",
           "load_full_state", "stage_blocks"]
