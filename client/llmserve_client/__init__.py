"""Client for the llmserve gRPC service: `Client` (blocking), `AsyncClient` (asyncio) and the protobuf types.

Needs grpcio and protobuf only. Example:

    from llmserve_client import Client
    with Client("localhost:50051", timeout=30) as client:
        for response in client.generate("Once upon a time", max_new_tokens=32):
            print(response.text, end="", flush=True)
        vectors = [e.values for e in client.embed(["first text", "second text"]).embeddings]
"""

from llmserve_client.aio import AsyncClient
from llmserve_client.channel import TLS
from llmserve_client.client import Client
from llmserve_client.conversation import AsyncConversation, Conversation
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.request import build_request, chat_input, embed_request, texts_by_index, tokenize_request
from llmserve_client.retry import NO_RETRY, CallInfo, Retry

__all__ = [
    "AsyncClient",
    "AsyncConversation",
    "CallInfo",
    "Client",
    "Conversation",
    "NO_RETRY",
    "Retry",
    "TLS",
    "build_request",
    "chat_input",
    "embed_request",
    "pb",
    "texts_by_index",
    "tokenize_request",
]
