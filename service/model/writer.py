"""Model directories written: config.json + model.safetensors, from a config and its tensors, and from an ONNX file
(`fusedserve import`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FILE_MODE = 0o644  # both files, whatever the umask: a model directory is read by a server running as another user


def write_model(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write config.json (each op on one line, for reading) and model.safetensors (float32 as given), both 0644."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(st), metadata={"format": "pt"})
    st.chmod(FILE_MODE)  # safetensors creates the file 0600
    top = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in config.items() if k != "ops"]
    ops = ",\n".join(f"    {json.dumps(op)}" for op in config["ops"])
    cfg = out / "config.json"
    cfg.write_text("{\n" + "\n".join(top) + f'\n  "ops": [\n{ops}\n  ]\n}}\n')
    cfg.chmod(FILE_MODE)
    return out


def written(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """What write_model wrote where, in one line: the export helpers print it."""
    st = out / "model.safetensors"
    size = st.stat().st_size
    return (
        f"wrote {out / 'config.json'} ({len(config['ops'])} ops) and {st} ({len(tensors)} tensors, "
        f"{size / 1e6:.2f} MB), mode {FILE_MODE:o}; serve it: fusedserve serve --model {out}"
    )


def import_to_dir(
    path: Path | str,
    out_dir: Path | str,
    *,
    name: str | None = None,
    labels: list[str] | None = None,
    input_dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
    image: dict | None = None,
) -> Path:
    """`fusedserve import`: write config.json + model.safetensors for the ONNX file, checked by loading it back.
    input_dtype, mean, std, image: what clients send, the input's normalization and the preprocessing of encoded
    images (onnx_import.import_onnx)."""
    from .loader import model_from_config
    from .onnx_import import import_onnx, safe_name

    out = Path(out_dir)
    config, tensors = import_onnx(
        path,
        name=name or safe_name(out.name),
        labels=labels,
        input_dtype=input_dtype,
        mean=mean,
        std=std,
        image=image,
    )
    model_from_config(config, tensors, Path(path), Path(path))  # refuse before writing anything
    return write_model(out, config, tensors)
