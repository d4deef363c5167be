"""Layout planner and model FLOPs: predict per-rank memory, communication and step time of every
valid ``(tp, cp, pp, dp, sp, AC)`` layout of a run config (``vitp-plan``), and count the model FLOPs
the training telemetry reports as TFLOP/s and MFU.

- :mod:`.shapes`: model sizes, exact parameter counts per layer (meta build), the TP sharding rule
- :mod:`.flops`: :func:`model_flops_per_step` (6N-style linears + attention, factorized video counted per block kind)
- :mod:`.layout`: :class:`LayoutSpec`, the valid layouts (by :func:`vitp.config.validate_layout`)
- :mod:`.memory`: per-rank memory (ZeRO state table, saved activations per block, 1F1B in-flight micro-batches)
- :mod:`.comm`: TP and context-parallel collectives (as :class:`vitp.parallel.CommRecorder` records them), pipeline sends, DP reduction
- :mod:`.devices`: device profiles (H100/H200/A100 datasheet presets, a measured CPU profile, an assumed one)
- :mod:`.steptime`: step time from a profile; :mod:`.planner`: ranking and the table
- :mod:`.units`: :func:`format_bytes`, how every printed size is written (three significant digits, B to TiB)
- :mod:`.phases`: memory and time per rank of the sample grid, held-out loss and final samples
- :mod:`.latents`: a latent run's shapes and tokens, and its VAE decoder's memory (:func:`latent_plan`)
- :mod:`.auto`: the layout ``parallel=auto`` trains with (the first fitting row, fixed keys held)

Pure functions of the config: nothing here starts a process group or imports the trainer.
"""
from .auto import AUTO_KEYS, AutoChoice, choose_layout, fixed_keys
from .comm import CP_TAGS, Collective, StageComm, cp_collectives, plan_collectives, pp_send_bytes, step_comm, tp_collectives
from .devices import (PRESETS, DeviceProfile, cached_cpu_profile, cpu_profile, cuda_preset, default_cpu_profile,
                      get_profile, measure_cpu_profile)
from .flops import forward_flops_per_sample, model_flops_per_step
from .latents import LatentPlan, decode_memory_bytes, latent_plan, with_vae_geometry
from .layout import LayoutSpec, candidate_layouts, layout_of
from .memory import STATE_BYTES, MemoryOptions, StageMemory, StateBytes, block_saved, stage_memory
from .phases import PhaseCost, format_phases, phase_costs, phase_costs_of, replica_bytes
from .planner import Prediction, format_table, plan, predict
from .shapes import ModelShape, layer_params, layer_params_per_rank, plan_report, stage_layer_ranges
from .steptime import step_time
from .units import GIB, format_bytes

__all__ = [
    "AUTO_KEYS", "AutoChoice", "choose_layout", "fixed_keys", "CP_TAGS", "cp_collectives", "plan_collectives",
    "Collective", "DeviceProfile", "LatentPlan", "decode_memory_bytes", "latent_plan", "with_vae_geometry",
    "PhaseCost", "format_phases", "phase_costs", "phase_costs_of", "replica_bytes", "LayoutSpec",
    "MemoryOptions", "ModelShape", "PRESETS", "Prediction",
    "STATE_BYTES", "StageComm", "StageMemory", "StateBytes", "block_saved", "cached_cpu_profile", "candidate_layouts",
    "cpu_profile", "default_cpu_profile",
    "cuda_preset", "GIB", "format_bytes", "format_table", "forward_flops_per_sample", "get_profile", "layer_params",
    "layer_params_per_rank", "layout_of", "measure_cpu_profile", "model_flops_per_step", "plan", "pp_send_bytes",
    "plan_report", "predict", "stage_layer_ranges", "stage_memory", "step_comm", "step_time", "tp_collectives",
]
