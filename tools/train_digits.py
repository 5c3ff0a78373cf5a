"""Train and export the `digits-mlp` demo model served by fusedserve.

What: an MLP 64 -> 256 -> 256 -> 10 (ReLU) trained on scikit-learn's bundled handwritten digits
(`load_digits()`: 1797 8x8 images, pixel values 0..16, nothing downloaded), exported as
`model.safetensors` + `config.json` (format "fusedserve-model/1") + `examples.json` + `README.md`.

Why: the service needs a small, real, reproducible model whose layers are the shapes the fused
Triton MLP kernels run, and whose accuracy can be checked end to end (README curl demo, smoke test).

Reproducible: fixed split (test_size=0.2, random_state=0, stratify=y), fixed seeds (torch, numpy,
the mini-batch generator), deterministic algorithms, one CPU thread. Training sees pixels / 16;
the 1/16 is then folded into fc1.weight so the shipped model takes RAW pixels 0..16.

    python tools/train_digits.py            # writes model_weights/digits-mlp/, ~5 s on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requires import require

require("numpy", "torch", "sklearn", "safetensors")  # before importing them or writing anything

import numpy as np
import sklearn
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

REPO = Path(__file__).resolve().parent.parent
PIXEL_MAX = 16.0  # load_digits() pixels are integers 0..16
MIN_TEST_ACC = 0.95  # fail (exit 1, nothing written) below this held-out accuracy
BATCH = 64  # mini-batch size; 1437 train samples -> 23 steps per epoch
LR = 1e-3  # Adam learning rate
N_EXAMPLES = 8  # first 8 test digits go to examples.json


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test): raw pixels 0..16 as float64 rows of 64, labels 0..9. The one
    held-out split every digits model here is trained and measured on (tools/train_digits_cnn.py too)."""
    digits = load_digits()
    return train_test_split(digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target)


