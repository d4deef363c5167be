"""Media files: GIF/MP4 writers and reader (:mod:`.video`), sample grids, frame strips and
per-class sample folders (:mod:`.grids`)."""
from .grids import caption_rows, frame_strip, to_grid, video_grid, write_video_samples
from .video import MIN_SIDE, read_video_frames, to_uint8_frames, write_gif, write_mp4

__all__ = ["MIN_SIDE", "caption_rows", "frame_strip", "read_video_frames", "to_grid", "to_uint8_frames", "video_grid",
           "write_gif", "write_mp4", "write_video_samples"]
