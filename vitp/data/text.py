"""Captions of data items, and the conditioning tensors the generator gets for a batch.

A data set with ``data.captions`` set gives every item a caption: from its file (a sidecar
``<name>.txt`` or a ``captions.jsonl`` / ``.csv`` manifest, :func:`vitp.text.read_captions`;
a video clip has the caption of its file), or from ``data.caption_templates`` filled with the
item's class (``"a handwritten {class_word}"``). Items without a caption are skipped and counted
(``data.missing_caption=skip``) or get the empty caption (``empty``).

Training reads precomputed caption embeddings (``vitp-encode-captions``,
:class:`vitp.text.TextEmbeddings`), as PixArt-alpha, NeMo, FastVideo and Open-Sora's cached
mode do: an item's conditioning is its caption's id in the store, and a batch's ids become
``(embeddings (B, L, Dc), mask (B, L))`` in the collate (:class:`TextConditioning`). A
class-conditional run keeps its labels (:class:`ClassConditioning`). Both give the id that
classifier-free guidance's drop uses (``null_id``: the null class, or the encoded empty caption).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .base import Key, KeyedDataset, parse_key

log = logging.getLogger(__name__)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_SOURCES = "'sidecar', a .jsonl/.csv manifest path, or 'templates'"


def class_word(name: str) -> str:
    """A class name as a word: ``"7"`` -> ``"seven"`` (0-9), any other name unchanged."""
    return NUMBER_WORDS[int(name)] if name.isdigit() and int(name) < 10 else name


def fill_template(template: str, class_name: str) -> str:
    """``template`` with ``{class}`` (the class name) and ``{class_word}`` (:func:`class_word`)
    filled. Raises ``ValueError`` naming another placeholder."""
    try:
        return template.format(**{"class": class_name, "class_word": class_word(class_name)})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"data.caption_templates entry {template!r}: {e}; the placeholders are {{class}} and "
                         "{class_word}") from None


def template_captions(labels: Sequence[int], classes: Sequence[str], templates: Sequence[str]) -> List[str]:
    """Item ``i`` of class ``labels[i]`` gets ``templates[i % len(templates)]`` filled with its
    class (:func:`fill_template`). Raises ``ValueError`` without templates."""
    if not templates:
        raise ValueError("data.captions=templates needs data.caption_templates=[...], e.g. "
                         "'data.caption_templates=[\"a handwritten {class_word}\",\"the digit {class}\"]'")
    return [fill_template(templates[i % len(templates)], classes[int(c)]) for i, c in enumerate(labels)]


def item_captions(base: KeyedDataset, cfg: Any) -> Optional[List[Optional[str]]]:
    """The caption of every item of ``base`` (``None`` where its file has none and
    ``data.missing_caption=skip``), or ``None`` when ``data.captions`` is unset.

    Raises ``ValueError`` for a file source on a data set without files (use ``templates``), an
    unknown source, a bad template; ``FileNotFoundError`` for a missing manifest.
    """
    source = cfg.captions
    if source is None:
        return None
    if source == "templates":
        return template_captions(base.labels, base.classes, list(cfg.caption_templates))
    files = getattr(base, "files", None)
    if files is None:
        raise ValueError(f"data.captions={source} reads captions next to files, but data.name={cfg.name} has no "
                         "files: use data.captions=templates with data.caption_templates")
    from vitp.text.captions import read_captions

    root = Path(os.path.abspath(getattr(base, "root", None) or Path(files[0]).parent))
    # the data set's files are paths as found (relative to the working directory when data.root is)
    per_file, counts = read_captions(root, [Path(os.path.abspath(f)) for f in files], source)
    captions = [per_file[base._file_of(i)] for i in range(len(base))]
    missing = sum(c is None for c in captions)
    if missing:
        empty = cfg.missing_caption == "empty"
        log.warning(f"{counts['missing']} of {len(files)} files under {root} have no caption ({source}): "
                    f"{missing} item(s) {'get the empty caption' if empty else 'skipped'} "
                    f"(data.missing_caption={cfg.missing_caption})")
        if empty:
            captions = ["" if c is None else c for c in captions]
    if counts.get("unused_entries"):
        log.warning(f"{counts['unused_entries']} caption entries of {source} name no file of the data set")
    if all(c is None for c in captions):
        raise ValueError(f"no item of the data set under {root} has a caption ({source}); write the captions or set "
                         "data.missing_caption=empty")
    return captions


class ClassConditioning:
    """A class-conditional run's conditioning: labels ``(B,)`` int64 pass through as ``(y,)``;
    the null id is the null class ``num_classes`` (DiT)."""

    text = False

    def __init__(self, num_classes: int):
        self.null_id = int(num_classes)

    def __call__(self, ids: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return (torch.as_tensor(ids, dtype=torch.long),)


class TextConditioning:
    """A text-conditional run's conditioning: caption ids ``(B,)`` -> ``(embeddings (B, L, Dc)
    float32, mask (B, L) bool)`` read from the store; the null id is the store's encoded empty
    caption (``""``, id 0), the unconditional input of classifier-free guidance as in SD3 and
    Flux. Pickles for DataLoader workers (the store reopens its shards per process)."""

    text = True

    def __init__(self, store: Any):
        self.store = store
        self.null_id = int(store.null_id)

    def __call__(self, ids: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return self.store.get(ids)


def open_text_embeddings(cfg: Any) -> Any:
    """The caption embeddings of a text-conditional run (``cfg.model.text_dim > 0``), checked
    against the model and, when ``data.text_encoder`` is set, against that encoder.

    Raises ``ValueError`` when ``data.text_embeddings`` is unset, the store's channels /
    token count differ from ``model.text_dim`` / ``model.text_len``, or its encoder (config hash,
    channels) is not ``data.text_encoder``; the store's own errors (missing, truncated:
    :class:`vitp.text.TextEmbeddings`) and the encoder's (:func:`vitp.text.encoder_record`).
    """
    from vitp.text import TextEmbeddings
    from vitp.text.store import check_encoder

    d, m = cfg.data, cfg.model
    if not d.text_embeddings:
        raise ValueError("model.text_dim > 0 needs precomputed caption embeddings: run vitp-encode-captions --encoder "
                         "<local encoder> --out DIR <data overrides>, then set data.text_embeddings=DIR")
    store = TextEmbeddings(d.text_embeddings)
    if d.text_encoder:
        from vitp.text.encoder import encoder_record

        rec = encoder_record(d.text_encoder)
        same = ("config_sha256", "hidden_size", "weights_fingerprint")
        check_encoder(store.encoder, {k: rec[k] for k in same if k in store.encoder}, store.path,
                      label=f"data.text_encoder={d.text_encoder}", fix=(
                          f"set data.text_encoder to the encoder that made them ({store.encoder['path']}), or encode "
                          f"the captions with data.text_encoder (vitp-encode-captions --encoder {d.text_encoder} "
                          "--out NEW_DIR <this run's data overrides>) and set data.text_embeddings=NEW_DIR"))
    if store.dim != m.text_dim:
        raise ValueError(f"model.text_dim={m.text_dim} but the caption embeddings in {store.path} have {store.dim} "
                         f"channels (encoder {store.encoder['name']}); set model.text_dim={store.dim}")
    if m.text_len and store.max_length != m.text_len:
        raise ValueError(f"model.text_len={m.text_len} but the caption embeddings in {store.path} hold "
                         f"{store.max_length} tokens per caption; set model.text_len={store.max_length} (or 0)")
    return store


def conditioning(cfg: Any, store: Any = None) -> Any:
    """:class:`TextConditioning` over ``store`` (default: :func:`open_text_embeddings`) when
    ``model.text_dim > 0``, else :class:`ClassConditioning` of ``model.num_classes``."""
    if cfg.model.text_dim:
        return TextConditioning(store if store is not None else open_text_embeddings(cfg))
    return ClassConditioning(cfg.model.num_classes)


def _ids_at(per_sample: Any, dataset: Any, items: Any) -> Any:
    """The caption ids (``per_sample`` by pack sample) of ``items`` of the packed ``dataset``."""
    from vitp.data.shards import item_samples

    return per_sample[item_samples(dataset, items)]


class CaptionIds(KeyedDataset):
    """A captioned data set whose items are ``(x, caption id in store)``; ``labels`` and
    ``classes`` stay the classes (the held-out split and the digits judge use them),
    ``captions`` the strings.

    Raises ``ValueError`` naming how many captions (and one example) the store lacks.
    """

    def __init__(self, dataset: KeyedDataset, store: Any):
        captions = getattr(dataset, "captions", None)
        if captions is None:
            raise ValueError("model.text_dim > 0 needs captions: set data.captions (sidecar, a manifest, or "
                             "templates)")
        self.dataset, self.classes, self.captions = dataset, dataset.classes, captions
        self.groups = getattr(dataset, "groups", None)  # the shard-local order (vitp.data.loader.epoch_order)
        from vitp.data.shards import packed_index

        index = packed_index(dataset)
        if index is not None and index.captions is not None:
            self.ids = self._packed_ids(dataset, index, store)
            return
        distinct = list(dict.fromkeys(captions))
        missing = [c for c in distinct if c not in store]
        if missing:
            raise ValueError(f"{len(missing)} of the data set's {len(distinct)} distinct captions are not "
                             f"in the caption embeddings at {store.path} (data.text_embeddings; e.g. {missing[0]!r}): "
                             "they were encoded from other data or captions; encode this run's captions with "
                             "vitp-encode-captions --encoder <encoder> --out DIR <this run's data overrides> and set "
                             "data.text_embeddings=DIR")
        self.ids = store.ids_of(captions)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def labels(self) -> Any:
        """The classes of the items (the data set's own)."""
        return self.dataset.labels

    def _packed_ids(self, dataset: KeyedDataset, index: Any, store: Any) -> Any:
        """The caption ids of a packed data set's items, from the per-sample ids
        (:func:`vitp.data.shards.caption_ids`) by item: nothing per caption is read here."""
        import numpy as np

        from vitp.data.base import ItemArray
        from vitp.data.shards import caption_ids

        per_sample = caption_ids(index, store)
        ids = ItemArray(functools.partial(_ids_at, per_sample, dataset), len(dataset), np.int32)
        chunk = 1 << 16
        for a in range(0, len(dataset), chunk):
            bad = np.flatnonzero(ids[np.arange(a, min(len(dataset), a + chunk))] < 0)
            if len(bad):
                total = sum(int((ids[np.arange(b, min(len(dataset), b + chunk))] < 0).sum())
                            for b in range(a, len(dataset), chunk))
                raise ValueError(f"{total} of the data set's {len(dataset)} items have captions that are not in the "
                                 f"caption embeddings at {store.path} (data.text_embeddings; e.g. "
                                 f"{self.captions[a + int(bad[0])]!r}): they were encoded from other data or "
                                 "captions; encode this run's captions with vitp-encode-captions --encoder <encoder> "
                                 "--out DIR <this run's data overrides> and set data.text_embeddings=DIR")
        return ids

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, aug_seed = parse_key(key, len(self))
        x, _ = self.dataset[(index, aug_seed)]
        return x, int(self.ids[index])


class PromptConditioning:
    """Prompts for sampling: id 0 is the empty caption (guidance's null input), ids ``1..n``
    the ``prompts``; ``__call__(ids (B,)) -> (embeddings (B, L, Dc), mask (B, L))``.

    The embeddings are the run's own where its store holds every prompt (bit-identical to what
    training read); otherwise all are encoded with the local encoder at ``encoder_path`` (the
    run's ``data.text_encoder``), which must be the store's encoder (same config hash), at the
    store's token count, rounded through the store's dtype as training saw them; :attr:`truncated`
    counts the prompts cut at that count.

    Raises ``ValueError`` when a prompt needs encoding and no encoder path is given, or the
    encoder differs from the one that made the store; the encoder's own errors.
    """

    text = True
    null_id = 0
    truncated = 0  # how many prompts were longer than the token count (encoded ones only)

    def __init__(self, prompts: Sequence[str], store: Any = None, encoder_path: Optional[str] = None,
                 device: str = "cpu"):
        self.prompts = ["", *prompts]
        known = store is not None and all(p in store for p in self.prompts)
        if known:
            self.emb, self.mask = store.get(store.ids_of(self.prompts))
            return
        if not encoder_path:
            where = f" are not in the caption embeddings at {store.path}" if store is not None else " need encoding"
            raise ValueError(f"prompts{where}; set data.text_encoder=<local path of the encoder that made them> "
                             "to encode new prompts")
        from vitp.text.encoder import TextEncoder

        enc = TextEncoder(encoder_path, device=device, max_length=store.max_length if store is not None else None)
        same = ("config_sha256", "weights_fingerprint")
        if store is not None and any(enc.record[k] != store.encoder.get(k, enc.record[k]) for k in same):
            raise ValueError(f"the encoder at {encoder_path} ({enc.record['name']}) is not the one that made the "
                             f"caption embeddings at {store.path} ({store.encoder['name']}); sample with that encoder")
        emb, self.mask = enc.encode(self.prompts)
        self.truncated = enc.last_truncated  # prompts cut at the store's token count (the model never saw more)
        dtype = getattr(torch, store.dtype) if store is not None else torch.float32
        self.emb = emb.to(dtype).float()

    def __call__(self, ids: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ids = torch.as_tensor(ids, dtype=torch.long)
        return self.emb[ids], self.mask[ids]


def grid_prompts(cfg: Any, datasets: Sequence[Any]) -> List[str]:
    """The prompts of a text model's sample grid: ``sampler.prompts``, else the first
    ``sampler.grid_classes`` (0: 10) distinct captions of ``datasets`` in order (held-out first)."""
    if cfg.sampler.prompts:
        return list(cfg.sampler.prompts)
    rows = cfg.sampler.grid_classes or 10
    seen: dict = {}
    for ds in datasets:
        for c in getattr(ds, "captions", None) or []:
            if len(seen) >= rows:
                break  # a pack's captions are parsed when read: read no more than needed
            if c:
                seen.setdefault(c, None)
    return list(seen)


def text_embeddings_pending(cfg: Any) -> bool:
    """Whether :func:`vitp.data.build.ensure_text_embeddings` will encode: a text-conditional run naming its
    encoder (``data.text_encoder``) whose ``data.text_embeddings`` holds no store yet."""
    d, m = cfg.data, cfg.model
    return bool(m.text_dim and d.text_embeddings and d.text_encoder) and \
        not (Path(d.text_embeddings) / "index.json").is_file()


def conditioned(conditioning_: Any, *datasets: Any) -> List[Any]:
    """``datasets`` as the model reads them under ``conditioning_``: unchanged for class labels,
    :class:`CaptionIds` over the store of a :class:`TextConditioning` (items ``(x, caption id)``)."""
    if not getattr(conditioning_, "text", False):
        return list(datasets)
    return [CaptionIds(ds, conditioning_.store) for ds in datasets]
