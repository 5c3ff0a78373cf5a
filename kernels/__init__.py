"""Fused Triton kernels and their eager torch references. Pure compute: never imports `service`."""

from .runtime import choose_backend, interpreting

# Must run before any module below defines a kernel: Triton fixes "interpreted or compiled" at
# definition time (see runtime.py).
choose_backend()

from .compile_deadline import install as _install_compile_deadline  # noqa: E402

# Before any kernel first runs on a device (it looks the compiler up then): every compile gets a deadline.
_install_compile_deadline()

from .activations import ACTIVATIONS, DEFAULT_NEGATIVE_SLOPE  # noqa: E402
from .conv import fused_conv2d  # noqa: E402
from .conv_grouped import fused_conv2d_grouped  # noqa: E402
from .elementwise import fused_activation  # noqa: E402
from .linear import SUPPORTED_DTYPES, FusedLinear, fused_linear  # noqa: E402
from .pool import fused_pool2d  # noqa: E402

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_NEGATIVE_SLOPE",
    "SUPPORTED_DTYPES",
    "FusedLinear",
    "fused_activation",
    "fused_conv2d",
    "fused_conv2d_grouped",
    "fused_linear",
    "fused_pool2d",
    "interpreting",
]
