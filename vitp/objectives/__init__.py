"""The training objectives and their samplers: flow matching with x-prediction and v-loss
(:mod:`.flow`, :mod:`.samplers`), and Wan's velocity flow matching (:mod:`.wan_flow`) with
diffusers' schedulers in ``WanPipeline``'s loop (:mod:`.wan_sampling`)."""
from .flow import FlowMatchingLoss, draw_sample_noise, make_pair, sample_seed, v_loss, velocity
from .samplers import guided, sample
from .wan_flow import WanFlowLoss, draw_sigmas, make_wan_pair, wan_loss
from .wan_sampling import decode_latents, load_scheduler, pad_prompt_embeds, sample_wan

__all__ = ["FlowMatchingLoss", "WanFlowLoss", "decode_latents", "draw_sample_noise", "draw_sigmas", "guided",
           "load_scheduler", "make_pair", "make_wan_pair", "pad_prompt_embeds", "sample", "sample_seed", "sample_wan",
           "v_loss", "velocity", "wan_loss"]
