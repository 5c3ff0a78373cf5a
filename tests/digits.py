"""The digits models' held-out split, as the tests read it: the 360 rows tools/train_digits.py's `load_split` holds
out (test_size=0.2, random_state=0, stratified), raw pixels 0..16 and their labels."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def held_out_split() -> tuple[np.ndarray, np.ndarray]:
    """(360, 64) float64 pixels 0..16 and their (360,) labels."""
    X, y = load_digits(return_X_y=True)
    _, X_test, _, y_test = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
    return X_test, y_test
