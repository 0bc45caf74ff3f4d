"""`infinigen-rt`: generate from a bundle, pull a bundle from the Hub."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Annotated, Optional

import typer

from infinigen_rt import __version__
from infinigen_rt.console import add_version_option, console, err_console, parse_bytes, print_json, run_app

app = typer.Typer(
    name="infinigen-rt",
    help="InfiniGen runtime: generate from a bundle with the KV cache policy of your choice.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=False,
)

BundleArg = Annotated[str, typer.Argument(help="Bundle folder, or a Hub repo id to pull.")]
Revision = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) for a repo id.")]


add_version_option(app, "infinigen-rt", __version__)

# engine and KV options shared by generate and serve
Device = Annotated[str, typer.Option(help="auto (cuda when present), cpu, cuda, cuda:N.")]
TPSize = Annotated[
    int, typer.Option("--tp", help="Tensor-parallel ranks: starts this many processes (torchrun) on this machine.")
]
Dtype = Annotated[str, typer.Option(help="auto (bundle dtype on GPU, float32 on CPU), float32, float16, bfloat16.")]
Policy = Annotated[str, typer.Option(help="KV policy: full, offload, infinigen, h2o, int4.")]
Alpha = Annotated[Optional[float], typer.Option(help="infinigen: logit margin below each head's max (bundle default).")]
Budget = Annotated[float, typer.Option(help="infinigen: most tokens fetched per head, share of the context.")]
MaxKV = Annotated[Optional[int], typer.Option("--max-kv", help="infinigen: most tokens fetched per head.")]
Capacity = Annotated[
    Optional[float], typer.Option(help="Host pool tokens per (sequence, KV head): share <= 1 or count.")
]
Eviction = Annotated[str, typer.Option(help="Pool eviction: counter, lru, fifo.")]
Window = Annotated[int, typer.Option(help="Most recent positions never evicted.")]
DenseLayers = Annotated[
    Optional[int], typer.Option(help="infinigen: first layers attending to everything (bundle default).")
]
PrefillChunk = Annotated[Optional[int], typer.Option(help="Prefill in chunks of this many tokens.")]


@app.command()
def generate(
    bundle: BundleArg,
    prompt: Annotated[str, typer.Argument(help="The prompt text ('-' reads standard input).")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    policy: Policy = "full",
    alpha: Alpha = None,
    budget: Budget = 0.2,
    max_kv: MaxKV = None,
    capacity: Capacity = None,
    eviction: Eviction = "counter",
    window: Window = 16,
    dense_layers: DenseLayers = None,
    prefill_chunk: PrefillChunk = None,
    trace_recall: Annotated[
        bool,
        typer.Option(
            "--trace-recall", help="infinigen: measure the attention mass the fetched tokens hold (slow; diagnosis)."
        ),
    ] = False,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt as a user message with the chat template.")
    ] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they come.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    revision: Revision = None,
    verify: Annotated[bool, typer.Option(help="Check every bundle file's sha256 before loading.")] = True,
    tp: TPSize = 1,
):
    """Generate text from PROMPT with a bundle.

    Examples:
      infinigen-rt generate artifacts/bundles/smollm2-135m "The king said" -n 64
      infinigen-rt generate artifacts/bundles/smollm2-135m "Write a haiku" --chat --stream
      infinigen-rt generate user/my-bundle "Hello" --json
      infinigen-rt generate bundles/smol - --policy infinigen --budget 0.1 --capacity 0.5 --json < book.txt

    Tensor parallelism (each rank its share of the heads; rank 0 prints):
      torchrun --nproc-per-node 2 -m infinigen_rt.cli generate BUNDLE "Hello" --device cpu
    """
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.errors import InfinigenError, notice
    from infinigen_rt.generate import generate as run
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.policies import KVOptions, configure, policy_class
    from infinigen_rt.runner import check_context
    from infinigen_rt.sampling import SamplingParams
    from infinigen_rt.system import resolve_device
    from infinigen_rt.tokenizer import check_text
    from infinigen_rt.tp import check_tp_option, follower_env, from_env, launch

    if check_tp_option(tp):
        if prompt == "-":
            raise InfinigenError("--tp with the prompt on standard input: give it as an argument, or run torchrun")
        raise typer.Exit(launch(tp, sys.argv[1:]))

    if prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            byte = e.object[e.start]
            raise InfinigenError(f"standard input is not UTF-8 text (byte 0x{byte:02X} at {e.start})") from None
    check_text(prompt, "the prompt")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    path = resolve_bundle(bundle, revision)
    quiet = json_out or follower_env()
    with console.status("loading bundle", spinner="dots") if not quiet else nullcontext():
        b = read_bundle(path, verify=verify)
        tp = from_env(resolve_device(device), b.config)  # under torchrun: one rank of a tensor-parallel group
        follower = tp is not None and tp.rank != 0  # runs every step with rank 0, prints nothing
        kv = KVOptions(alpha, budget, max_kv, capacity, eviction, window, dense_layers, prefill_chunk, trace_recall)
        policy_class(policy)  # before loading: a bad name or option fails fast
        kv.check()
        engine = Engine(b, device=device, dtype=dtype, tp=tp)
        run_policy = configure(engine, policy, kv)
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    context = engine.cfg.max_position_embeddings
    room = context - len(ids)
    if 0 < room < max_new_tokens:  # a prompt that leaves no room at all is refused below
        notice(f"--max-new-tokens {max_new_tokens} capped to {room}: what the prompt leaves of the {context} positions")
        max_new_tokens = room
    check_context(len(ids), max_new_tokens, context)

    printer = _StreamPrinter(tok) if stream and not quiet else None
    if printer is None and not quiet:
        progress = _progress(max_new_tokens)
    else:
        progress = None
    on_step = printer.update if printer else (progress.step if progress else None)
    if progress:
        progress.start()
    try:
        results, stats = run(engine, [ids], max_new_tokens, sampling, stop, on_step, policy=run_policy)
    finally:
        if progress:
            progress.stop()
    res = results[0]
    if follower:
        return
    if json_out:
        print_json(
            {
                "text": res.text,
                "token_ids": res.token_ids,
                "prompt_token_ids": res.prompt_token_ids,
                "finish_reason": res.finish_reason,
                "stats": stats.to_dict(),
            }
        )
        return
    if printer:
        printer.finish(res.text)
    else:
        console.print(prompt if not chat else "", end="", markup=False)
        console.print(res.text, markup=False)
    s = stats.to_dict()
    err_console.print(
        f"[dim]{len(res.prompt_token_ids)} prompt tokens, {len(res.token_ids)} generated ({res.finish_reason}) | "
        f"prefill {s['prefill_tokens_per_s']} tok/s | decode {s['decode_tokens_per_s']} tok/s, "
        f"{s['ms_per_step']} ms/step | {s['policy']} on {s['device']} ({s['dtype']})[/]"
    )


@app.command()
def pull(
    repo_id: Annotated[str, typer.Argument(help="Hub repo id of a bundle.")],
    revision: Revision = None,
    out: Annotated[Optional[str], typer.Option(help="Copy into this folder instead of the HF cache.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Download a bundle from the Hub and verify it.

    Examples:
      infinigen-rt pull user/smollm2-135m-infinigen
      infinigen-rt pull user/smollm2-135m-infinigen --revision v1 --out bundles/smol
    """
    from pathlib import Path

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.files import check_writable_dir
    from infinigen_rt.hub import download

    if out is not None:
        check_writable_dir(Path(out), "the bundle")
    path = download(repo_id, revision, local_dir=out)
    b = read_bundle(path, verify=True)
    if json_out:
        print_json({"path": str(path), "repo_id": repo_id, "architecture": b.config.arch, "verified": True})
    else:
        console.print(f"[green]pulled[/] {repo_id} -> {path} (verified)")


