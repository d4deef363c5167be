"""Bucket assignment of real photos (scikit-image, landscape / square / portrait) and the checks of
``data.buckets``."""
import numpy as np
import pytest
import skimage.data
from PIL import Image

from tests.helpers import compose_cfg
from vitp.config import validate_config
from vitp.data import build_datasets
from vitp.data.buckets import Bucket, assign, bucket_datasets, buckets_of

THREE = "data.buckets=[{resolution:16x24,batch_size:4},{resolution:16,batch_size:4},{resolution:24x16,batch_size:4}]"


@pytest.fixture(scope="module")
def mixed_photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed") / "photos"
    root.mkdir()
    photos = {"chelsea": skimage.data.chelsea(), "coffee": skimage.data.coffee(), "astronaut": skimage.data.astronaut(),
              "rocket_portrait": np.ascontiguousarray(np.rot90(skimage.data.rocket())),
              "coffee_portrait": np.ascontiguousarray(np.rot90(skimage.data.coffee()))}
    for name, img in photos.items():
        Image.fromarray(img).save(root / f"{name}.png")
    return root


def test_photos_go_to_the_bucket_nearest_their_aspect(mixed_photos):
    cfg = compose_cfg(["data=image_folder", f"data.root={mixed_photos}", "data.num_classes=1",
                       "data.holdout_fraction=0", THREE]).data
    pairs = bucket_datasets(cfg, 0, build_datasets)
    names = [sorted(p.name.split(".")[0] for p in (tr.base.files[i] for i in tr.indices)) for tr, _ in pairs]
    assert names == [["chelsea", "coffee"], ["astronaut"], ["coffee_portrait", "rocket_portrait"]]
    for (tr, _), b in zip(pairs, buckets_of(cfg)):
        assert tr[(0, 7)][0].shape == (3, 1, *b.size)  # items come out at their bucket's shape


def test_assign_rules():
    bks = [Bucket((16, 24), 1, 4, 1.0), Bucket((32, 48), 1, 4, 1.0), Bucket((16, 16), 1, 4, 1.0),
           Bucket((16, 16), 4, 4, 1.0)]
    assert assign((100, 150), 1, bks) == [1]  # same aspect: the larger bucket it fills
    assert assign((20, 30), 1, bks) == [0]  # too small for 32x48
    assert assign((8, 8), 1, bks) == [2]  # fills none: nearest aspect, upscaled
    assert assign((12, 18), 1, bks) == [0]  # fills none: of equal aspects the least upscaling (16x24, not 32x48)
    assert assign((32, 48), 1, bks) == [1]  # fills 32x48 exactly: no rescaling
    assert assign(None, 1, bks) == [0, 1, 2] and assign(None, 4, bks) == [3]  # sizeless: every bucket of its frames