def make_model() -> nn.Sequential:
    # Named so state_dict keys are exactly the exported tensor names fc1.weight ... fc3.bias.
    layers = [("fc1", nn.Linear(64, 256)), ("relu1", nn.ReLU()), ("fc2", nn.Linear(256, 256))]
    layers += [("relu2", nn.ReLU()), ("fc3", nn.Linear(256, 10))]
    return nn.Sequential(OrderedDict(layers))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "model_weights" / "digits-mlp")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # reduction order independent of the machine's core count

    x_tr, x_te, y_tr, y_te = load_split()  # 1437 train / 360 test, class proportions kept
    x_tr_raw = torch.tensor(x_tr, dtype=torch.float32)
    x_te_raw = torch.tensor(x_te, dtype=torch.float32)
    y_tr_t, y_te_t = torch.tensor(y_tr), torch.tensor(y_te)

    # --- train on pixels / 16 (inputs in 0..1) ---
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(args.seed)
    x_tr_s = x_tr_raw / PIXEL_MAX
    for _ in range(args.epochs):
        for idx in torch.randperm(len(x_tr_s), generator=gen).split(BATCH):
            opt.zero_grad()
            loss_fn(model(x_tr_s[idx]), y_tr_t[idx]).backward()
            opt.step()
    model.eval()
    train_acc = accuracy(model, x_tr_s, y_tr_t)
    test_acc = accuracy(model, x_te_raw / PIXEL_MAX, y_te_t)
    print(f"epochs={args.epochs} seed={args.seed} final_loss={loss_fn(model(x_tr_s), y_tr_t).item():.4f}")
    print(f"train accuracy {train_acc:.4f} ({len(y_tr)} samples)")
    print(f"test  accuracy {test_acc:.4f} ({len(y_te)} samples)")
    if test_acc < MIN_TEST_ACC:
        print(f"FAIL: test accuracy {test_acc:.4f} < {MIN_TEST_ACC}; nothing written", file=sys.stderr)
        return 1

    # --- fold the 1/16 input scaling into fc1: W1 @ (x/16) == (W1/16) @ x ---
    # Dividing by 16 (a power of two) is exact in float32, so the logits should match bit for bit.
    tensors = {k: v.detach().clone().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    tensors["fc1.weight"] = (tensors["fc1.weight"] / PIXEL_MAX).contiguous()
    folded = make_model()
    folded.load_state_dict(tensors)
    with torch.no_grad():
        ref, got = model(x_te_raw / PIXEL_MAX), folded(x_te_raw)
    max_diff = (ref - got).abs().max().item()
    print(f"folded model on raw pixels: max |logit diff| vs unfolded = {max_diff:.3g}")
    if not torch.equal(ref.argmax(1), got.argmax(1)):
        print("FAIL: folded model's held-out predictions differ from the unfolded model's", file=sys.stderr)
        return 1

    # --- export ---
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    st_path = out / "model.safetensors"
    save_file(tensors, str(st_path), metadata={"format": "pt"})
    st_path.chmod(0o644)  # safetensors creates the file 0600
    sha = hashlib.sha256(st_path.read_bytes()).hexdigest()

    config = {
        "format": "fusedserve-model/1",
        "name": "digits-mlp",
        "description": "MLP 64-256-256-10 (ReLU) for sklearn 8x8 handwritten digits; input raw pixels 0..16",
        "input": {"shape": [64], "dtype": "float32"},
        "labels": [str(d) for d in range(10)],
        "ops": [
            {"op": "linear", "weight": "fc1.weight", "bias": "fc1.bias"},
            {"op": "relu"},
            {"op": "linear", "weight": "fc2.weight", "bias": "fc2.bias"},
            {"op": "relu"},
            {"op": "linear", "weight": "fc3.weight", "bias": "fc3.bias"},
        ],
    }
    # 2-space indent; small values and each op kept on one line for readability.
    top = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in config.items() if k != "ops"]
    ops = ",\n".join(f"    {json.dumps(op)}" for op in config["ops"])
    (out / "config.json").write_text("{\n" + "\n".join(top) + f'\n  "ops": [\n{ops}\n  ]\n}}\n')
    assert json.loads((out / "config.json").read_text()) == config

    # examples.json is a ready /predict body (the service refuses fields other than "inputs"), so
    # the true labels go beside it. Raw pixel values are whole numbers 0..16: ints keep it small.
    examples = {"inputs": [[int(v) for v in row] for row in x_te[:N_EXAMPLES]]}
    labels = [int(v) for v in y_te[:N_EXAMPLES]]
    ex_lines = ",\n    ".join(json.dumps(r) for r in examples["inputs"])
    (out / "examples.json").write_text(f'{{\n  "inputs": [\n    {ex_lines}\n  ]\n}}\n')
    assert json.loads((out / "examples.json").read_text()) == examples
    (out / "examples_labels.json").write_text(json.dumps(labels) + "\n")

    (out / "README.md").write_text(f"""# digits-mlp

A small MLP that classifies 8x8 handwritten digits, used as fusedserve's demo and smoke-test model.
Generated by `tools/train_digits.py`; do not edit by hand, re-run the script instead.

## Provenance

- Data: scikit-learn's bundled `sklearn.datasets.load_digits()` (1797 samples, 8x8, pixels 0..16,
  no download).
- Split: `train_test_split(test_size=0.2, random_state=0, stratify=y)` -> {len(y_tr)} train /
  {len(y_te)} test.
- Architecture: Linear(64, 256) -> ReLU -> Linear(256, 256) -> ReLU -> Linear(256, 10), plain
  `torch.nn.Linear`.
- Training: Adam (lr {LR}), cross-entropy, {args.epochs} epochs, mini-batches of {BATCH} shuffled by a
  `torch.Generator` seeded with {args.seed}; `torch.manual_seed({args.seed})`, `np.random.seed({args.seed})`,
  `torch.use_deterministic_algorithms(True)`, `torch.set_num_threads(1)`. Trained on pixels / 16.
- Reproduce: `python tools/train_digits.py` (defaults: `--epochs {args.epochs} --seed {args.seed}`).
- Versions: torch {torch.__version__}, scikit-learn {sklearn.__version__}, numpy {np.__version__}.

## Accuracy

- Held-out (test, {len(y_te)} samples): **{test_acc:.4f}**
- Train ({len(y_tr)} samples): {train_acc:.4f}

## Input / output

- Input: 64 float32 values, the RAW pixel values 0..16 exactly as `load_digits().data` gives them
  (8x8 image, row-major, flattened to 64). The training-time 1/16 scaling is folded into `fc1.weight`
  (W1 := W1 / 16), so do not scale inputs. Folded vs unfolded held-out predictions are identical
  (max |logit diff| {max_diff:.3g}).
- Output: 10 logits; argmax indexes `labels` "0".."9".
- `examples.json`: the first {N_EXAMPLES} test-split digits as a ready `POST /predict` body (`inputs`, raw
  pixels); `examples_labels.json`: their true labels, {labels}.

## Files

- `model.safetensors`: float32 `fc1.weight` (256, 64), `fc1.bias` (256,), `fc2.weight` (256, 256),
  `fc2.bias` (256,), `fc3.weight` (10, 256), `fc3.bias` (10,); PyTorch layout (out_features, in_features).
  sha256 `{sha}`
- `config.json`: format `fusedserve-model/1`, op list linear/relu/linear/relu/linear.
""")
    print(f"wrote {out} (model.safetensors sha256 {sha})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
