"""kvmesh: a vLLM V1-style LLM inference engine split into gRPC services.

This package is what clients and operators use: ``kvmesh.client.Client`` (a
small Python client of the public ``kvmesh.v1.Generation`` API), the
``kvmesh`` console script (``kvmesh.cli``: a local cluster, generate, chat),
``kvmesh.healthcheck`` (a gRPC health probe), ``kvmesh.offline`` (the
in-process engine: ``LLM``, ``LLMEngine``, ``EngineArgs``) and ``kvmesh.v1``
(code generated from ``proto/kvmesh/v1`` at build time). The services
themselves live in ``services/``.
"""
