"""The layers' fused kernels (models/fused.py): each equals the torch chain it replaces (TRITON_INTERPRET=1 on CPU
tensors, set by conftest), a Llama decode step on the GPU path issues them, and they compile for sm_80 and sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infinigen_rt.kv.kernels import available
from infinigen_rt.models import fused
from infinigen_rt.models.llama import apply_rope
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (pip install triton)")


def norm_chain(x, w, eps):
    return w * F.rms_norm(x.float(), w.shape, eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_kernel_gives_the_torch_chains_values(dtype):
    """RoPE and the residual add bit for bit in float32 and float16 (the interpreter's own bfloat16 rounding is not
    the GPU's: not compared here), the norm within an ulp (its sum of squares in another order) at a width that is not
    a power of two, SwiGLU within a few (exp and a division of its own)."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 2, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    ulp = 2 * torch.finfo(dtype).eps  # (the norm rounds twice: normalised, then weighted)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), norm_chain(x, w, 1e-5), rtol=ulp, atol=0)
    out, added = fused.add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(added, x + y)
    torch.testing.assert_close(out, norm_chain(x + y, w, 1e-6), rtol=ulp, atol=0)
    heads = torch.randn(3, 7, 1, 24, generator=g).to(dtype)  # q's 4 and k's 1 heads rotated, v's 2 not
    cos, sin = (torch.randn(3, 1, 1, 24, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(fused.rope(heads, cos, sin, 5), apply_rope(heads[:, :5], cos, sin))
    gate_up = torch.randn(3, 1, 2 * 1500, generator=g).to(dtype)  # two column blocks of 1,024, the second partial
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, rtol=2 * ulp, atol=0)


def test_wrong_arguments_are_refused_before_a_launch():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="rms_norm"):
        fused.rms_norm(x, torch.randn(8, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="rope"):
        fused.rope(torch.randn(2, 4, 3, 8), torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), 2)  # 3 tokens
    with pytest.raises(RuntimeError, match="silu_mul"):
        fused.silu_mul(torch.randn(2, 7))


def test_a_llama_decode_step_on_the_gpu_path_issues_the_fused_kernels():
    """A decode step of `full` under fake CUDA (float32, the kernels computing through the interpreter): per layer
    the norm, the residual add with the next norm, RoPE over q and k and SwiGLU each one launch (and the final norm),
    no product, roll or silu left in the layers; its logits the CPU's."""
    from infinigen_rt.measure.fakecuda import FakeCuda
    from infinigen_rt.measure.fakecuda import available as fake_available
    from infinigen_rt.measure.synthetic import PRESETS, synthetic_engine
    from infinigen_rt.policies import KVOptions, configure
    from tests.rt.stored import Stored

    if fake_available():
        pytest.skip(f"fake CUDA: {fake_available()}")
    PRESETS["tiny-fused"] = dict(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
    )  # fmt: skip
    prompts = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        engine = synthetic_engine("tiny-fused", torch.device("cpu"), torch.float32)
        want, _ = Stored(engine, configure(engine, "full", KVOptions()), prompts, 3).greedy(2)
        with FakeCuda() as gpu:
            engine = synthetic_engine("tiny-fused", torch.device("cuda"), torch.float32)
            run = Stored(engine, configure(engine, "full", KVOptions()), prompts, 3)
            got, toks = run.greedy(2)
            got = got.cpu()
            with gpu.recording() as ops:
                run.step(toks[:, -1])
            run.close()
            del engine, run
    finally:
        del PRESETS["tiny-fused"]
    layers = 3
    names = [o.name for o in ops if o.launch and o.site == "model"]
    assert names.count("rms_norm_kernel") == 2 * layers + 1  # each layer's two, the final one
    assert names.count("rope_kernel") == names.count("silu_mul_kernel") == layers
    assert not {"roll", "silu", "rms_norm"} & set(names) and names.count("mul") == 1, names  # (the angles' one)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # (the norm's sum of squares in another order)


COMPILE = """
import json, sys, torch
from infinigen_rt.models._fused_kernel import rms_norm_kernel, rope_kernel, silu_mul_kernel
from tests.rt.test_kernels_aot import compiled

cc, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
x = torch.empty(4, 4096, dtype=dtype)
w = torch.empty(4096, dtype=dtype)
heads = torch.empty(4, 48, 1, 128, dtype=dtype)
cs = torch.empty(4, 1, 1, 128, dtype=dtype)
gu = torch.empty(4, 2 * 14336, dtype=dtype)
launches = [
    (rms_norm_kernel, (x, x, w, x, x, 1e-5), dict(D=4096, BLOCK=4096, ADD=True)),
    (rms_norm_kernel, (x, x, w, x, x, 1e-5), dict(D=4096, BLOCK=4096, ADD=False)),
    (rope_kernel, (heads, cs, cs, heads), dict(H_IN=48, H_OUT=40, D=128, BLOCK=128)),
    (silu_mul_kernel, (gu, gu), dict(N=14336, BLOCK=1024)),
]
print(json.dumps(compiled(launches, cc)))
"""


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_kernels_compile_for_sm80_and_sm90(cc, dtype):
    """Llama-3.1-8B's widths (hidden 4,096, 32 + 8 heads of 128 rotated of 48, 14,336 SwiGLU columns), compiled to
    cubin in a process of its own (no interpreter), with no local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", COMPILE, str(cc), dtype], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"local": False, "kernels": 4}
