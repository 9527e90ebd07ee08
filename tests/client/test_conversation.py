"""Client.chat, Conversation and AsyncConversation against a real in-process server (tiny model): each turn
sends only the new message and gets what resending the whole conversation would get."""

from __future__ import annotations

import grpc
import pytest
from harness import ServerThread

from llmserve_client import AsyncClient, Client, Conversation, pb


def full_resend(client: Client, messages: list[tuple[str, str]], **options: object) -> str:
    return client.generate_text(messages=messages, **options)


def test_conversation_sends_only_the_new_message_and_matches_the_full_resend(server: ServerThread) -> None:
    with Client(server.address, timeout=60) as client:
        chat = client.conversation(system="Be brief.", max_new_tokens=8)
        assert isinstance(chat, Conversation) and chat.session_id.startswith("chat-")
        history = [("system", "Be brief.")]
        for message in ["Hello there.", "What did I say?", "Thanks."]:
            responses = list(chat.send(message))
            answer = "".join(r.text for r in responses)
            history.append(("user", message))
            assert answer == full_resend(client, history, max_new_tokens=8)
            history.append(("assistant", answer))
        assert chat.last is responses[-1] and chat.last.usage.cached_prompt_tokens > 0
        stats = chat.stats()
        assert (stats.history_turns, stats.history_input) == (3, pb.HISTORY_INPUT_CHAT)

        chat.reset(system="")  # a new conversation, without the system message
        assert chat.stats() is None
        hi = chat.ask("Hi", max_new_tokens=4)
        assert hi == full_resend(client, [("user", "Hi")], max_new_tokens=4)

        # Another object resuming the same session continues it.
        again = client.conversation(chat.session_id, resume=True, max_new_tokens=4)
        history = [("user", "Hi"), ("assistant", hi), ("user", "More")]
        assert again.ask("More") == full_resend(client, history, max_new_tokens=4)
        assert again.stats().history_turns == 2


def test_client_chat_continues_or_starts(server: ServerThread) -> None:
    with Client(server.address, timeout=60) as client:
        first = "".join(
            r.text for r in client.chat("My name is Ana.", session_id="lib-ana", new=True, max_new_tokens=6)
        )
        second = "".join(r.text for r in client.chat("And yours?", session_id="lib-ana", max_new_tokens=6))
        history = [("user", "My name is Ana."), ("assistant", first), ("user", "And yours?")]
        assert second == full_resend(client, history, max_new_tokens=6)
        with pytest.raises(grpc.RpcError) as err:
            list(client.chat("Hello?", session_id="lib-nobody"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError):
            client.chat("x", session_id="lib-ana", system="no system message mid-conversation")


async def test_async_conversation(server: ServerThread) -> None:
    async with AsyncClient(server.address, timeout=60) as client:
        chat = client.conversation(max_new_tokens=6)
        first = await chat.ask("Good morning.")
        second = "".join([r.text async for r in chat.send("Good night.")])
        assert (await chat.stats()).history_turns == 2
        direct = "".join([r.text async for r in client.chat("Again.", session_id=chat.session_id, max_new_tokens=6)])
        await chat.reset()
        assert await chat.stats() is None
    with Client(server.address, timeout=60) as sync:
        history = [("user", "Good morning."), ("assistant", first), ("user", "Good night.")]
        assert second == full_resend(sync, history, max_new_tokens=6)
        history += [("assistant", second), ("user", "Again.")]
        assert direct == full_resend(sync, history, max_new_tokens=6)
