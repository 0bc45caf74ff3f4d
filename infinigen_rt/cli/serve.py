"""`infinigen-rt serve`: an OpenAI-compatible HTTP server over a bundle (the serve extra)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from infinigen_rt.cli.console import err_console, parse_bytes
from infinigen_rt.cli.options import (
    BundleArg,
    Device,
    Dtype,
    Graphs,
    PolicyName,
    Revision,
    TPSize,
    Verify,
    kv_options,
)


@kv_options
def serve(
    bundle: BundleArg,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one, printed at start).")] = 8000,
    model_name: Annotated[
        Optional[str], typer.Option("--model-name", help="The model id clients send (default: the bundle folder name).")
    ] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most requests running together (one step).")] = 8,
    kv_tokens: Annotated[
        Optional[int],
        typer.Option("--kv-tokens", help="Size of the shared, paged KV pool in tokens (a request takes prompt + "
                     "max_tokens; it waits while the pool is taken). Default: --max-batch requests of full context, "
                     "for offload/infinigen/int4 at most half the free host memory."),
    ] = None,
    kv_memory: Annotated[
        Optional[str],
        typer.Option("--kv-memory", help="Size of the KV pool in bytes instead (e.g. 8GiB, 500MB): host memory for "
                     "offload/infinigen/int4, device memory for full/h2o, at the policy's bytes per token."),
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Most requests waiting; beyond it: 429.")] = 64,
    max_body: Annotated[
        Optional[int],
        typer.Option("--max-body", help="Largest request body in bytes, else 413 (default: 32 x context, >= 1 MiB)."),
    ] = None,
    body_timeout: Annotated[
        float, typer.Option("--body-timeout", help="Seconds a request body may take to arrive after its headers, "
                            "else 408 and the connection is closed.")
    ] = 30.0,
    api_key: Annotated[
        Optional[str],
        typer.Option("--api-key", envvar="INFINIGEN_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."),
    ] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    policy: PolicyName = "full",
    graphs: Graphs = False,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prompt tokens prefilled per step, between decode steps of the running requests.")
    ] = 512,
    score: Annotated[
        str,
        typer.Option(help="How prompt logprobs (echo with logprobs: lm-eval's loglikelihood) are computed: decode "
                     "(the prompt's last --score-tail tokens fed one decode step each through the policy, as eval "
                     "does: what the policy changes) or prefill (one dense pass: the same under every policy)."),
    ] = "decode",
    score_tail: Annotated[
        int, typer.Option("--score-tail", help="Prompt tokens scored by decode steps under --score decode.")
    ] = 128,
    revision: Revision = None,
    verify: Verify = True,
    tp: TPSize = 1,
    kv=None,  # the KV options, one KVOptions (kv_options)
):
    """Serve a bundle over an OpenAI-compatible HTTP API (needs: pip install 'infinigen\\[serve]').

    /v1/models, /v1/completions, /v1/chat/completions ("stream": true for SSE), /tokenize, /detokenize,
    /tokenizer_info (lm-evaluation-harness's remote tokenizer), /health, /metrics.

    Requests join the running batch at the next step and leave it when they end (continuous batching).
    A request may override KV options with {"infinigen": {"alpha": A, "budget": B}}.

    Examples:
      infinigen-rt serve artifacts/bundles/smollm2-135m
      infinigen-rt serve artifacts/bundles/smollm2-135m --policy infinigen --max-batch 16 --port 8080
      INFINIGEN_API_KEY=secret infinigen-rt serve bundles/smol --host 0.0.0.0
    """
    from pathlib import Path

    from infinigen_rt.cli.launch import launch
    from infinigen_rt.engine import Engine
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.policies import configure, policy_class
    from infinigen_rt.tp import check_tp_option

    try:  # the serve extra: imported only here, so the rest of the runtime works without it
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        from infinigen_rt.serve.app import create_app
    except ImportError as e:
        raise InfinigenError(f"serve needs {e.name or 'fastapi'}: pip install 'infinigen[serve]'") from None
    kv_bytes = _check_sizes(max_batch, max_queue, prefill_chunk, kv_tokens, kv_memory, max_body)
    if score not in ("decode", "prefill") or score_tail < 1:
        raise InfinigenError(f"--score is decode or prefill and --score-tail >= 1, got {score!r} and {score_tail}")
    if not 0 < body_timeout < float("inf"):
        raise InfinigenError(f"--body-timeout must be a number of seconds > 0, got {body_timeout}")
    policy_class(policy)  # before loading: a bad name or option fails fast (the options: kv_options)
    if check_tp_option(tp):
        raise typer.Exit(launch(tp, sys.argv[1:], bundle, revision))
    b, tp = _read(bundle, revision, verify, device)
    if tp is not None and tp.rank != 0:  # under torchrun: rank 0 serves, the others replay its steps
        _follow(b, device, dtype, tp, policy, kv)
        return
    sock = _listen_socket(host, port)  # before loading: a taken port fails fast
    with err_console.status("loading bundle", spinner="dots"):
        engine = Engine(b, device=device, dtype=dtype, tp=tp)
        server_policy = configure(engine, policy, kv)
    name = model_name or (Path(bundle).name if Path(bundle).exists() else bundle)
    server_app = create_app(
        engine, server_policy, name, max_batch=max_batch, max_queue=max_queue, api_key=api_key, max_body=max_body,
        prefill_chunk=prefill_chunk, kv_tokens=kv_tokens, kv_memory=kv_bytes, score=score, score_tail=score_tail,
        body_timeout=body_timeout, graphs=graphs,
    )  # fmt: skip
    _run(server_app, sock, host, name, policy, engine, max_batch, tp, api_key)


def _check_sizes(max_batch, max_queue, prefill_chunk, kv_tokens, kv_memory, max_body) -> int | None:
    """One-line errors for sizes that cannot work, before anything loads; --kv-memory in bytes."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.runner import check_pool_options

    if max_batch < 1 or max_queue < 1 or prefill_chunk < 1:
        raise InfinigenError(
            f"--max-batch, --max-queue and --prefill-chunk must be >= 1, got {max_batch}, {max_queue}, {prefill_chunk}"
        )
    check_pool_options(kv_tokens, kv_memory)
    if max_body is not None and max_body < 1024:
        raise InfinigenError(f"--max-body must be at least 1024 bytes, got {max_body}")
    return None if kv_memory is None else parse_bytes(kv_memory, "--kv-memory")


def _read(bundle: str, revision, verify: bool, device: str):
    """The bundle, read, and under torchrun this rank's tensor-parallel group (else None)."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.system import resolve_device
    from infinigen_rt.tp import from_env

    b = read_bundle(resolve_bundle(bundle, revision), verify=verify)
    return b, from_env(resolve_device(device), b.config)


def _follow(b, device: str, dtype: str, tp, policy: str, kv) -> None:
    """A rank other than 0: replay rank 0's runner calls until the server stops."""
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.serve.ranks import control_group, follow

    engine = Engine(b, device=device, dtype=dtype, tp=tp)
    configure(engine, policy, kv)  # the leader's checks: it fails alike
    follow(engine, tp, control_group())


def _run(server_app, sock, host: str, name: str, policy: str, engine, max_batch: int, tp, api_key) -> None:
    """Say where it serves, then serve until Ctrl+C or SIGTERM."""
    import copy

    import uvicorn

    port = sock.getsockname()[1]
    shown, dt = f"[{host}]" if ":" in host else host, str(engine.dtype).removeprefix("torch.")
    pool = server_app.state.scheduler.runner.store.alloc
    err_console.print(
        f"serving [bold]{name}[/] ({policy} on {engine.device}, {dt}, up to {max_batch} requests per step, KV pool "
        f"of {pool.n_blocks * pool.block_size} tokens" + (f", tensor-parallel over {tp.size} ranks" if tp else "")
        + f") at http://{shown}:{port}/v1"
        + (" (API key required)" if api_key else ""),
        soft_wrap=True,
    )
    # on Ctrl+C / SIGTERM the scheduler ends every request at once (their streams get an error event and close),
    # so uvicorn's graceful wait for open connections is short
    # the server's own lines (a refused request's reason, a failed step) in uvicorn's format, beside its access log
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["loggers"]["infinigen_rt"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    config = uvicorn.Config(
        server_app, host=host, port=port, log_level="info", log_config=logs, timeout_graceful_shutdown=5
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            server_app.state.scheduler.stop(wait=False)
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])


def _listen_socket(host: str, port: int):
    """A bound TCP socket for uvicorn; a taken port or a bad address is a one-line error."""
    import socket

    from infinigen_rt.errors import InfinigenError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        raise InfinigenError(f"cannot listen on {host}:{port} ({e}); pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock
