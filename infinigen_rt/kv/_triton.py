"""What the Triton kernels (_gather_kernel, _attention_kernel, _quant_kernel) share, imported by each before it
defines its kernels."""

from __future__ import annotations


def interpreter_loop_bounds() -> None:
    """Under Triton's interpreter (TRITON_INTERPRET=1: fake CUDA, the tests), a loop bound computed in a kernel from
    a runtime count (`range(0, hi - lo, TOKENS)`: a split's own tokens) is a one-element array, which the
    interpreter's int() of it refuses under numpy 2; compiled, the same bound is a plain scalar. Taken as its one
    element here, so the interpreter runs a split's live tiles only, as the GPU does."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_infinigen_bounds", False):
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor, interpreter._infinigen_bounds = patched, True
