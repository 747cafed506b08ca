"""Tensors shared between the processes of one GPU: CUDA IPC through torch's own reduction."""

import torch


def export_tensor(tensor: torch.Tensor):
    """A CUDA tensor's IPC handle (torch's own reduction); a CPU tensor itself (its peer is in
    this process)."""
    if tensor.device.type != "cuda":
        return ("local", tensor)
    from torch.multiprocessing.reductions import reduce_tensor

    return ("ipc", reduce_tensor(tensor))


def open_tensor(exported) -> torch.Tensor:
    """The tensor `export_tensor` described, mapped into this process."""
    kind, payload = exported
    if kind == "local":
        return payload
    rebuild, args = payload
    return rebuild(*args)
