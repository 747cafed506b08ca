"""How many kernel variants Triton has compiled in this process (for the no-compilation-while-
serving check): the sum over every ``triton.jit`` function of dsv4ray's modules of the entries in
its per-device kernel caches. 0 under the interpreter, which compiles nothing."""

import sys

import triton


def compiled_variants() -> int:
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("dsv4ray.") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, triton.runtime.JITFunction):
                total += sum(len(caches[0]) for caches in value.device_caches.values())
    return total
