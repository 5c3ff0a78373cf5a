"""tests/digits.py: scikit-learn's digits and the models' split, read without scikit-learn (tests/data/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import digits


def test_the_digits_are_1797_rows_of_pixel_counts_and_labels():
    X, y = digits.load()
    assert X.shape == (1797, 64) and X.dtype == np.float64 and y.shape == (1797,) and y.dtype.kind == "i"
    assert np.array_equal(X, X.round()) and X.min() == 0 and X.max() == 16
    assert sorted(set(y.tolist())) == list(range(10))
    X[0, 0] = -1  # a copy: the next caller still reads the file's values
    assert digits.load()[0][0, 0] == 0


def test_the_split_is_a_stratified_partition_of_the_rows():
    X, y = digits.load()
    X_train, X_test, y_train, y_test = digits.split()
    assert X_train.shape == (1437, 64) and X_test.shape == (360, 64) and y_test.shape == (360,)
    train, held_out = digits._indices()
    assert sorted([*train, *held_out]) == list(range(1797))
    assert np.array_equal(X_test, X[held_out]) and np.array_equal(y_train, y[train])
    # stratified: each class held out in proportion to its share of the rows (within one, by rounding)
    counts, held = np.bincount(y, minlength=10), np.bincount(y_test, minlength=10)
    assert (np.abs(held - counts * 360 / 1797) <= 1).all(), held
    assert all(np.array_equal(a, b) for a, b in zip(digits.held_out_split(), (X_test, y_test), strict=True))


def test_the_files_give_what_scikit_learn_gives():
    """Where scikit-learn is installed (the tools extra; not a test dependency)."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    theirs = (X, y, *train_test_split(X, y, test_size=0.2, random_state=0, stratify=y))
    ours = (*digits.load(), *digits.split())
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
