"""A Generate request's prompt as token ids: its input through the tokenizer (off the event loop) or as sent,
and, in append mode (continue_session), the session's held history followed by the new input.

The history store (llmserve.history) keeps the book-keeping; this module only decides what the prompt is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from llmserve.api.errors import ServiceError
from llmserve.api.limits import quote_prefix
from llmserve.engine.errors import InvalidRequest
from llmserve.history import HistoryBusy, HistoryInput, HistoryStore, NoHistory, Turn
from llmserve.telemetry.request_log import clip
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb


class SessionPrompts:
    """Builds each Generate call's prompt, through the session history store when the call names a session."""

    def __init__(self, histories: HistoryStore) -> None:
        self.histories = histories

    async def prompt(
        self, tokenizer: Any, request: pb.GenerateRequest, request_id: str, session_key: str | None
    ) -> tuple[list[int], Turn | None]:
        """The prompt's token ids, and the session turn that will record the history (None without a session).

        The caller releases the turn once the call ends (it commits only a finished answer).
        """
        if session_key is None:
            if request.continue_session:
                raise InvalidRequest("session_id", "must be set with continue_session")
            return await prompt_token_ids(tokenizer, request), None
        try:
            turn = await self.histories.start(session_key, request_id, continues=request.continue_session)
        except NoHistory as exc:
            why = f" ({exc.reason})" if exc.reason else ""
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"session {quote_prefix(request.session_id)} holds no history to continue{why}; "
                "resend the whole conversation without continue_session to start it again",
            ) from None
        except HistoryBusy as exc:
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"session {quote_prefix(request.session_id)} is being continued by request "
                f"{quote_prefix(exc.request_id)}; "
                "retry once it has finished",
            ) from None
        try:
            await self._begin_turn(tokenizer, request, turn)
        except BaseException:
            await turn.release()
            raise
        return turn.prompt_ids, turn

    async def _begin_turn(self, tokenizer: Any, request: pb.GenerateRequest, turn: Turn) -> None:
        """Tell the turn its prompt: the input as it is, or in append mode the held history and the new input."""
        kind = request.WhichOneof("input")
        if not turn.continues:
            ids = await prompt_token_ids(tokenizer, request)
            if kind == "chat":
                turn.begin(HistoryInput.CHAT, ids, [(m.role, m.content) for m in request.chat.messages])
            else:
                turn.begin(HistoryInput.TOKENS, ids)
            return
        histories = self.histories
        if kind == "chat":
            new = [(m.role, m.content) for m in request.chat.messages]
            if not new:
                raise InvalidRequest("chat.messages", "must not be empty")
            messages = histories.continue_chat(turn, new)
            # The whole conversation is rendered again, as a caller resending it would have it rendered.
            turns = [pb.ChatMessage(role=role, content=content) for role, content in messages]
            turn.begin(HistoryInput.CHAT, await asyncio.to_thread(chat_token_ids, tokenizer, turns), messages)
        elif kind == "text":
            if not request.text:
                raise InvalidRequest("text", "must not be empty")
            if tokenizer is None:
                raise InvalidRequest("text", "the model has no tokenizer: send token_ids")
            # No special tokens: the new text goes on in the middle of a conversation.
            new_ids = await asyncio.to_thread(tokenizer.encode, request.text, add_special_tokens=False)
            turn.begin(HistoryInput.TOKENS, histories.continue_tokens(turn, new_ids, "text"))
        elif kind == "token_ids":
            if not request.token_ids.ids:
                raise InvalidRequest("token_ids.ids", "must not be empty")
            turn.begin(HistoryInput.TOKENS, histories.continue_tokens(turn, request.token_ids.ids, "token_ids"))
        else:
            await prompt_token_ids(tokenizer, request)  # raises: no input
        histories.check_length(len(turn.prompt_ids))


async def prompt_token_ids(tokenizer: Any, request: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
    """Token ids of the request's input: text and chat go through the tokenizer, off the event loop."""
    kind = request.WhichOneof("input")
    if kind is None:
        choices = ", ".join(field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise InvalidRequest("input", f"set one of {choices}")
    if kind == "token_ids":
        assert isinstance(request, pb.GenerateRequest)  # only a GenerateRequest carries token ids
        if not request.token_ids.ids:
            raise InvalidRequest("token_ids", "must not be empty")
        return list(request.token_ids.ids)
    if tokenizer is None:
        raise InvalidRequest(kind, "the model has no tokenizer: send token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "must not be empty")
        ids: list[int] = await asyncio.to_thread(tokenizer.encode, request.text)
        return ids
    return await asyncio.to_thread(chat_token_ids, tokenizer, request.chat.messages)


def chat_token_ids(tokenizer: Any, messages: Sequence[pb.ChatMessage]) -> list[int]:
    """A conversation through the model's chat template, ready for the assistant's turn."""
    if not messages:
        raise InvalidRequest("chat.messages", "must not be empty")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("chat", "the model has no chat template: send text or token_ids")
    turns = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template itself rejects the conversation (e.g. roles must alternate)
        # The template's message may quote the conversation: keep it short.
        raise InvalidRequest("chat.messages", f"the chat template rejects it: {clip(str(exc), 200)}") from None
    # The template already wrote the special tokens it wants.
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids
