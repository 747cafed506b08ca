"""Building an engine for a config: resolve the device, read the model config, choose the
pipeline (stages in this process, or Ray stage actors) and hand it to EngineCore."""

from __future__ import annotations

import dataclasses

from dsv4ray.config import ModelConfig
from dsv4ray.engine.checks import check_paged_shapes
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.core import EngineCore
from dsv4ray.model.checkpoint_check import check_checkpoint
from dsv4ray.sources import fetch_model, is_remote


def default_device() -> str:
    import torch  # here only: importing this module (every Serve replica) does not load it

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(model: str, **options) -> EngineConfig:
    """EngineConfig.build with the device resolved (cuda when this process sees a GPU)."""
    config = EngineConfig.build(model, **options)
    if config.device is None:
        config = dataclasses.replace(config, device=default_device())
    return config


def build_engine_core(config: EngineConfig, placement=None) -> EngineCore:
    """placement: a Ray placement group whose bundle i hosts stage i (the Serve replica passes
    its own, sharing bundle 0); None creates one when the stages are actors."""
    if config.device is None:
        config = dataclasses.replace(config, device=default_device())
    if is_remote(config.model):  # copied once per machine; stage actors fetch it where they run
        config = dataclasses.replace(config, model=fetch_model(config.model),
                                     model_source=config.model)  # fmt: skip
    check_checkpoint(config.model)  # a broken file is a ValueError naming it, before any actor
    model_config = check_paged_shapes(ModelConfig.from_hf(config.model))
    for name in ("pp_size", "prefill_pp_size"):  # before any actor: a stage needs a layer
        if getattr(config, name) > model_config.num_hidden_layers:
            raise ValueError(f"{name} {getattr(config, name)} is more than the model's "
                             f"{model_config.num_hidden_layers} layers")  # fmt: skip
    longest = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > longest:
        raise ValueError(f"max_model_len {config.max_model_len} is more than the model's "
                         f"max_position_embeddings ({longest})")  # fmt: skip
    if config.enable_hisparse:  # the model's top-k bounds the hot rows: refused before any actor
        from dsv4ray.cache.hisparse_sizing import resolve_hot_rows

        resolve_hot_rows(model_config.index_topk, config.hisparse_hot_rows)
    if config.speculative_num_steps:  # a checkpoint that cannot draft fails here, by name
        from dsv4ray.model.loader import missing_draft_tensors

        missing = missing_draft_tensors(config.model, model_config)
        config.spec.check_draft_layer(model_config.mtp_ratio, missing)
    if config.prefill_pp_size:
        from dsv4ray.cluster.pd import build_pd_core  # a prefill engine actor beside this one

        return build_pd_core(config, model_config, placement)
    if config.uses_ray or placement is not None:
        from dsv4ray.cluster.pipeline import RayPipeline  # Ray starts only when actors are wanted

        pipeline = RayPipeline(config, model_config, placement)
    else:
        from dsv4ray.worker.local_pipeline import LocalPipeline  # torch, in this process

        if config.device == "cuda" and default_device() != "cuda":
            raise ValueError("device='cuda', but this process sees no CUDA GPU "
                             "(torch.cuda.is_available() is False)")  # fmt: skip
        pipeline = LocalPipeline(config, model_config)
    try:
        return EngineCore(config, model_config, pipeline)
    except BaseException:  # its stage actors and their placement group go with it
        pipeline.shutdown()
        raise
