"""Model zoo: torchvision's classification families, exported three ways, imported, and checked or timed.

    fusedserve bench zoo                                  # every family, tiny, all 3 exporters, both modes on the CPU
    fusedserve bench zoo --modes unfused                  # the same without the fused mode (Triton's interpreter: slow)
    fusedserve bench zoo --families resnet50,mobilenet_v2 --size full --modes unfused
    fusedserve bench zoo --gpu                            # on a GPU host: full size, fp16, batches 1 and 256, timed
    fusedserve bench zoo --gpu --families resnet50 --max-autotune resnet50
    python -m bench.zoo ...                               # the same, without the console script
    python -m bench.zoo.report DIR/zoo_cpu.json DIR/zoo_h100.json --docs docs/models.md   # docs from results

Families (bench/zoo/families.py): AlexNet, VGG-11 with and without BN, ResNet-18/50, ResNeXt-50 32x4d, Wide
ResNet-50-2, SqueezeNet 1.1, DenseNet-121, GoogLeNet, Inception v3, MobileNetV2, MobileNetV3 small and large,
MNASNet 1.0, ShuffleNetV2 x1.0, EfficientNet-B0, EfficientNetV2-S, RegNetX-400MF, RegNetY-400MF, ConvNeXt-T; random
weights, BatchNorm statistics measured on random images. Sizes: full (torchvision's configuration, 224x224, 299 for
Inception v3) and tiny (the same block types in every stage, few blocks, narrow, 32-95 pixel inputs).

Check (the default, CPU, fp32): per (family, exporter) with exporters torchscript (torch.onnx.export dynamo=False,
opset 17), dynamo (torch.onnx.export dynamo=True) and torch.export (service.model.export.export_module): imported or
refused (the message, its node and op type), the plan's fused steps and the steps run as torch ops, and per mode
(unfused, fused) the error relative to onnxruntime on the same file (largest |difference| over largest |logit|) and
the top-1 agreement over --rows random images. Writes zoo_cpu.json and zoo_cpu.md under --out; prints a table last.
Exit status 1 when an imported model disagrees (error > 1e-4 or a top-1 differs).

--gpu: per family at full size, fp16, batches 1 and 256, hot device time (CUDA-graph replays back to back) of ours
(the service's GraphedExecutor over the fused executor, the model imported from the TorchScript export), eager
channels_last, torch.compile default (and max-autotune for the families named by --max-autotune), and onnxruntime-gpu's
CUDA provider when it can be imported; plus time to ready (ours's first forward: tuning and graph capture). Timing
is bench/kernels' (timing.measure, models.ModelProviders). Writes zoo_<gpu>.json and .md, merging the families of
earlier runs into the same file (one device call cannot time them all).
"""

# This module only parses arguments (the `fusedserve` parser imports it for every command): no torch here.

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from bench.kernels.cli import parse_batches

# Mirrors of families.FAMILIES and exporters.EXPORTERS (those import torch); tests/test_zoo.py holds them equal.
FAMILIES = (
    "alexnet", "vgg11", "vgg11_bn", "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "squeezenet1_1",
    "densenet121", "googlenet", "inception_v3", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
    "mnasnet1_0", "shufflenet_v2_x1_0", "efficientnet_b0", "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf",
    "convnext_tiny",
)  # fmt: skip
EXPORTERS = ("torchscript", "dynamo", "torch.export")
PROVIDERS = ("ours", "eager-cl", "compile", "compile-max", "ort")  # gpu.PROVIDERS
MODES = ("unfused", "fused")
GPU_BATCHES = (1, 256)


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        if text == "all":
            return allowed
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from "
                                             f"{', '.join(allowed)} (or all)")  # fmt: skip
        return names

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="output directory [bench/results/cpu, or bench/results/<gpu> with --gpu]")
    p.add_argument("--families", type=_names(FAMILIES, "family"), default=FAMILIES, help="comma-separated [all]")
    p.add_argument("--size", choices=("tiny", "full"), help="model size [tiny; --gpu: full]")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the images [0]")
    check = p.add_argument_group("check (the default)")
    check.add_argument("--exporters", type=_names(EXPORTERS, "exporter"), default=EXPORTERS, help="[all three]")
    check.add_argument("--modes", type=_names(MODES, "mode"), default=MODES, help="unfused,fused [both]")
    check.add_argument("--rows", type=int, default=8, help="images per agreement check [8]")
    check.add_argument("--fused-rows", type=int, default=2, help="of those, through the fused mode [2: interpreted]")
    check.add_argument("--fused-once", action="store_true",
                       help="the fused mode through the first exporter whose import worked only")  # fmt: skip
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="only write each family as an ONNX file (TorchScript exporter, dynamic batch; --size full by "
                        "default) into DIR, to serve or to time a start with: nothing checked or timed")  # fmt: skip
    gpu = p.add_argument_group("--gpu (timing on a CUDA device)")
    gpu.add_argument("--gpu", "--time", action="store_true", dest="gpu", help="time instead of checking")
    gpu.add_argument("--batches", type=parse_batches, default=GPU_BATCHES, help="[1,256]")
    gpu.add_argument("--max-autotune", type=_names(FAMILIES, "family"), default=(),
                     help="families that also run torch.compile max-autotune (slow: minutes each) [none]")  # fmt: skip
    gpu.add_argument("--no-ort", action="store_true", help="leave out onnxruntime-gpu even where it imports")
    gpu.add_argument("--providers", type=_names(PROVIDERS, "provider"), default=PROVIDERS,
                     help="which to time (others already in the results file are kept) [all]")  # fmt: skip
    gpu.add_argument("--tuning-s", type=float, default=None,
                     help="seconds of kernel timing ours may spend per family before it takes untimed picks, as a "
                     "service's start does (its tuning_startup_s) [no limit: every key timed]")  # fmt: skip
    gpu.add_argument("--steps", type=int, default=0, metavar="N",
                     help="also time each fused step against its unfused ops (the service's timed graph) and keep "
                     "the N slowest per case, to show where a family's time goes [0: not timed]")  # fmt: skip
    gpu.add_argument("--fresh", action="store_true", help="start a new results file instead of merging into it")


def run(args: argparse.Namespace, command: str) -> int:
    """Check (CPU) or time (--gpu). Exit status: 0 done, 1 an imported model disagreed with its reference (check)
    or one of ours gave a wrong result (--gpu), 2 cannot run here."""
    if args.size is None:
        args.size = "full" if args.gpu or args.export else "tiny"
    if args.export:
        return export_families(args.families, args.size, args.seed, args.export)
    if not args.gpu and "kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused mode on CPU tensors: Triton's interpreter
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print(f"fusedserve bench zoo --gpu: no CUDA device (torch {torch.__version__}); run it on a GPU host, or "
                  "without --gpu for the CPU check", file=sys.stderr)  # fmt: skip
            return 2
        from .gpu import execute

        return execute(args, command)
    from .run import execute

    return execute(args, command)


def export_families(names, size: str, seed: int, out: Path) -> int:
    """Each family's module (random weights, calibrated BatchNorm) as out/<family>.onnx, as a user's TorchScript export
    of the torchvision model would be; prints each file and how to serve it."""
    from . import exporters, families

    for name in names:
        t = time.perf_counter()
        path = exporters.export("torchscript", families.build(name, size, seed), families.image_shape(name, size), out,
                                name)  # fmt: skip
        path = path.rename(out / f"{name}.onnx")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t:.1f} s): "
              f"fusedserve serve --model {path}", flush=True)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), shlex.join(["python", "-m", "bench.zoo", *argv]))
