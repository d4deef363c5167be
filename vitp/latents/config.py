"""A run config's latent fields, filled from a latent pack's manifest or a VAE folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

LATENT_FIELDS = ("vae", "latent_channels", "vae_compression", "resolution", "num_frames", "channels")


def pack_latent_meta(url: str) -> Optional[Dict[str, Any]]:
    """The ``latent`` entry of the manifest of the pack at ``url`` (:func:`vitp.latents.pack.latent_meta`),
    or None for a pixel pack or one that cannot be read here (:class:`vitp.data.shards.ShardIndex`
    reports that when the data is built)."""
    from vitp.remote import is_remote, join_url, read_bytes

    where = join_url(str(url).rstrip("/"), "index.json") if is_remote(url) else str(Path(url).expanduser() / "index.json")
    try:
        meta = json.loads(read_bytes(where)).get("vitp", {})
    except Exception:  # noqa: BLE001 - missing, damaged, unreachable: said when the data set is opened
        return None
    return meta.get("latent") if isinstance(meta, dict) and meta.get("kind") == "latent" else None


def adopt_latent_data(cfg: Any) -> None:
    """Fill ``cfg.data``'s latent fields in place, so that the model's input shape follows the latents.

    - ``data=shards`` on a latent pack: ``data.vae`` (the pack's VAE folder, unless ``data.vae``
      names a copy of the same VAE: same config hash), ``data.latent_channels``,
      ``data.vae_compression`` and the pixel ``resolution`` / ``num_frames`` / ``channels`` the pack
      was encoded at (samples decode to them);
    - else with ``data.vae``: ``latent_channels`` and ``vae_compression`` from its ``config.json``.

    Raises ``ValueError`` when ``data.vae`` is another VAE than the pack's, or when explicit
    ``data.latent_channels`` / ``data.vae_compression`` disagree with ``data.vae``;
    ``FileNotFoundError`` for a ``data.vae`` folder without ``config.json``."""
    from vitp.latents.vae import geometry

    d = cfg.data
    meta = pack_latent_meta(d.shards) if d.name == "shards" and d.shards else None
    if meta is not None:
        g, px = meta["geometry"], meta["pixels"]
        if d.vae and str(Path(d.vae).expanduser().resolve()) != meta["vae"] and Path(d.vae).expanduser().exists():
            mine = geometry(d.vae)
            if mine.config_sha256 != g["config_sha256"]:
                raise ValueError(f"data.vae={d.vae} is another VAE ({mine.cls}) than the one data.shards={d.shards} "
                                 f"was encoded with ({g['cls']} at {meta['vae']}); unset data.vae to use the pack's")
        else:
            d.vae = meta["vae"]
        d.latent_channels, d.vae_compression = int(g["channels"]), [int(g["temporal"]), int(g["spatial"])]
        d.resolution, d.num_frames, d.channels = list(px["resolution"]), int(px["num_frames"]), int(px["channels"])
        return
    if not d.vae:
        return
    if not Path(d.vae).expanduser().exists():
        return  # not on this machine (a recipe planned elsewhere): vitp-pack and training refuse it (check_trainable)
    g = geometry(d.vae)
    want = (g.channels, [g.temporal, g.spatial])
    have = (int(d.latent_channels), [int(v) for v in d.vae_compression])
    if have == (0, [1, 1]):
        d.latent_channels, d.vae_compression = want[0], want[1]
    elif have != want:
        raise ValueError(f"data.latent_channels={have[0]} data.vae_compression={have[1]} disagree with data.vae="
                         f"{d.vae} ({g.cls}: {want[0]} channels, compression {want[1]}); leave them out, they are "
                         f"read from the VAE")


def check_trainable(data: Any) -> None:
    """Refuse, naming the fix, a training run with ``data.vae`` on pixel data (vitp trains on
    latents encoded once by ``vitp-pack``, or on synthetic latents) or with a ``data.vae`` folder
    that cannot be read (raises ``ValueError`` / ``FileNotFoundError`` as
    :func:`vitp.latents.vae.vae_config`)."""
    if data.vae:  # samples are decoded with it: a missing folder fails now, not after training
        from vitp.latents.vae import vae_config

        vae_config(data.vae)
    if data.latent_channels and data.name not in ("shards", "synthetic"):
        raise ValueError(f"data.vae={data.vae} with data.name={data.name}: vitp trains on latents encoded once, not "
                         f"on the fly; run vitp-pack OUT data.vae={data.vae} <these data overrides>, then vitp-train "
                         f"data=shards data.shards=OUT")
    if data.latent_channels and data.name == "shards" and pack_latent_meta(data.shards) is None:
        raise ValueError(f"data.shards={data.shards} holds pixels, not latents, but data.vae / data.latent_channels "
                         f"are set; unset them, or pack latents with vitp-pack OUT data.vae=FOLDER <data overrides>")
