"""The ``kvmesh`` command: run a local cluster, and talk to a running one.

    kvmesh up [--model M] [--schedulers N] [--workers M] [--frontends K] [--port P]
              [--http-port P] [--redis-url URL] [--demo]
    kvmesh generate "Once upon a time" [--address A] [--max-tokens N] [--temperature T]
    kvmesh chat [--address A] [--message "Hi!"] [--system "..."]

``up`` starts Redis (an embedded valkey-server with a password made for the
run, unless ``--redis-url`` or $KVMESH_REDIS_URL names one, ``rediss://`` and
credentials allowed), then ``--schedulers`` schedulers, each one cell
(``cell-0``, ``cell-1``, ...), ``--workers`` workers spread round-robin over
the cells (so at least one each), and ``--frontends`` frontends that know
every scheduler and route between the cells, all as child processes on
loopback. The Redis URL and the cluster secret reach the children through
their environment, never their command line. It prints one line per service
as it becomes ready (each scheduler, each worker; Redis with its password
hidden), then the addresses to use (gRPC, the OpenAI-compatible HTTP API, the
dashboard, every /metrics), restarts any child that dies, and stops them all
on Ctrl-C, SIGTERM or SIGHUP, or when its output is closed; if it is killed
outright, the children stop on their own.
The children log to files in a directory it names (``--log-dir``); ``-v`` or
``--log-level`` shows their logs here instead.
"""

from __future__ import annotations

import argparse
import select
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.cluster import ClusterConfig, LocalCluster

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEMO_QUESTION = "What is the capital of France?"
_WATCH_INTERVAL_S = 1.0


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    # Ignore any further SIGINT/SIGTERM first: a second signal arriving while
    # the cluster is being stopped would otherwise abort the shutdown and
    # leave the children running.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="frontend HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=None)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "stop": args.stop,
        "repetition_penalty": args.repetition_penalty,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start a local cluster and serve until Ctrl-C")
    up.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2)")
    up.add_argument("--schedulers", type=int, default=1, metavar="N",
                    help="cells: schedulers, each with its share of the workers (default: 1)")
    up.add_argument("--workers", type=int, default=1, metavar="M",
                    help="spread round-robin over the cells; at least N (default: 1)")
    up.add_argument("--frontends", type=int, default=1, metavar="K",
                    help="each knows every scheduler and routes between the cells (default: 1)")
    up.add_argument("--port", type=int, default=50051, help="frontend port (0: a free one)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the frontend's HTTP API, /metrics and /dashboard (0: a free one)")
    up.add_argument("--no-http", action="store_true", help="serve no HTTP API")
    up.add_argument("--api-key", action="append", default=None, metavar="KEY[,KEY...]",
                    help="require API keys on the public APIs (see the README)")
    up.add_argument("--admin-api-key", action="append", default=None, metavar="KEY[,KEY...]",
                    help="keys for GetStats, /stats and /metrics")
    up.add_argument("--redis-url", default=None,
                    help="redis[s]://[[USER]:PASSWORD@]HOST:PORT/DB, handed to the services "
                         "through their environment, never their command line (default: "
                         "$KVMESH_REDIS_URL, which keeps a password out of `ps` here too; "
                         "else an embedded valkey-server with a password made for the run)")
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--device", default=None, help="workers' device: cpu (default) or cuda")
    up.add_argument("--simulate", action="store_true",
                    help="simulated workers: no model, a modelled step time, deterministic "
                         "tokens (to measure the control plane)")
    up.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="schedule each worker's next step while it computes (default: on)")
    up.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='workers draft and verify tokens (speculative decoding), e.g. '
                         '\'{"method": "ngram", "num_speculative_tokens": 5}\' (default: off)')
    up.add_argument("--log-dir", type=Path, default=None,
                    help="write each service's log to DIR/<name>.log (default: a new temporary "
                         "directory, or this terminal with -v / --log-level)")
    up.add_argument("--log-level", default=None, help="the services' log level, e.g. DEBUG")
    up.add_argument("-v", "--verbose", action="store_true",
                    help="show the services' logs in this terminal")
    up.add_argument("--demo", action="store_true",
                    help=f"stream an answer to {DEMO_QUESTION!r} once serving")

    generate = commands.add_parser("generate", help="stream a completion of a text prompt")
    generate.add_argument("prompt")
    generate.add_argument("-n", type=int, default=None, help="number of sequences")
    _add_sampling_args(generate)

    chat = commands.add_parser("chat", help="chat through the model's chat template")
    chat.add_argument("--message", default=None, help="one message, answer, exit")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_sampling_args(chat)
    return parser


# ---------------------------------------------------------------- up


def _up_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``up``'s counts of services, naming the flag; None if nothing."""
    if args.schedulers < 1:
        return f"--schedulers is {args.schedulers}, must be >= 1"
    if args.workers < args.schedulers:
        return (f"--workers is {args.workers}, must be >= --schedulers ({args.schedulers}): "
                "each cell needs a worker")
    if args.frontends < 1:
        return f"--frontends is {args.frontends}, must be >= 1"
    return None


