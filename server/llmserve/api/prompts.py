"""A Generate request's prompt as token ids: its input through the tokenizer (off the event loop) or as sent,
and, in append mode (continue_session), the session's held history followed by the new input.

Every append-mode rule is here: which input continues which history (chat continues chat; text and token ids
continue text and token ids), how the conversation is composed (held messages, the answer included, then the
new ones; held token ids, then the new ones), and the per-session token cap (a continued prompt over it is
refused; a finished conversation that reaches it ends the history). The history store (llmserve.history)
keeps the book-keeping.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import grpc

from llmserve.api.errors import ServiceError
from llmserve.api.limits import quote_prefix
from llmserve.engine.types.errors import InvalidRequest
from llmserve.history import History, HistoryBusy, HistoryInput, HistoryStore, Message, NoHistory, Turn
from llmserve.telemetry.request_log import clip
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb


def continue_chat(turn: Turn, new: Sequence[Message]) -> list[Message]:
    """The whole conversation a continuing chat call renders: held messages (answer included), then `new`."""
    held = _held(turn)
    if held.kind is not HistoryInput.CHAT:
        raise InvalidRequest(
            "chat", f"session {turn.key!r} holds a text/token_ids history: continue it with text or token_ids"
        )
    return [*held.messages, *new]


def continue_tokens(turn: Turn, new: Sequence[int], field_name: str) -> list[int]:
    """The held token ids followed by `new` (the new text's or token ids' ids)."""
    held = _held(turn)
    if held.kind is not HistoryInput.TOKENS:
        raise InvalidRequest(field_name, f"session {turn.key!r} holds a chat history: continue it with chat")
    return [*held.token_ids, *new]


def _held(turn: Turn) -> History:
    if turn.held is None:
        raise ValueError("the turn does not continue a history")
    return turn.held


class SessionPrompts:
    """Builds each Generate call's prompt, through the session history store when the call names a session.

    `max_tokens` is the per-session token cap (--max-session-tokens, else the model's context; None: none)."""

    def __init__(self, histories: HistoryStore, max_tokens: int | None) -> None:
        self.histories = histories
        self.max_tokens = max_tokens

    def check_length(self, num_tokens: int) -> None:
        """Refuse a continued prompt longer than the per-session token cap."""
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            raise InvalidRequest(
                "continue_session",
                f"the conversation would be {num_tokens} tokens, over the server's --max-session-tokens "
                f"({self.max_tokens}); start a new session with a shorter history",
            )

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
        cap = self.max_tokens
        if not turn.continues:
            ids = await prompt_token_ids(tokenizer, request)
            if kind == "chat":
                messages = [(m.role, m.content) for m in request.chat.messages]
                turn.begin(HistoryInput.CHAT, ids, messages, max_tokens=cap)
            else:
                turn.begin(HistoryInput.TOKENS, ids, max_tokens=cap)
            return
        if kind == "chat":
            new = [(m.role, m.content) for m in request.chat.messages]
            if not new:
                raise InvalidRequest("chat.messages", "must not be empty")
            conversation = continue_chat(turn, new)
            # The whole conversation is rendered again, as a caller resending it would have it rendered.
            turns = [pb.ChatMessage(role=role, content=content) for role, content in conversation]
            ids = await asyncio.to_thread(chat_token_ids, tokenizer, turns)
            turn.begin(HistoryInput.CHAT, ids, conversation, max_tokens=cap)
        elif kind == "text":
            if not request.text:
                raise InvalidRequest("text", "must not be empty")
            if tokenizer is None:
                raise InvalidRequest("text", "the model has no tokenizer: send token_ids")
            # No special tokens: the new text goes on in the middle of a conversation.
            new_ids = await asyncio.to_thread(tokenizer.encode, request.text, add_special_tokens=False)
            turn.begin(HistoryInput.TOKENS, continue_tokens(turn, new_ids, "text"), max_tokens=cap)
        elif kind == "token_ids":
            if not request.token_ids.ids:
                raise InvalidRequest("token_ids.ids", "must not be empty")
            turn.begin(HistoryInput.TOKENS, continue_tokens(turn, request.token_ids.ids, "token_ids"), max_tokens=cap)
        else:
            await prompt_token_ids(tokenizer, request)  # raises: no input
        self.check_length(len(turn.prompt_ids))


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


@functools.lru_cache(maxsize=4)
def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer adds before and after a text's own (BERT: [CLS] and [SEP]); found once per
    tokenizer (its two encodes, once per call, were half of a one-text Embed's tokenizing in py-spy), the lists
    shared: read only."""
    whole: list[int] = tokenizer.encode("a")
    own: list[int] = tokenizer.encode("a", add_special_tokens=False)
    for at in range(len(whole) - len(own) + 1):
        if whole[at : at + len(own)] == own:
            return whole[:at], whole[at + len(own) :]
    return [], []


def embed_prompt(request: pb.EmbedRequest, prompts: Sequence[tuple[str, str]], default: str, served: bool) -> str:
    """The instruction prompt an Embed call's texts get, as sentence-transformers' encode resolves it: `prompt` when
    set ("" for none), else the model's prompt named `prompt_name`, else its `default` prompt's ("" without one).
    InvalidRequest naming the field for a name the model's `prompts` lack, or for any prompt where it pools without
    the prompt's tokens (`served` false)."""
    if request.HasField("prompt"):
        text, field = request.prompt, "prompt"
    elif request.HasField("prompt_name"):
        by_name = dict(prompts)
        if request.prompt_name not in by_name:
            known = f"one of the model's ({', '.join(by_name)})" if by_name else "declared: the model has no prompts"
            raise InvalidRequest("prompt_name", f"{quote_prefix(request.prompt_name)} is not {known}")
        text, field = by_name[request.prompt_name], "prompt_name"
    else:
        return dict(prompts).get(default, "")
    if text and not served:
        raise InvalidRequest(field, "not served: the model pools without its prompt's tokens (include_prompt false)")
    return text


def embed_token_ids(
    tokenizer: Any,
    item: pb.EmbedInput,
    field: str,
    limit: int,
    truncate: int,
    lower: bool,
    specials: tuple[list[int], list[int]] = ([], []),
    content: list[int] | None = None,
    prompt: str = "",
) -> tuple[list[int], bool]:
    """One Embed input's token ids (on a worker thread: it tokenizes), and whether it was cut. At most `limit`
    tokens: a longer input is InvalidRequest naming `field` unless `truncate` (pb.Truncation) keeps its start or
    its end; a text keeps its special tokens then (its content alone is cut, as the tokenizer's own truncation
    does). A text is lowercased first where the model's folder says so (`lower`: sentence-transformers'
    do_lower_case) and framed by `specials` (special_tokens: what the tokenizer adds by default); a conversation is
    rendered without the prompt for an assistant's turn. `content`: a text's own ids when the caller tokenized it
    already (a batch's texts in one batch encode: embed_texts). `prompt` (embed_prompt) goes before a text, as a
    first system message before a conversation (sentence-transformers' two ways), never into token ids."""
    kind = item.WhichOneof("input")
    if kind == "token_ids":
        return _fit(list(item.token_ids.ids), field, limit, truncate)
    if tokenizer is None:
        raise InvalidRequest(field, "the model has no tokenizer: send token_ids")
    if kind == "chat":
        if not item.chat.messages:
            raise InvalidRequest(f"{field}.chat.messages", "must not be empty")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(f"{field}.chat", "the model has no chat template: send text or token_ids")
        turns = [{"role": m.role, "content": m.content} for m in item.chat.messages]
        if prompt:
            turns.insert(0, {"role": "system", "content": prompt})
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
        except Exception as exc:  # the template rejects the conversation
            reason = f"the chat template rejects it: {clip(str(exc), 200)}"
            raise InvalidRequest(f"{field}.chat.messages", reason) from None
        return _fit(tokenizer.encode(text, add_special_tokens=False), field, limit, truncate)
    if content is None:
        content = embed_texts(tokenizer, [prompt + item.text], lower)[0]
    head, tail = specials
    content, cut = _fit(content, field, limit - len(head) - len(tail), truncate, limit)
    return head + content + tail, cut


def embed_texts(tokenizer: Any, texts: Sequence[str], lower: bool) -> list[list[int]]:
    """The texts' own token ids (no special tokens), lowercased first when `lower`, in one batch encode."""
    batch = [text.lower() for text in texts] if lower else list(texts)
    ids: list[list[int]] = tokenizer(batch, add_special_tokens=False)["input_ids"]
    return ids


def _fit(ids: list[int], field: str, room: int, truncate: int, limit: int | None = None) -> tuple[list[int], bool]:
    """`ids` within `room` tokens (`limit`, the whole input's, for the message)."""
    if len(ids) <= room:
        return ids, False
    if truncate == pb.TRUNCATION_KEEP_START:
        return ids[:room], True
    if truncate == pb.TRUNCATION_KEEP_END:
        return ids[len(ids) - room :], True
    whole = limit if limit is not None else room
    extra = 0 if limit is None else limit - room
    raise InvalidRequest(
        field, f"is {len(ids) + extra} tokens, the model takes at most {whole} (set truncate to cut it)"
    )
