"""The generator and Wan as DeepSpeed pipeline stages, and full weights sliced into them."""
from .stages import BlockPipe, EmbedPipe, FinalPipe, build_parallel_pipeline, build_pipeline, stage_blocks
from .wan_stages import WanBlockPipe, WanEmbedPipe, WanFinalPipe, build_parallel_wan_pipeline, build_wan_pipeline
from .weights import full_shape, load_full_state

__all__ = ["BlockPipe", "EmbedPipe", "FinalPipe", "WanBlockPipe", "WanEmbedPipe", "WanFinalPipe", "build_parallel_pipeline",
           "build_parallel_wan_pipeline", "build_pipeline", "build_wan_pipeline", "full_shape", "load_full_state",
           "stage_blocks"]
