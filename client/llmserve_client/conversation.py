"""Conversations held on the server: each turn sends only the new message (append mode).

The first turn of a conversation is sent in full (an optional system message and the user's message)
under the session id; the server keeps the session's history (messages and answers), and every later
turn sets `continue_session` so that the server prepends that history. Nothing is resent, and the output
is the same as resending the whole conversation would give.

    with Client("localhost:50051") as client:
        chat = client.conversation(system="You are terse.")
        print(chat.ask("My name is Ana."))
        print(chat.ask("What is my name?"))
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Generator
from typing import TYPE_CHECKING, Any

from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb
from llmserve_client.request import build_request

if TYPE_CHECKING:
    from llmserve_client.aio import AsyncClient
    from llmserve_client.client import Client


def new_session_id() -> str:
    """A fresh random session id."""
    return f"chat-{uuid.uuid4().hex[:16]}"


def chat_request(
    message: str, *, session_id: str, new: bool, system: str | None = None, **options: Any
) -> pb.GenerateRequest:
    """The request for one user turn: in full when `new` (the system message first, if any), else in append mode."""
    if not session_id:
        raise ValueError("a conversation needs a session_id")
    if not new and system is not None:
        raise ValueError("a system message starts a conversation: pass new=True")
    messages = [("system", system)] if system else []
    messages.append(("user", message))
    return build_request(messages=messages, session_id=session_id, continue_session=not new, **options)


class _ConversationState:
    """What both conversation classes keep: the session id, whether the server holds its history, the options."""

    def __init__(self, session_id: str | None, system: str | None, resume: bool, options: dict[str, Any]) -> None:
        self.session_id = session_id or new_session_id()
        self.system = system
        # True once the server holds the history (a turn finished): later turns continue it.
        self.started = resume
        self.options = options
        self.last: pb.GenerateResponse | None = None  # the last turn's final message (usage, timing)

    def request(self, message: str, options: dict[str, Any]) -> pb.GenerateRequest:
        merged = {**self.options, **options}
        new = not self.started
        system = self.system if new else None
        return chat_request(message, session_id=self.session_id, new=new, system=system, **merged)

    def observe(self, response: pb.GenerateResponse) -> None:
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.last = response
            self.started = True

    def forget(self, system: str | None) -> None:
        self.started = False
        self.last = None
        if system is not None:
            self.system = system or None


class Conversation(_ConversationState):
    """A chat held on the server under one session id (see the module docstring). Not thread-safe.

    `resume=True` continues a session whose history the server already holds. `options` are
    build_request's (max_new_tokens, temperature, ...) for every turn; send() takes more per turn.
    """

    def __init__(
        self,
        client: Client,
        session_id: str | None = None,
        *,
        system: str | None = None,
        resume: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(session_id, system, resume, options)
        self.client = client

    def send(self, message: str, **options: Any) -> Generator[pb.GenerateResponse, None, None]:
        """Stream the answer to one user message. A turn cut short (error, cancel) leaves the history as it was."""
        for response in self.client.generate(self.request(message, options)):
            self.observe(response)
            yield response

    def ask(self, message: str, **options: Any) -> str:
        """The whole answer to one user message."""
        return "".join(r.text for r in self.send(message, **options))

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation on the server; the next turn starts a new one (with `system`, if given;
        "" drops the system message)."""
        self.client.delete_session(self.session_id)
        self.forget(system)

    def stats(self) -> pb.GetSessionResponse | None:
        """What the server holds for the session (history turns and tokens, cached tokens); None: nothing."""
        return self.client.get_session(self.session_id)


class AsyncConversation(_ConversationState):
    """Conversation for AsyncClient: send() is an async iterator, ask(), reset() and stats() coroutines."""

    def __init__(
        self,
        client: AsyncClient,
        session_id: str | None = None,
        *,
        system: str | None = None,
        resume: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(session_id, system, resume, options)
        self.client = client

    async def send(self, message: str, **options: Any) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.client.generate(self.request(message, options)):
            self.observe(response)
            yield response

    async def ask(self, message: str, **options: Any) -> str:
        return "".join([r.text async for r in self.send(message, **options)])

    async def reset(self, system: str | None = None) -> None:
        await self.client.delete_session(self.session_id)
        self.forget(system)

    async def stats(self) -> pb.GetSessionResponse | None:
        return await self.client.get_session(self.session_id)
