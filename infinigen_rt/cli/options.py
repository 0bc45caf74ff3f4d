"""Option types the commands share (one declaration each, as huggingface_hub's CLI keeps them), and `kv_options`:
the KV policy's options, declared once for every command that runs a policy."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Optional

import typer
from rich.markup import escape

from infinigen_rt.policies.options import DEFAULTS, OPTS, TYPES, KVOptions

BundleArg = Annotated[str, typer.Argument(help="Bundle folder, or a Hub repo id to pull.")]
Revision = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) for a repo id.")]
Verify = Annotated[bool, typer.Option(help="Check every bundle file's sha256 before loading.")]
Device = Annotated[str, typer.Option(help="auto (cuda when present), cpu, cuda, cuda:N.")]
Dtype = Annotated[str, typer.Option(help="auto (bundle dtype on GPU, float32 on CPU), float32, float16, bfloat16.")]
TPSize = Annotated[
    int, typer.Option("--tp", help="Tensor-parallel ranks: starts this many processes (torchrun) on this machine.")
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Graphs = Annotated[bool, typer.Option(
    "--graphs", help="On a GPU, replay decode steps from CUDA graphs where the policy allows it (full, infinigen).")]
PolicyName = Annotated[str, typer.Option("--policy", help="KV policy: full, offload, infinigen, h2o, int4.")]


def kv_option(name: str, *flags: str, help: str | None = None):
    """The typer.Option of the KV option `name`: its declared flag and help (policies/options.py), or a command's
    own `help` for it; the brackets of a help text are text, not rich markup ("[none: the budget alone]")."""
    flags = flags or ((OPTS[name].flag,) if OPTS[name].flag else ())
    return typer.Option(*flags, help=escape(help or OPTS[name].help))


def _optional(hint):
    """Optional[float] for `float | None`, as the commands' own options spell it."""
    args = typing.get_args(hint)
    return Optional[args[0]] if type(None) in args else hint


# the KV options of a command that runs one policy: (name, annotation, default), in KVOptions' terms, as
# policies/options.py declares them (those marked cli)
KV_PARAMS = tuple((name, Annotated[_optional(TYPES[name]), kv_option(name)], DEFAULTS[name])
                  for name, o in OPTS.items() if o.cli)  # fmt: skip


def kv_options(command):
    """The command gets the KV policy's options (KV_PARAMS) as options of its own, after the ones it declares; they
    reach it as one KVOptions, its `kv` parameter, checked (a one-line error before anything loads)."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "kv"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
             for name, hint, default in KV_PARAMS]  # fmt: skip

    @functools.wraps(command)
    def run(kv_ctx: typer.Context, **given):
        kv = KVOptions(**{name: given.pop(name) for name, _, _ in KV_PARAMS})
        kv.check()
        check_read(given.get("policy"), typed_kv_options(kv_ctx))
        return command(kv=kv, **given)

    ctx = inspect.Parameter("kv_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    run.__signature__ = inspect.Signature([p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added + [ctx])
    run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}
    return run


def typed_kv_options(ctx: typer.Context) -> list[str]:
    """The KV options (KVOptions' names) given on this command line, not left at their defaults."""
    sources = {name: ctx.get_parameter_source(name) for name, _, _ in KV_PARAMS}
    return [name for name, src in sources.items() if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT")]


def check_read(policy: str | None, names: list[str]) -> None:
    """Refuse a KV option that `policy` does not read (`--policy full --budget 0.1` would run full at every token,
    silently), as the server refuses such an override; a one-line error naming the policies that read it."""
    from infinigen_rt.errors import InfinigenError
    from infinigen_rt.policies import POLICIES, read_by

    if policy not in POLICIES:
        return  # an unknown name: the command's own error says which exist
    for name in names:
        if name not in POLICIES[policy].knobs:
            flag = "--" + name.replace("_", "-")
            raise InfinigenError(f"{flag} applies to {read_by(name)}, not {policy}: drop it or change --policy")


def floats(text: str | None, name: str) -> list[float]:
    """A comma-separated list of numbers ([] for none), or a one-line error naming the option."""
    if not text:
        return []
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} takes numbers separated by commas, got {text!r}") from None