class _StreamPrinter:
    """Prints the new text of sequence 0 after each step, holding back half-decoded UTF-8."""

    def __init__(self, tok):
        self.tok, self.shown = tok, ""

    def update(self, generated):
        text = self.tok.decode(generated[0])
        if text.endswith("\ufffd"):
            return
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text

    def finish(self, final: str):
        if final.startswith(self.shown):
            sys.stdout.write(final[len(self.shown) :])
        sys.stdout.write("\n")
        sys.stdout.flush()


class _progress:
    """A progress bar over generated tokens (on stderr, so stdout stays the text)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
        )
        self.task = self.p.add_task("gen", total=total)

    def start(self):
        self.p.start()

    def stop(self):
        self.p.stop()

    def step(self, generated):
        self.p.update(self.task, completed=max(len(g) for g in generated))


@app.command()
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
    api_key: Annotated[
        Optional[str],
        typer.Option("--api-key", envvar="INFINIGEN_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."),
    ] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    policy: Policy = "full",
    alpha: Alpha = None,
    budget: Budget = 0.2,
    max_kv: MaxKV = None,
    capacity: Capacity = None,
    eviction: Eviction = "counter",
    window: Window = 16,
    dense_layers: DenseLayers = None,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prompt tokens prefilled per step, between decode steps of the running requests.")
    ] = 512,
    revision: Revision = None,
    verify: Annotated[bool, typer.Option(help="Check every bundle file's sha256 before loading.")] = True,
    tp: TPSize = 1,
):
    """Serve a bundle over an OpenAI-compatible HTTP API (needs: pip install 'infinigen\\[serve]').

    /v1/models, /v1/completions, /v1/chat/completions ("stream": true for SSE), /health, /metrics.

    Requests join the running batch at the next step and leave it when they end (continuous batching).
    A request may override KV options with {"infinigen": {"alpha": A, "budget": B}}.

    Examples:
      infinigen-rt serve artifacts/bundles/smollm2-135m
      infinigen-rt serve artifacts/bundles/smollm2-135m --policy infinigen --max-batch 16 --port 8080
      INFINIGEN_API_KEY=secret infinigen-rt serve bundles/smol --host 0.0.0.0
    """
    from infinigen_rt.errors import InfinigenError

    try:  # the serve extra: imported only here, so the rest of the runtime works without it
        import fastapi  # noqa: F401
        import uvicorn

        from infinigen_rt.serve.app import create_app
    except ImportError as e:
        raise InfinigenError(f"serve needs {e.name or 'fastapi'}: pip install 'infinigen[serve]'") from None
    from pathlib import Path

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.hub import resolve_bundle
    from infinigen_rt.policies import KVOptions, configure, policy_class
    from infinigen_rt.runner import check_pool_options
    from infinigen_rt.serve.ranks import control_group, follow
    from infinigen_rt.system import resolve_device
    from infinigen_rt.tp import check_tp_option, from_env, launch

    if check_tp_option(tp):
        raise typer.Exit(launch(tp, sys.argv[1:]))

    if max_batch < 1 or max_queue < 1 or prefill_chunk < 1:
        raise InfinigenError(
            f"--max-batch, --max-queue and --prefill-chunk must be >= 1, got {max_batch}, {max_queue}, {prefill_chunk}"
        )
    check_pool_options(kv_tokens, kv_memory)  # before loading: a bad size fails fast
    kv_bytes = None if kv_memory is None else parse_bytes(kv_memory, "--kv-memory")
    if max_body is not None and max_body < 1024:
        raise InfinigenError(f"--max-body must be at least 1024 bytes, got {max_body}")
    path = resolve_bundle(bundle, revision)
    kv = KVOptions(
        alpha=alpha, budget=budget, max_kv=max_kv, capacity=capacity, eviction=eviction, window=window,
        dense_layers=dense_layers,
    )  # fmt: skip
    policy_class(policy)  # before loading: a bad name or option fails fast
    kv.check()
    b = read_bundle(path, verify=verify)
    tp = from_env(resolve_device(device), b.config)  # under torchrun: rank 0 serves, the others replay its steps
    if tp is not None and tp.rank != 0:
        engine = Engine(b, device=device, dtype=dtype, tp=tp)
        configure(engine, policy, kv)  # the leader's checks: it fails alike
        follow(engine, tp, control_group())
        return
    sock = _listen_socket(host, port)  # before loading: a taken port fails fast
    with err_console.status("loading bundle", spinner="dots"):
        engine = Engine(b, device=device, dtype=dtype, tp=tp)
        server_policy = configure(engine, policy, kv)
    name = model_name or (Path(bundle).name if Path(bundle).exists() else bundle)
    server_app = create_app(
        engine, server_policy, name, max_batch=max_batch, max_queue=max_queue, api_key=api_key, max_body=max_body,
        prefill_chunk=prefill_chunk, kv_tokens=kv_tokens, kv_memory=kv_bytes,
    )  # fmt: skip
    port = sock.getsockname()[1]
    shown, dt = f"[{host}]" if ":" in host else host, str(engine.dtype).removeprefix("torch.")
    pool = server_app.state.scheduler.runner.pool.alloc
    err_console.print(
        f"serving [bold]{name}[/] ({policy} on {engine.device}, {dt}, up to {max_batch} requests per step, KV pool "
        f"of {pool.n_blocks * pool.block_size} tokens" + (f", tensor-parallel over {tp.size} ranks" if tp else "")
        + f") at http://{shown}:{port}/v1"
        + (" (API key required)" if api_key else ""),
        soft_wrap=True,
    )
    # on Ctrl+C / SIGTERM the scheduler ends every request at once (their streams get an error event and close),
    # so uvicorn's graceful wait for open connections is short
    config = uvicorn.Config(server_app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)

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


def _register():
    from infinigen_rt.cli_bench import bench_cmd
    from infinigen_rt.cli_eval import eval_cmd

    app.command("eval")(eval_cmd)
    app.command("bench")(bench_cmd)


_register()


def main():
    run_app(app)


if __name__ == "__main__":
    main()
