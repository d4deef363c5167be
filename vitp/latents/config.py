"""A run config's latent fields, filled from a latent pack's manifest or a VAE folder."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

log = logging.getLogger("vitp")

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

    ``data.latent_channels`` / ``data.vae_compression`` that disagree with ``data.vae`` (a recipe's,
    run with another VAE) are replaced by the VAE's, with a warning.

    Raises ``ValueError`` when ``data.vae`` is another VAE than the pack's; ``FileNotFoundError``
    for a ``data.vae`` folder without ``config.json`` given with a latent pack."""
    d = cfg.data
    meta = pack_latent_meta(d.shards) if d.name == "shards" and d.shards else None
    if meta is None and not d.vae:
        return  # pixels: nothing to adopt (and no torch import for the config check)
    from vitp.latents.vae import geometry

    if meta is not None:
        g, px = meta["geometry"], meta["pixels"]
        if d.vae and str(Path(d.vae).expanduser().resolve()) != meta["vae"]:
            mine = geometry(d.vae)  # a folder given that is not there is refused, not replaced by the pack's
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
    if have not in ((0, [1, 1]), want):  # a recipe's geometry, another VAE given: the VAE's own wins
        log.warning(f"data.latent_channels={have[0]} data.vae_compression={have[1]} replaced by data.vae={d.vae}'s "
                    f"{want[0]} and {want[1]} ({g.cls})")
    d.latent_channels, d.vae_compression = want[0], want[1]


def check_trainable(data: Any) -> None:
    """Refuse, naming the fix, a training run with a ``data.vae`` folder that cannot be loaded, with
    ``data.vae`` on pixel data (vitp trains on latents encoded once by ``vitp-pack``, or on
    synthetic latents), or with latent fields on a pixel pack. Raises ``ValueError`` /
    ``FileNotFoundError`` as :func:`check_decoder`."""
    if data.vae:
        _check_vae(data)
    if (data.latent_channels or data.vae) and data.name not in ("shards", "synthetic"):
        raise ValueError(f"data.vae={data.vae} with data.name={data.name}: vitp trains on latents encoded once, not "
                         f"on the fly; run vitp-pack OUT data.vae={data.vae} <these data overrides>, then vitp-train "
                         f"data=shards data.shards=OUT")
    if data.latent_channels and data.name == "shards" and pack_latent_meta(data.shards) is None:
        raise ValueError(f"data.shards={data.shards} holds pixels, not latents, but data.vae / data.latent_channels "
                         f"are set; unset them, or pack latents with vitp-pack OUT data.vae=FOLDER <data overrides>")
    check_decoder(data)


def check_decoder(data: Any) -> None:
    """For a latent run (``data.latent_channels > 0``): that ``data.vae`` can be loaded to decode
    samples (:func:`vitp.latents.vae.check_vae_folder`), checked before training, sampling or
    evaluation starts rather than when the first sample is decoded. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the folder, where it came from (a latent pack's manifest) and the fix."""
    if not data.latent_channels or (data.name == "synthetic" and not data.vae):  # benchmarks: latents shown as they are
        return
    if not data.vae:
        raise ValueError("data.latent_channels is set without data.vae: samples are decoded with the VAE; set "
                         "data.vae=<local VAE folder>")
    _check_vae(data)


def _check_vae(data: Any) -> None:
    from vitp.latents.vae import check_vae_folder

    meta = pack_latent_meta(data.shards) if data.name == "shards" and data.shards else None
    try:
        check_vae_folder(data.vae)
    except (FileNotFoundError, ValueError) as e:
        if meta is not None and meta["vae"] == str(Path(data.vae).expanduser().resolve()):
            raise type(e)(f"{e} (the folder data.shards={data.shards} was encoded with, from its index.json: if the "
                          f"VAE moved, give data.vae=<its new folder>)") from None
        raise
