"""Which kernel variants Triton has compiled in this process (for the no-compilation-while-
serving check): per ``triton.jit`` function of dsv4ray's modules, the entries in its per-device
kernel caches. Empty under the interpreter, which compiles nothing."""

import sys

import triton


def compiled_variants() -> dict[str, int]:
    """{"module.kernel": number of compiled variants}."""
    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("dsv4ray.") or module is None:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction):
                num = sum(len(caches[0]) for caches in value.device_caches.values())
                if num:
                    counts[f"{name}.{attr}"] = num
    return counts
