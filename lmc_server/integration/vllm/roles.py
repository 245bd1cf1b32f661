"""What the connector's two roles pass each other through vLLM, and the GPU architecture
a role runs on: plain data, so that a worker's handshake and a step's plan read the same
on either side of vLLM's process boundary (vLLM pickles them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from lmc_server.integration.plans import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class LMCacheMPHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV cache description (:class:`KVLayout` as plain data)."""

    layout: dict[str, Any]


class LMCacheMPMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def detect_arch() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception as exc:  # no usable CUDA: the CPU engine
        logger.debug("no CUDA device for arch detection: %s", exc)
    return "cpu"
