"""The training objective (flow matching, x-prediction, v-loss) and its ODE samplers."""
from .flow import FlowMatchingLoss, draw_sample_noise, make_pair, sample_seed, v_loss, velocity
from .samplers import guided, sample

__all__ = ["FlowMatchingLoss", "draw_sample_noise", "guided", "make_pair", "sample", "sample_seed", "v_loss", "velocity"]
