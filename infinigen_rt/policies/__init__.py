"""KV policies by name: how one engine treats KV. A policy is one KVPolicy subclass and its selector (base.py);
everything a caller needs (its options, what it reports, its memory needs, whether it speculates) is on the class,
so adding a policy adds a module and an entry here, and no model code or caller changes (the CLIs' help texts list
the names). A request runs a `Policy` value: the class with its options, checked against the engine once
(`configure`)."""

from __future__ import annotations

from infinigen_rt.errors import InfinigenError
from infinigen_rt.kv.cache import KVReport
from infinigen_rt.policies.base import KVPolicy, Policy
from infinigen_rt.policies.full import Full
from infinigen_rt.policies.h2o import H2O
from infinigen_rt.policies.infinigen import Infinigen
from infinigen_rt.policies.int4 import Int4
from infinigen_rt.policies.offload import Offload
from infinigen_rt.policies.options import KVOptions
from infinigen_rt.policies.oracle import Oracle, PerHeadOracle
from infinigen_rt.policies.quest import Quest

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls for cls in (Full, Offload, Infinigen, H2O, Int4, Oracle, PerHeadOracle, Quest)
}
# oracle, oracle-per-head: eval only, the true top-k at equal bytes (per KV head) and per query head (masks over
# dense attention); quest: eval only, a Quest-style page selector (the peer at equal bytes)
RUNTIME_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.runtime)
BASELINE = Full.name  # what eval and needle measure every other policy against


def policy_class(name: str) -> type[KVPolicy]:
    """The policy called `name` (a one-line error naming the others)."""
    if name not in POLICIES:
        raise InfinigenError(f"unknown policy {name!r}; available: {', '.join(POLICIES)}")
    return POLICIES[name]


def read_by(option: str) -> str:
    """'the infinigen policy', 'the infinigen and h2o policies': the runtime policies that read a KV option."""
    users = [n for n, cls in POLICIES.items() if cls.runtime and option in cls.knobs]
    return "the " + (users[0] + " policy" if len(users) == 1 else ", ".join(users[:-1]) + f" and {users[-1]} policies")


def configure(engine, name: str = BASELINE, opts: KVOptions | None = None) -> Policy:
    """The policy `name` with `opts` (default options if None), checked against `engine`: one-line errors."""
    return policy_class(name).configure(opts or KVOptions(), engine)


__all__ = [
    "BASELINE", "POLICIES", "RUNTIME_POLICIES", "KVOptions", "KVReport", "Policy", "configure", "policy_class",
    "read_by",
]  # fmt: skip
