"""The generator as DeepSpeed pipeline stages, and its full weights gathered from / sliced into them."""
from .stages import BlockPipe, EmbedPipe, FinalPipe, build_pipeline, stage_blocks
from .weights import full_shape, gather_full_state, load_full_state

__all__ = ["BlockPipe", "EmbedPipe", "FinalPipe", "build_pipeline", "full_shape", "gather_full_state",
           "load_full_state", "stage_blocks"]
