"""Precision: the dtype the update computes in under `precision`, its autocast, and whether a
float16 gradient scaler is needed."""

import contextlib

import torch

PRECISIONS = (16, 32, "bf16")  # config.precision


def compute_dtype(config):
    """The dtype the update computes in under `precision`: None for 32 (no autocast); bfloat16 for
    bf16 on any device (the official code's compute type); float16 for 16 on CUDA, bfloat16 for 16
    on a CPU (float16 matmuls are slow there, and bfloat16 needs no scaler)."""
    if config.precision == 32:
        return None
    cuda = torch.device(config.device).type == "cuda"
    return torch.float16 if config.precision == 16 and cuda else torch.bfloat16


def autocast(config):
    """Autocast to compute_dtype(config); a no-op for precision 32. Parameters, optimizer moments,
    normalisation statistics (networks.LayerNorm, RMSNorm, ReturnNorm) and distribution parameters
    (the tools distributions) stay float32."""
    dtype = compute_dtype(config)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=dtype)


def use_scaler(config):
    """A gradient scaler only for float16 (precision 16 on CUDA): bfloat16 has float32's range."""
    return config.precision == 16 and torch.device(config.device).type == "cuda"


def precision_note(config):
    """The start-up summary's line on what runs under `precision`."""
    dtype = compute_dtype(config)
    if dtype is None:
        return f"{config.precision} (float32)"
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    where = " on a CPU" if config.precision == 16 and torch.device(config.device).type != "cuda" else ""
    scaler = "gradient scaler" if use_scaler(config) else "no scaler"
    return f"{config.precision} ({name} autocast{where}, {scaler}; parameters float32)"
