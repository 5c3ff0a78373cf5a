"""scikit-learn's 8x8 digits, as the tests read them, without scikit-learn: `load()` is `load_digits(return_X_y=True)`
(1797 rows of raw pixels 0..16, float64, and int labels) and `split()` is the split tools/train_digits.py's
`load_split` trains the digits models on, `train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)`: 1437
training rows and 360 held out, in that function's order.

The data are tests/data/digits.csv.gz, scikit-learn's own file (its bundled copy of the UCI test set; provenance and
license in tests/data/README.md), and the split's row indices tests/data/digits_split.txt, both written by
`python -m tests.digits --write` where scikit-learn is installed (`pip install -e '.[tools]'`), which also checks
that they give what scikit-learn gives. scikit-learn is not a test dependency: the digits were its only use, and with
the SciPy it pulls in (~165 MB) it was 18 s of setup.sh --test's pip install (2-core machine)."""

from __future__ import annotations

import gzip
import sys
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
CSV, SPLIT = DATA / "digits.csv.gz", DATA / "digits_split.txt"
ROWS, HELD_OUT = 1797, 360


@cache
def _load() -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(CSV, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    X, y = data[:, :-1], data[:, -1].astype(int)
    X.setflags(write=False)
    y.setflags(write=False)
    return X, y


def load() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 64) float64 pixels 0..16 and their (1797,) int labels: `load_digits(return_X_y=True)` (fresh copies)."""
    X, y = _load()
    return X.copy(), y.copy()


@cache
def _indices() -> tuple[np.ndarray, np.ndarray]:
    train, held_out = (np.array(line.split(), dtype=np.int64) for line in SPLIT.read_text().splitlines()[-2:])
    return train, held_out


def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, X_test, y_train, y_test), as train_test_split returns them (module docstring)."""
    X, y = _load()
    train, held_out = _indices()
    return X[train], X[held_out], y[train], y[held_out]


def held_out_split() -> tuple[np.ndarray, np.ndarray]:
    """(360, 64) float64 pixels 0..16 and their (360,) labels."""
    _, X_test, _, y_test = split()
    return X_test, y_test


def _write() -> None:
    """Copy scikit-learn's digits file here, write the split's indices, and check both against scikit-learn."""
    import shutil

    import sklearn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    shutil.copyfile(Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz", CSV)
    X, y = load_digits(return_X_y=True)
    train, held_out = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=y)
    SPLIT.write_text(
        f"# train_test_split(X, y, test_size=0.2, random_state=0, stratify=y) of load_digits(), scikit-learn "
        f"{sklearn.__version__}: the training rows' indices, then the held-out rows' (python -m tests.digits --write)\n"
        + " ".join(map(str, train)) + "\n" + " ".join(map(str, held_out)) + "\n"
    )  # fmt: skip
    _load.cache_clear()
    _indices.cache_clear()
    ours = (*load(), *split())
    theirs = (X, y, *train_test_split(X, y, test_size=0.2, random_state=0, stratify=y))
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    print(f"wrote {CSV} and {SPLIT}: the same arrays as scikit-learn {sklearn.__version__}'s")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.digits --write   (needs scikit-learn)")
    _write()