def _up_config(args: argparse.Namespace) -> ClusterConfig:
    from kvmesh.cluster import ClusterConfig
    from services.common.security import read_redis_url

    log_dir = args.log_dir
    if log_dir is None and not (args.verbose or args.log_level):
        log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-logs-"))
    frontend_args = [f"--api-key={key}" for key in args.api_key or ()]
    frontend_args += [f"--admin-api-key={key}" for key in args.admin_api_key or ()]
    return ClusterConfig(
        model=args.model, num_schedulers=args.schedulers, num_workers=args.workers,
        num_frontends=args.frontends,
        frontend_port=args.port, frontend_http_port=None if args.no_http else args.http_port,
        redis_url=read_redis_url(args.redis_url), max_model_len=args.max_model_len,
        log_dir=log_dir,
        log_level=args.log_level, frontend_args=frontend_args,
        worker_args=(["--device", args.device] if args.device else [])
        + (["--simulate"] if args.simulate else [])
        + (["--speculative-config", args.speculative_config] if args.speculative_config else []),
        scheduler_args=[] if args.async_scheduling else ["--no-async-scheduling"],
    )


def _print_ready(name: str, detail: str) -> None:
    print(f"kvmesh: {name:<12} ready  {detail}", flush=True)


def _print_addresses(cluster: LocalCluster) -> None:
    serving = " ".join(cluster.frontend_addresses) + " (gRPC)"
    has_http = "http" in cluster.frontends[0].urls
    if has_http:
        serving += f" and {cluster.http_url}/v1 (OpenAI API)"
    print(f"kvmesh: serving on {serving}; Ctrl-C to stop", flush=True)
    if has_http:
        print(f"kvmesh: dashboard {cluster.http_url}/dashboard", flush=True)
    if metrics_urls := cluster.metrics_urls():
        print("kvmesh: metrics " + "  ".join(metrics_urls.values()), flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.cluster import LocalCluster

    if error := _up_args_error(args):
        print(f"kvmesh up: error: {error}", file=sys.stderr)
        return 2
    config = _up_config(args)
    cluster = LocalCluster(config, on_ready=_print_ready)
    # SIGTERM and SIGHUP (the terminal closed) leave the same way as Ctrl-C:
    # through the finally below. SIGINT is set too because a shell starts
    # background jobs with it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_keyboard_interrupt)
    try:
        logs = "logs below"
        if config.log_dir is not None:
            hint = " (-v to show them here)" if args.log_dir is None else ""
            logs = f"logs in {config.log_dir}{hint}"
        print(f"kvmesh: starting {args.schedulers} scheduler(s), {args.workers} worker(s) and "
              f"{args.frontends} frontend(s) on model {args.model or 'SmolLM2-135M-Instruct'}; "
              f"{logs}", flush=True)
        cluster.start()
        _print_addresses(cluster)
        if args.demo:
            _demo(cluster.address)
        _watch(cluster)
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # leaving without one
            signal.signal(sig, signal.SIG_IGN)
        _print_quietly("kvmesh: stopping...")
        cluster.stop()
        _print_quietly("kvmesh: stopped")
    return 0


def _print_quietly(line: str) -> None:
    """Prints, unless nobody reads this output any more."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        pass


def _demo(address: str) -> None:
    from kvmesh.client import Client

    print(f"\nuser: {DEMO_QUESTION}\nassistant: ", end="", flush=True)
    with Client(address) as client:
        messages = [{"role": "user", "content": DEMO_QUESTION}]
        _print_stream(client.chat(messages, temperature=0.0, max_tokens=64))
    print(flush=True)


def _watch(cluster) -> None:
    """Serves until interrupted, restarting children that exit on their own;
    leaves when its own output is gone (the reader of a pipe exited)."""
    while not _stdout_gone():
        time.sleep(_WATCH_INTERVAL_S)
        for restarted in cluster.supervise():
            print(f"kvmesh: restarted {restarted}", file=sys.stderr, flush=True)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or terminal whose other end has closed."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


# ---------------------------------------------------------------- generate / chat


def _print_stream(chunks: Iterator) -> list[str]:
    """Prints the DELTA text of output 0 as it streams; returns every output's text."""
    texts: dict[int, list[str]] = {}
    for chunk in chunks:
        for output in chunk.outputs:
            texts.setdefault(output.index, []).append(output.text)
            if output.index == 0:
                print(output.text, end="", flush=True)
    return ["".join(texts[i]) for i in sorted(texts)]


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.client import Client

    with Client(args.address) as client:
        texts = _print_stream(client.generate(args.prompt, n=args.n, **_sampling_kwargs(args)))
    print()
    for index, text in enumerate(texts[1:], start=1):
        print(f"--- sequence {index} ---\n{text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvmesh.client import Client

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None
    with Client(args.address) as client:
        while True:
            if interactive:
                try:
                    content = input("user: ")
                except EOFError:
                    print()
                    return 0
                if not content.strip():
                    continue
                print("assistant: ", end="", flush=True)
            else:
                content = args.message
            messages.append({"role": "user", "content": content})
            (answer,) = _print_stream(client.chat(messages, **_sampling_kwargs(args)))
            print()
            messages.append({"role": "assistant", "content": answer})
            if not interactive:
                return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"up": cmd_up, "generate": cmd_generate, "chat": cmd_chat}[args.command]
    try:
        return command(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # gRPC errors: print the status, not a traceback
        import grpc

        if isinstance(e, grpc.RpcError):
            print(f"kvmesh: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
