"""`llmserve-client` / `python -m llmserve_client`: talk to an llmserve server from a shell.

    llmserve-client generate "Tell me a joke" --max-new-tokens 64     # prints text as it streams
    llmserve-client generate "What is 2+2?" --chat --json             # one JSON line per response message
    llmserve-client chat --session ana-1                              # a conversation held on the server
    llmserve-client health                                            # exit status 0 only when SERVING
    llmserve-client model-info
    llmserve-client tokenize "Hello world"
    llmserve-client embed "first text" "second text" --dimensions 128  # one JSON line per input
    llmserve-client rerank "a query" "first document" "second document" --top-n 1  # best first, one JSON line each

Exit status: 0 on success, 1 when the server answered with an error (or health is not SERVING), 2 for usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from llmserve_client import chat, pb
from llmserve_client.auth import TOKEN_ENV, TOKEN_FILE_ENV, resolve_token
from llmserve_client.channel import TLS
from llmserve_client.client import Client
from llmserve_client.retry import CallInfo

DEFAULT_TARGET = "localhost:50051"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve-client", description="Client for the llmserve gRPC service.")
    parser.add_argument(
        "--address",
        default=os.environ.get("LLMSERVE_TARGET", DEFAULT_TARGET),
        help=f"server host:port [env LLMSERVE_TARGET; default {DEFAULT_TARGET}]",
    )
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    parser.add_argument("--tls", action="store_true", help="use TLS (implied by --ca-cert/--cert)")
    parser.add_argument("--ca-cert", help="PEM file of root certificates to verify the server")
    parser.add_argument("--cert", help="PEM client certificate chain (mutual TLS; needs --key)")
    parser.add_argument("--key", help="PEM client private key (mutual TLS)")
    parser.add_argument(
        "--token",
        default=None,
        help=f"bearer token sent on every call (visible to other users in ps: prefer the env or a file) "
        f"[env {TOKEN_ENV}]",
    )
    parser.add_argument("--token-file", default=None, help=f"file holding the bearer token [env {TOKEN_FILE_ENV}]")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--system", help="with --chat: a system message before it")
    gen.add_argument(
        "--session",
        default="",
        help="session id: the server keeps its cache and history (also sent as x-session-id for routing)",
    )
    gen.add_argument(
        "--continue",
        dest="continue_session",
        action="store_true",
        help="with --session: the prompt continues the session's history (send only the new turn)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=None, help="default: the server's")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--adapter", default="", help="the LoRA adapter to generate with (its name on the server)")
    gen.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions of the prompt (one prefill); above 1 each is printed once finished, after '[INDEX]'",
    )
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], over generated tokens")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], over generated tokens")
    gen.add_argument(
        "--logit-bias", action="append", default=[], metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable)"
    )
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid against this schema file")
    constraint.add_argument("--json-object", action="store_true", help="the answer is one JSON object")
    constraint.add_argument("--regex", help="the whole answer matches this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", help="the answer follows this Lark grammar file")
    constraint.add_argument(
        "--choice", metavar="A,B,C", help="the answer is exactly one of these comma-separated strings"
    )
    gen.add_argument(
        "--json", action="store_true", help="print each response message as one line of JSON (proto field names)"
    )
    gen.add_argument(
        "--stats", action="store_true", help="print usage, timing and the replica that served it to stderr at the end"
    )

    chat.add_parser(commands)

    health = commands.add_parser("health", help="grpc.health.v1 check; exit 0 only when SERVING")
    health.add_argument("--service", default="", help="service name (default: the whole server)")

    commands.add_parser("model-info", help="print the served model's description as JSON")

    adapters = commands.add_parser("adapters", help="list, load or unload the server's LoRA adapters (admin)")
    actions = adapters.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="print the loaded adapters and the limits as JSON")
    load = actions.add_parser("load", help="read a PEFT adapter folder on the server and serve it under NAME")
    load.add_argument("name")
    load.add_argument("path", help="the adapter folder, on the server's file system")
    unload = actions.add_parser("unload", help="unload an adapter (requests using it finish on it)")
    unload.add_argument("name")

    emb = commands.add_parser("embed", help="print the vector of each text as one line of JSON")
    emb.add_argument("texts", nargs="+", help="the texts, one input each ('-': one input per line of stdin)")
    emb.add_argument("--chat", action="store_true", help="send each text as a user message (chat template)")
    emb.add_argument(
        "--normalize", action=argparse.BooleanOptionalAction, default=None, help="default: the model's own setting"
    )
    emb.add_argument("--dimensions", type=int, default=None, help="keep the first N entries (Matryoshka)")
    emb.add_argument(
        "--truncate", choices=["keep-start", "keep-end"], default=None, help="cut a too-long input (default: refuse)"
    )
    emb.add_argument("--pooling", choices=["cls", "mean", "last", "max"], default=None, help="default: the model's")
    emb.add_argument("--prompt-name", default=None, help="one of the model's instruction prompts (default: its own)")
    emb.add_argument("--prompt", default=None, help="an instruction prompt of one's own ('': none at all)")
    emb.add_argument("--request-id", default="")
    emb.add_argument("--stats", action="store_true", help="print the usage to stderr at the end")

    rr = commands.add_parser(
        "rerank", help="score documents against a query (cross-encoder), best first, as JSON lines"
    )
    rr.add_argument("query")
    rr.add_argument("documents", nargs="+", help="the documents ('-': one document per line of stdin)")
    rr.add_argument("--top-n", type=int, default=0, help="print the N best only (default: all)")
    rr.add_argument("--documents", action="store_true", dest="return_documents", help="print each document's text")
    rr.add_argument("--input-order", action="store_true", help="in the documents' order instead of best first")
    rr.add_argument("--request-id", default="")
    rr.add_argument("--stats", action="store_true", help="print the usage to stderr at the end")

    tok = commands.add_parser("tokenize", help="print the token ids as JSON")
    tok.add_argument("text")
    tok.add_argument("--chat", action="store_true", help="tokenize as a user message (chat template)")
    return parser


def _tls(args: argparse.Namespace) -> TLS | None:
    if args.cert or args.key or args.ca_cert:
        return TLS.from_files(ca=args.ca_cert, cert=args.cert, key=args.key)
    return TLS() if args.tls else None


def _generate(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        source: dict[str, Any] = {"messages": [*messages, {"role": "user", "content": prompt}]}
    else:
        source = {"prompt": prompt}
    last = None
    finals: dict[int, pb.GenerateResponse] = {}  # each completion's last message
    texts: dict[int, str] = {}  # with --n > 1: each completion's text so far, printed once it finishes
    info = CallInfo()
    for response in client.generate(
        **source,
        info=info,
        timeout=args.timeout,
        session_id=args.session,
        continue_session=args.continue_session,
        request_id=args.request_id,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        n=args.n,
        adapter=args.adapter,
        **_sampling_controls(args),
    ):
        if args.json:
            print(json_format.MessageToJson(response, indent=None, preserving_proto_field_name=True), flush=True)
        elif args.n > 1:
            texts[response.index] = texts.get(response.index, "") + response.text
            if response.finish_reason:
                print(f"[{response.index}] {texts[response.index]}", flush=True)
        else:
            sys.stdout.write(response.text)
            sys.stdout.flush()
        if response.finish_reason:
            finals[response.index] = response
        last = response
    if not args.json and args.n <= 1:
        sys.stdout.write("\n")
    if args.stats and last is not None:
        for index, final in sorted(finals.items()):
            reason = pb.FinishReason.Name(final.finish_reason)
            u, t = final.usage, final.timing
            tag = f"[{final.request_id}]" if args.n <= 1 else f"[{final.request_id} #{index}]"
            print(
                f"{tag} finish={reason.removeprefix('FINISH_REASON_').lower()} "
                f"prompt_tokens={u.prompt_tokens} cached={u.cached_prompt_tokens} "
                f"completion_tokens={u.completion_tokens} "
                f"ttft={t.time_to_first_token_seconds * 1e3:.0f}ms total={t.total_seconds * 1e3:.0f}ms "
                f"replica={info.replica or '-'} attempts={info.attempts}",
                file=sys.stderr,
            )
        if last.HasField("total_usage"):
            u = last.total_usage
            print(
                f"[{last.request_id}] total prompt_tokens={u.prompt_tokens} cached={u.cached_prompt_tokens} "
                f"completion_tokens={u.completion_tokens}",
                file=sys.stderr,
            )
    return 0


def _sampling_controls(args: argparse.Namespace) -> dict[str, Any]:
    """The penalties, logit bias and constraint flags as build_request arguments (files read here)."""
    bias: dict[int, float] = {}
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--logit-bias {item!r}: expected ID=BIAS")
        bias[int(token)] = float(value)
    out: dict[str, Any] = {
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "logit_bias": bias,
        "json_object": args.json_object,
        "regex": args.regex,
    }
    if args.json_schema is not None:
        with open(args.json_schema, encoding="utf-8") as f:
            out["json_schema"] = f.read()
    if args.grammar is not None:
        with open(args.grammar, encoding="utf-8") as f:
            out["grammar"] = f.read()
    if args.choice is not None:
        out["choice"] = [option for option in args.choice.split(",") if option]
    return out


def _with_stdin(values: list[str]) -> list[str]:
    """The command's texts as given, `-` standing for standard input's non-empty lines."""
    out: list[str] = []
    for value in values:
        if value == "-":
            out.extend(line for line in sys.stdin.read().splitlines() if line)
        else:
            out.append(value)
    return out


def _embed(client: Client, args: argparse.Namespace) -> int:
    texts = _with_stdin(args.texts)
    inputs: list[Any] = [[{"role": "user", "content": t}] for t in texts] if args.chat else texts
    response = client.embed(
        inputs,
        timeout=args.timeout,
        normalize=args.normalize,
        dimensions=args.dimensions,
        truncate=args.truncate,
        pooling=args.pooling,
        request_id=args.request_id,
        prompt_name=args.prompt_name,
        prompt=args.prompt,
    )
    for embedding in response.embeddings:
        line: dict[str, Any] = {
            "index": embedding.index,
            "values": list(embedding.values),
            "prompt_tokens": embedding.prompt_tokens,
        }
        if embedding.truncated:
            line["truncated"] = True
        if response.labels:
            line["probabilities"] = dict(zip(response.labels, embedding.probabilities, strict=True))
        print(json.dumps(line), flush=True)
    if args.stats:
        print(f"[{response.request_id}] prompt_tokens={response.usage.prompt_tokens}", file=sys.stderr)
    return 0


def _rerank(client: Client, args: argparse.Namespace) -> int:
    response = client.rerank(
        args.query,
        _with_stdin(args.documents),
        timeout=args.timeout,
        top_n=args.top_n,
        return_documents=args.return_documents,
        input_order=args.input_order,
        request_id=args.request_id,
    )
    for result in response.results:
        line: dict[str, Any] = {"index": result.index, "score": result.score}
        if args.return_documents:
            line["document"] = result.document
        if len(result.logits) > 1:
            line["probabilities"] = dict(zip(response.labels, result.probabilities, strict=True))
        if result.truncated:
            line["truncated"] = True
        print(json.dumps(line), flush=True)
    if args.stats:
        print(f"[{response.request_id}] prompt_tokens={response.usage.prompt_tokens}", file=sys.stderr)
    return 0


def _adapters(client: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        response: Any = client.list_adapters()
    elif args.action == "load":
        response = client.load_adapter(args.name, args.path)
    else:
        response = {"draining_requests": client.unload_adapter(args.name)}
    if not isinstance(response, dict):
        response = json_format.MessageToDict(response, preserving_proto_field_name=True)
    print(json.dumps(response, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.continue_session and not args.session:
        parser.error("--continue needs --session")
    try:
        token = resolve_token(args.token, args.token_file)
    except (OSError, ValueError) as exc:
        parser.error(f"token: {exc}")
    try:
        with Client(args.address, timeout=args.timeout, tls=_tls(args), token=token) as client:
            if args.command == "generate":
                return _generate(client, args)
            if args.command == "chat":
                return chat.run(client, args)
            if args.command == "health":
                status = client.health(args.service)
                print(status)
                return 0 if status == "SERVING" else 1
            if args.command == "adapters":
                return _adapters(client, args)
            if args.command == "embed":
                return _embed(client, args)
            if args.command == "rerank":
                return _rerank(client, args)
            if args.command == "model-info":
                print(json_format.MessageToJson(client.model_info(), indent=2, preserving_proto_field_name=True))
                return 0
            messages = [{"role": "user", "content": args.text}] if args.chat else None
            text = None if args.chat else args.text
            print(json.dumps({"token_ids": client.tokenize(text, messages=messages)}))
            return 0
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
