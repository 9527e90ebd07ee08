"""`llmserve-client chat`: a conversation held on the server, one turn per line.

Interactive on a terminal (readline line editing and history, the answer streams as it is generated);
with stdin piped, every line is one turn and the answers are printed one after another. Each turn sends
only the new message (append mode) under the session id (`--session`, or a generated one). Lines that
start with "/" are commands:

    /reset          forget the conversation (the system message, if any, is kept for the next one)
    /system TEXT    start a new conversation with TEXT as its system message ("/system" alone: none)
    /stats          what the server holds for the session, and the last turn's usage and timing
    /quit           leave (so does end of input, Ctrl-D)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import grpc

from llmserve_client.client import Client
from llmserve_client.conversation import Conversation
from llmserve_client.pb.llmserve.v1 import generate_pb2 as pb

HELP = "commands: /reset, /system TEXT, /stats, /quit"


def add_parser(commands: Any) -> None:
    chat = commands.add_parser(
        "chat",
        help="an interactive conversation held on the server (stdin piped: one turn per line)",
        description=__doc__.split("\n\n")[0],
    )
    chat.add_argument("--session", default="", help="session id; unset: a new random one. An existing one resumes")
    chat.add_argument("--system", default=None, help="system message of a new conversation")
    chat.add_argument("--max-new-tokens", type=int, default=None, help="per answer; default: the server's")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    chat.add_argument("--top-p", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--stats", action="store_true", help="print each turn's usage and timing to stderr")
    chat.add_argument("--adapter", default="", help="the LoRA adapter to answer with (its name on the server)")


def run(client: Client, args: argparse.Namespace, stdin: TextIO = sys.stdin) -> int:
    """The chat loop; returns the exit status (1 when a turn failed and input is not a terminal)."""
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - importing it gives input() line editing and history
        except ImportError:  # not on every platform
            pass
    options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        options["seed"] = args.seed
    if args.adapter:
        options["adapter"] = args.adapter
    conversation = Conversation(client, args.session or None, system=args.system, **options)
    held = client.get_session(conversation.session_id) if args.session else None
    if held is not None and held.history_input == pb.HISTORY_INPUT_CHAT:
        conversation.started = True  # the first line continues what the server holds
        ignored = "; --system ignored" if args.system else ""
        _note(f"continuing session {conversation.session_id} ({held.history_turns} turns held{ignored})")
    else:
        _note(f"session {conversation.session_id}" + (f" ({HELP})" if interactive else ""))
    while True:
        try:
            line = _read_line(stdin, interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt
            print(file=sys.stderr)
            return 130
        if line is None:
            return 0
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if not _command(conversation, line):
                    return 0
                continue
            _turn(conversation, line, args.stats)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if not interactive:
                return 1
        except KeyboardInterrupt:  # Ctrl-C while the answer streams: the call is cancelled, the history unchanged
            print("\n[cancelled]", file=sys.stderr)


def _read_line(stdin: TextIO, interactive: bool) -> str | None:
    """The next line without its newline; None at end of input."""
    if not interactive:
        line = stdin.readline()
        return line.rstrip("\n") if line else None
    try:
        return input("> ")
    except EOFError:
        print(file=sys.stderr)
        return None


def _turn(conversation: Conversation, message: str, stats: bool) -> None:
    responses = conversation.send(message)
    try:
        for response in responses:
            sys.stdout.write(response.text)
            sys.stdout.flush()
    finally:
        responses.close()  # cancels the call if the loop was interrupted
        sys.stdout.write("\n")
        sys.stdout.flush()
    if stats and conversation.last is not None:
        _note(_usage_line(conversation.last))


def _command(conversation: Conversation, line: str) -> bool:
    """Run one /command; False means leave."""
    name, _, rest = line.partition(" ")
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        conversation.reset()
        _note(f"new conversation in session {conversation.session_id}")
    elif name == "/system":
        conversation.reset(system=rest.strip())
        shown = f"system message: {rest.strip()!r}" if rest.strip() else "no system message"
        _note(f"new conversation in session {conversation.session_id}, {shown}")
    elif name == "/stats":
        held = conversation.stats()
        if held is None:
            _note(f"session {conversation.session_id}: the server holds nothing")
        else:
            _note(
                f"session {conversation.session_id}: history {held.history_turns} turns, {held.history_tokens} tokens; "
                f"{held.cached_tokens} tokens cached"
            )
        if conversation.last is not None:
            _note("last turn: " + _usage_line(conversation.last))
    else:
        _note(f"unknown command {name!r}; {HELP}")
    return True


def _usage_line(last: pb.GenerateResponse) -> str:
    u, t = last.usage, last.timing
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    return (
        f"finish={reason} prompt_tokens={u.prompt_tokens} cached={u.cached_prompt_tokens} "
        f"completion_tokens={u.completion_tokens} ttft={t.time_to_first_token_seconds * 1e3:.0f}ms "
        f"total={t.total_seconds * 1e3:.0f}ms"
    )


def _note(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)
