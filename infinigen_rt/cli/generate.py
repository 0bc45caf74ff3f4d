"""`infinigen-rt generate`: text from a prompt with a bundle, streamed or as JSON."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import replace
from typing import Annotated, Optional

import typer

from infinigen_rt.cli.console import console, err_console, print_json
from infinigen_rt.cli.options import (
    BundleArg,
    Device,
    Dtype,
    Graphs,
    JsonOut,
    PolicyName,
    Revision,
    TPSize,
    Verify,
    kv_option,
    kv_options,
)


@kv_options
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
    policy: PolicyName = "full",
    prefill_chunk: Annotated[Optional[int], kv_option("prefill_chunk")] = None,  # KV options generate declares
    trace_recall: Annotated[bool, kv_option("trace_recall")] = False,  # (serve's --prefill-chunk is its own)
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt as a user message with the chat template.")
    ] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they come.")] = False,
    json_out: JsonOut = False,
    revision: Revision = None,
    verify: Verify = True,
    tp: TPSize = 1,
    graphs: Graphs = False,
    kv=None,  # the KV options, one KVOptions (kv_options)
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
    from infinigen_rt.cli.launch import launch
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.policies import policy_class
    from infinigen_rt.runner import check_stops
    from infinigen_rt.sampling import SamplingParams
    from infinigen_rt.tp import check_tp_option, follower_env

    # a bad name, option, limit, sampling value or stop string fails before anything loads
    policy_class(policy)
    kv = replace(kv, prefill_chunk=prefill_chunk, trace_recall=trace_recall)
    kv.check()
    if max_new_tokens < 1:
        raise InfinigenError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    try:
        check_stops(stop or [])
    except InfinigenError as e:
        raise InfinigenError(f"--stop: {e}") from None
    if check_tp_option(tp):
        if prompt == "-":
            raise InfinigenError("--tp with the prompt on standard input: give it as an argument, or run torchrun")
        raise typer.Exit(launch(tp, sys.argv[1:], bundle, revision))
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.hub import resolve_bundle

    path = resolve_bundle(bundle, revision)
    context = read_bundle(path, verify=False).config.max_position_embeddings  # its hashes are checked by _load
    prompt = _read_prompt(prompt, context)
    quiet = json_out or follower_env()
    engine, run_policy, follower = _load(path, verify, device, dtype, policy, kv, quiet)
    ids, max_new_tokens = _prompt_ids(engine, prompt, chat, max_new_tokens)
    printer = _StreamPrinter(engine.tokenizer, stop or []) if stream and not quiet else None
    progress = _progress(max_new_tokens) if printer is None and not quiet else None
    res, stats = _run(engine, run_policy, ids, max_new_tokens, sampling, stop, printer, progress, graphs)
    if not follower:  # a tensor-parallel rank other than 0 runs every step with rank 0 and prints nothing
        _show(res, stats, prompt if not chat else "", json_out, printer)


def _read_prompt(prompt: str, context: int) -> str:
    """The prompt argument, or standard input for '-': UTF-8 text that could fit the model's `context` (a one-line
    error otherwise; standard input is read no further than that: a 2 GB prompt is refused, not tokenized)."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.tokenizer import check_text, text_limit

    limit = text_limit(context)
    if prompt == "-":
        data = sys.stdin.buffer.read(limit + 1)
        if len(data) > limit:
            raise InfinigenError(f"the prompt on standard input is over {limit:,} bytes, more text than the model's "
                                 f"context of {context:,} tokens can hold; shorten it")  # fmt: skip
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            byte = e.object[e.start]
            raise InfinigenError(f"standard input is not UTF-8 text (byte 0x{byte:02X} at {e.start})") from None
    check_text(prompt, "the prompt")
    if (n := len(prompt.encode("utf-8"))) > limit:
        raise InfinigenError(f"the prompt is {n:,} bytes, more text than the model's context of {context:,} tokens "
                             "can hold; shorten it")  # fmt: skip
    return prompt


def _load(path, verify, device, dtype, policy, kv, quiet: bool):
    """(the engine, its policy, whether this process is a tensor-parallel follower) for the bundle at `path`."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.system import resolve_device
    from infinigen_rt.tp import from_env

    with console.status("loading bundle", spinner="dots") if not quiet else nullcontext():
        b = read_bundle(path, verify=verify)
        tp = from_env(resolve_device(device), b.config)  # under torchrun: one rank of a tensor-parallel group
        engine = Engine(b, device=device, dtype=dtype, tp=tp)
        return engine, configure(engine, policy, kv), tp is not None and tp.rank != 0


def _prompt_ids(engine, prompt: str, chat: bool, max_new_tokens: int) -> tuple[list[int], int]:
    """The prompt's token ids, and the new tokens it leaves room for (capped, with a notice, to the context)."""
    from infinigen_rt.errors import notice
    from infinigen_rt.runner import check_context

    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    context = engine.cfg.max_position_embeddings
    room = context - len(ids)
    if 0 < room < max_new_tokens:  # a prompt that leaves no room at all is refused below
        notice(f"--max-new-tokens {max_new_tokens} capped to {room}: what the prompt leaves of the {context} positions")
        max_new_tokens = room
    check_context(len(ids), max_new_tokens, context)
    return ids, max_new_tokens


def _run(engine, policy, ids, max_new_tokens, sampling, stop, printer, progress, graphs=False):
    """Generate, showing the text as it comes (`printer`) or a progress bar (`progress`); (result, stats)."""
    from infinigen_rt.generate import generate as run

    on_step = printer.update if printer else (progress.step if progress else None)
    if progress:
        progress.start()
    try:
        results, stats = run(engine, [ids], max_new_tokens, sampling, stop, on_step, policy=policy, graphs=graphs)
    finally:
        if progress:
            progress.stop()
    return results[0], stats


def _show(res, stats, shown_prompt: str, json_out: bool, printer) -> None:
    """The result: one JSON object, or the text (after the prompt) and a line of figures on stderr."""
    if json_out:
        print_json({"text": res.text, "token_ids": res.token_ids, "prompt_token_ids": res.prompt_token_ids,
                    "finish_reason": res.finish_reason, "stats": stats.to_dict()})  # fmt: skip
        return
    if printer:
        printer.finish(res.text)
    else:
        console.print(shown_prompt, end="", markup=False)
        console.print(res.text, markup=False)
    s = stats.to_dict()
    err_console.print(
        f"[dim]{len(res.prompt_token_ids)} prompt tokens, {len(res.token_ids)} generated ({res.finish_reason}) | "
        f"prefill {s['prefill_tokens_per_s']} tok/s | decode {s['decode_tokens_per_s']} tok/s, "
        f"{s['ms_per_step']} ms/step | {s['policy']} on {s['device']} ({s['dtype']})[/]"
    )


class _StreamPrinter:
    """Prints the new text of sequence 0 after each step, holding back half-decoded UTF-8 and what may become a
    stop string (it printed a stop string's first tokens, and a token's text past it, that the result then cut)."""

    def __init__(self, tok, stops: list[str]):
        from infinigen_rt.stream import TextStream

        self.tok, self.text = tok, TextStream(stops)

    def update(self, generated):
        if piece := self.text.update(self.tok.decode(generated[0])):
            sys.stdout.write(piece)
            sys.stdout.flush()

    def finish(self, final: str):
        sys.stdout.write(self.text.finish(final) + "\n")
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
