"""Training objectives and samplers."""
from .flow import FlowMatchingLoss, draw_sample_noise, make_pair, sample, sample_seed, velocity

__all__ = ["FlowMatchingLoss", "draw_sample_noise", "make_pair", "sample", "sample_seed", "velocity"]
