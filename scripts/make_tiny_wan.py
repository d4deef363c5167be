"""Write a tiny random Wan text-to-video pipeline folder with diffusers alone (no download).

    python scripts/make_tiny_wan.py OUT [--sharded] [--no-vae] [--seed 0] [--two-experts | --ti2v]

``OUT/transformer/``: a ``WanTransformer3DModel`` (2 layers, 2 heads of 16 channels, FFN 64,
text 32, 4 latent channels, patches (1, 2, 2)) whose every parameter is perturbed with seeded
noise (diffusers' init leaves norms at one and nothing random in some paths; noise makes every
weight matter to the output), saved with ``save_pretrained`` (``--sharded``: shards of about
40 kB and ``diffusion_pytorch_model.safetensors.index.json``); ``OUT/scheduler/``: Wan's
``UniPCMultistepScheduler`` (flow prediction, ``flow_shift=3``); ``OUT/vae/``: a tiny random
``AutoencoderKLWan`` coding 4 latent channels (skip with ``--no-vae``); ``OUT/model_index.json``.
The umT5 text encoder and its tokenizer are left out (a tokenizer cannot be built without its
vocabulary files): both are null in ``model_index.json``, so prompts must come as embeddings
(``WanPipeline.from_pretrained(OUT, text_encoder=None, tokenizer=None)`` loads the folder).

``--two-experts``: Wan 2.2 T2V-A14B's layout, a second transformer ``OUT/transformer_2/`` (the
low-noise expert, other seeded weights) and ``boundary_ratio`` :data:`BOUNDARY` in
``model_index.json``. ``--ti2v``: Wan 2.2 TI2V-5B's layout, 48 latent channels, a tiny Wan 2.2
VAE (:data:`TINY_VAE_22`: ``z_dim`` 48, ``is_residual``, ``patch_size`` 2, 16x spatial) and
``expand_timesteps: true`` (per-token timesteps) in ``model_index.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict

import torch

TINY = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=64, ffn_dim=64, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
            pos_embed_seq_len=None)
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                latents_mean=[0.1, -0.1, 0.0, 0.2], latents_std=[0.5, 1.0, 1.5, 2.0])

BOUNDARY = 0.8  # the tiny two-expert pipeline's boundary_ratio (Wan2.2-T2V-A14B: 0.875): 4 UniPC steps at
#                 shift 3 are t = 999, 900 (high-noise expert), 750, 500 (low-noise)
TI2V = dict(in_channels=48, out_channels=48)  # Wan 2.2 TI2V-5B's latent channels, the tiny sizes otherwise
TINY_VAE_22 = dict(base_dim=16, decoder_base_dim=16, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                   temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                   patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                   latents_mean=[0.01 * (i % 7 - 3) for i in range(48)],
                   latents_std=[0.5 + 0.05 * (i % 11) for i in range(48)])


def tiny_transformer(seed: int = 0, noise: float = 0.05, **overrides: Any):
    """A :data:`TINY` ``WanTransformer3DModel`` (``overrides`` replace config keys) with seeded
    weights, every parameter perturbed by ``noise`` times a standard normal."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def write_transformer(model, folder: Path, sharded: bool = False) -> Path:
    """``model.save_pretrained(folder)`` as safetensors, in shards of 40 kB with ``sharded``."""
    model.save_pretrained(str(folder), safe_serialization=True, **({"max_shard_size": "40KB"} if sharded else {}))
    return folder


def _tiny_vae(seed: int, options: Dict[str, Any]):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    model = AutoencoderKLWan(**options)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def write_pipeline(out: Path, sharded: bool = False, vae: bool = True, seed: int = 0, transformer=None,
                   two_experts: bool = False, ti2v: bool = False) -> Path:
    """The folder of the module docstring at ``out`` (with ``transformer`` instead of
    :func:`tiny_transformer`'s if given; ``two_experts``: also ``transformer_2/`` of seed ``seed +
    7`` and ``boundary_ratio``; ``ti2v``: the TI2V-5B layout); returns it. Raises ``ValueError``
    for both layouts at once (no published Wan has both)."""
    import diffusers
    from diffusers import UniPCMultistepScheduler

    if two_experts and ti2v:
        raise ValueError("--two-experts (Wan 2.2 A14B) and --ti2v (Wan 2.2 TI2V-5B) are different models; give one")
    out, sizes = Path(out), TI2V if ti2v else {}
    write_transformer(transformer if transformer is not None else tiny_transformer(seed, **sizes),
                      out / "transformer", sharded)
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                            flow_shift=3.0).save_pretrained(str(out / "scheduler"))
    index: Dict[str, Any] = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
                             "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                             "transformer": ["diffusers", "WanTransformer3DModel"],
                             "transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": ti2v,
                             "text_encoder": [None, None], "tokenizer": [None, None], "vae": [None, None]}
    if two_experts:
        write_transformer(tiny_transformer(seed + 7), out / "transformer_2", sharded)
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=BOUNDARY)
    if vae:
        vae_model = _tiny_vae(seed + 1, TINY_VAE_22 if ti2v else TINY_VAE)
        vae_model.save_pretrained(str(out / "vae"), safe_serialization=True)
        index["vae"] = ["diffusers", "AutoencoderKLWan"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write (created)")
    ap.add_argument("--sharded", action="store_true", help="write the transformer as several shards and an index")
    ap.add_argument("--no-vae", action="store_true", help="leave out the tiny VAE")
    ap.add_argument("--seed", type=int, default=0)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--two-experts", action="store_true",
                      help="Wan 2.2 A14B's layout: a low-noise transformer_2/ and boundary_ratio")
    kind.add_argument("--ti2v", action="store_true", help="Wan 2.2 TI2V-5B's layout: 48 latent channels, the Wan 2.2 "
                      "VAE, expand_timesteps")
    args = ap.parse_args(argv)
    out = write_pipeline(args.out, sharded=args.sharded, vae=not args.no_vae, seed=args.seed,
                         two_experts=args.two_experts, ti2v=args.ti2v)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    print(json.dumps({"folder": str(out), "files": files}, indent=2))


if __name__ == "__main__":
    main()
