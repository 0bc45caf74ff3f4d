"""What every KV policy is: a class of facts and rules (`KVPolicy`: its name, the options it reads, what eval sweeps,
its memory needs, how many slots a request reserves) and the selector the batch's KV store runs it as
(kv/store.py's `Selector`: which layers stay on the device, which rows a step reads). A request runs a `Policy`
value: the class with its options, checked against the engine once (`KVPolicy.configure`)."""

from __future__ import annotations

from dataclasses import dataclass, replace


class KVPolicy:
    """One policy. Nothing here holds KV: the store does, as the policy's selector says."""

    name = ""
    knobs: frozenset[str] = frozenset()  # the KVOptions fields it reads (a server request may override these)
    runtime = True  # False: an evaluation device only (not for generate, serve or bench)
    speculative = False  # needs the bundle's InfiniGen tensors
    sweep: tuple[str, ...] = ()  # what `eval` sweeps: ("budget",) or ("budget", "alpha")
    scores = False  # its attention builds the score matrix itself (else SDPA's fused kernels never do)
    dense_prefill = True  # a prompt attends over its exact KV (so one prefill may serve several policies)

    @classmethod
    def configure(cls, opts, engine) -> Policy:
        """This policy with `opts` (KVOptions), checked against `engine` once: the value a request runs with."""
        opts.check()
        return Policy(cls, opts)

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """The policy as the KV store runs it (store.Selector). `prefetch` (prefetch.Lane): the runner's side stream
        or worker thread, shared by its requests."""
        raise NotImplementedError

    @classmethod
    def pool_slots(cls, opts, prompt: int, new: int, chunk: int) -> int:
        """The most token slots a request of `prompt` + `new` tokens, prefilled in chunks of at most `chunk`, ever
        holds per (sequence, KV head) in a paged pool: its reservation. Every token, unless eviction frees slots
        for reuse (the host-pool policies with a capacity)."""
        return prompt + new

    @classmethod
    def kv_bytes(cls, engine, opts, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        """For `tokens` (sequence, KV head, slot) triples per layer: (device bytes held, host bytes held, device
        bytes read by a decode step) of KV and its bookkeeping (bench's memory model and floor)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Policy:
    """A KV policy as a request runs it: the policy class and its options, checked and resolved against the engine
    once (`KVPolicy.configure`)."""

    cls: type[KVPolicy]
    opts: object  # KVOptions, with the engine's defaults resolved

    @property
    def name(self) -> str:
        return self.cls.name

    def selector(self, engine, prefetch=None):
        return self.cls.selector(engine, self.opts, prefetch)

    def pool_slots(self, prompt: int, new: int, chunk: int) -> int:
        return self.cls.pool_slots(self.opts, prompt, new, chunk)

    def kv_bytes(self, engine, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        return self.cls.kv_bytes(engine, self.opts, tokens, dtype_bytes)

    def with_options(self, engine, **changes) -> Policy:
        """The same policy with some options changed (a server request's overrides), configured again."""
        return self.cls.configure(replace(self.opts, **changes), engine)


def kv_layers(cfg) -> list[int]:
    """The layers whose KV a policy holds: every layer but the sliding-window ones, whose rings the store keeps on the
    device whatever the policy (window.Rings). No policy needs to know about them."""
    return cfg.global_layers
