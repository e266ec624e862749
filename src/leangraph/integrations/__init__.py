"""Integrations of leangraph with training runtimes that own the pipeline schedule.

Each submodule is imported on its own (``leangraph.integrations.pipelining`` for
``torch.distributed.pipelining``, ``leangraph.integrations.transformers`` for Hugging Face
``transformers`` models, ``leangraph.integrations.megatron`` for Megatron-core's CUDA-graph
path), so that importing leangraph never imports a runtime it does not use.
"""