@pytest.mark.parametrize("buckets,message", [
    ("[{resolution:16x10,batch_size:8}]", r"resolution 16x10 \(data.buckets\[0\].resolution\) is not divisible by "
                                          r"model.patch_size=4.*nearest valid sizes: 16x8, 16x12"),
    ("[{resolution:16,batch_size:8,frames:4}]", r"data.buckets\[0\].frames=4: this is an image run"),
    ("[{resolution:16,batch_size:8},{resolution:16,batch_size:4}]", r"repeats the shape 16x16 x 1 frames"),
    ("[{resolution:16,batch_size:6}]", r"data.buckets\[0\].batch_size=6 must be a multiple of 4 .*valid: 4, 8, 12"),
])
def test_bucket_errors_name_the_valid_values(buckets, message):
    cfg = compose_cfg(["model.patch_size=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                       f"data.buckets={buckets}"])
    with pytest.raises(ValueError, match=message):
        validate_config(cfg, 1)


def test_packed_photos_go_to_the_same_buckets_through_arrays(mixed_photos, tmp_path):
    """A pack's sizes come as arrays (``native_sizes``: one assignment per distinct size, no Python
    object per item): the same buckets as the folder item by item."""
    from vitp.cli import pack as pack_cli
    from vitp.data.shards import ShardImages

    folder = ["data=image_folder", f"data.root={mixed_photos}", "data.num_classes=1", "data.holdout_fraction=0"]
    pack_cli.run([str(tmp_path / "pack"), "--quiet", "--samples-per-shard", "2", *folder])
    cfg = compose_cfg(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=1", THREE]).data
    pairs = bucket_datasets(cfg, 0, build_datasets)
    base = pairs[0][0].base
    assert isinstance(base, ShardImages)
    h, w = base.native_sizes(np.arange(len(base)))
    assert [(int(a), int(b)) for a, b in zip(h, w)] == [base.native_size(i) for i in range(len(base))]
    assert [len(tr) for tr, _ in pairs] == [2, 1, 2]
    folder_pairs = bucket_datasets(compose_cfg([*folder, THREE]).data, 0, build_datasets)
    assert [tr.indices.tolist() for tr, _ in pairs] == [tr.indices.tolist() for tr, _ in folder_pairs]


def test_the_start_line_gives_the_buckets_tokens_per_sample_not_data_resolutions():
    """A new user's bucketed run logged 16384 tokens per sample: data.resolution=256's at patch 2,
    a size it never trained."""
    from vitp.train.trainer import tokens_text

    buckets = "data.buckets=[{resolution:8,batch_size:8},{resolution:6x10,batch_size:4},{resolution:16x16,batch_size:2}]"
    cfg = compose_cfg(["experiment=smoke", buckets])
    assert cfg.model.patch_size == 2 and tokens_text(cfg) == "15 to 64"  # 3 x 5 patches to 8 x 8
    assert tokens_text(compose_cfg(["experiment=smoke"])) == str(cfg.model.image_size // 2 * (cfg.model.image_size // 2))


def test_small_items_go_to_the_least_upscaling_bucket_and_start_up_says_so(tmp_path, caplog):
    """A new user's photos smaller than every bucket went silently to the largest bucket of their
    aspect (12x12 upscaled 4x into 48x48, where 16x16 needed 1.33x), and the 16x16 bucket, left
    empty, was never drawn without a word. Now ties go to the bucket that resizes an item least,
    and start-up names the empty bucket and counts the upscaled items, for a folder and its pack."""
    import logging

    from vitp.cli import pack as pack_cli

    root = tmp_path / "small" / "a"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, (h, w) in {"s1": (12, 12), "s2": (12, 12), "big": (40, 40), "flat": (12, 18)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
    four = "data.buckets=[{resolution:16,batch_size:4},{resolution:32,batch_size:4},{resolution:48,batch_size:4}," \
           "{resolution:24x36,batch_size:4}]"
    folder = ["data=image_folder", f"data.root={root.parent}", "data.num_classes=1", "data.holdout_fraction=0"]
    caplog.set_level(logging.INFO, logger="vitp.data.buckets")
    pairs = bucket_datasets(compose_cfg([*folder, four]).data, 0, build_datasets)
    names = [sorted(tr.base.files[i].stem for i in tr.indices) for tr, _ in pairs]
    assert names == [["s1", "s2"], ["big"], [], ["flat"]]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "vitp.data.buckets"]
    assert said == [
        ("INFO", "data.buckets: training / held-out items per bucket: 16x16 2 / 0, 32x32 1 / 0, 48x48 0 / 0, "
                 "24x36 1 / 0"),
        ("WARNING", "data.buckets[2] (48x48) holds no training item, so it is never drawn (its weight goes to the "
                    "other buckets): each item trains in the bucket nearest its aspect ratio among those it fills "
                    "without upscaling; drop that bucket, or change its size"),
        ("WARNING", "data.buckets: 3 of 4 training and held-out items fill no bucket of their frame count and are "
                    "upscaled: 2 into 16x16 (up to 1.33x, e.g. a 12x12 item), 1 into 24x36 (up to 2.00x, e.g. a "
                    "12x18 item); add a bucket at or below their size, or leave such small items out of the data")]
    pack_cli.run([str(tmp_path / "pack"), "--quiet", *folder])
    caplog.clear()
    packed = bucket_datasets(compose_cfg(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=1",
                                          four]).data, 0, build_datasets)
    assert [tr.indices.tolist() for tr, _ in packed] == [tr.indices.tolist() for tr, _ in pairs]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "vitp.data.buckets"] == said
