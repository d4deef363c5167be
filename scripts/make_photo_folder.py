"""Write the scikit-image photo folder (vitp/data/photos.py) to OUT: one subfolder per subject,
portrait / square / landscape crops as PNG. ``python scripts/make_photo_folder.py OUT [--per-class N]
[--max-side PX] [--classes astronaut cat coffee rocket]``; then ``data=image_folder data.root=OUT``."""
import argparse

from vitp.data.photos import SUBJECTS, make_photo_folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--per-class", type=int, default=36)
    p.add_argument("--max-side", type=int, default=64)
    p.add_argument("--classes", nargs="+", default=["astronaut", "cat", "coffee"], choices=sorted(SUBJECTS))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    root = make_photo_folder(a.out, a.classes, a.per_class, a.max_side, a.seed)
    print(f"wrote {len(a.classes)} x {a.per_class} photos to {root}")


if __name__ == "__main__":
    main()
