"""vitp: vision transformers for image and video generation with tensor, pipeline and data parallelism."""

__version__ = "0.1.0"
