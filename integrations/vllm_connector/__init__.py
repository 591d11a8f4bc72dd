"""contextkit's KV connector for vLLM: ``--kv-transfer-config`` names this module and ``ContextKitConnector``.

``settings`` (what it takes and the transfer config that loads it), ``wire`` (what a request's
``kv_transfer_params`` hold, both ways) and ``keys`` import without vLLM;
the connector itself needs vLLM and is imported on first use.
"""

from contextkit.integrations.vllm_connector.settings import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    ConnectorSettings,
    transfer_config,
    vllm_args,
)
from contextkit.integrations.vllm_connector.wire import PROTOCOL_VERSION, ConnectorAnswer, RequestOptions

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "PROTOCOL_VERSION", "ConnectorAnswer", "ConnectorSettings",
           "ContextKitConnector", "RequestOptions", "transfer_config", "vllm_args"]


def __getattr__(name: str):
    if name == "ContextKitConnector":  # vLLM's factory: getattr(import_module(path), class name)
        from contextkit.integrations.vllm_connector.connector import ContextKitConnector

        return ContextKitConnector
    raise AttributeError(name)
