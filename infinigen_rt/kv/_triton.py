"""What the Triton kernels (_gather_kernel, _attention_kernel, _quant_kernel) share, imported by each before it
defines its kernels: two fixes to Triton's interpreter (TRITON_INTERPRET=1: fake CUDA, the tests), where it runs
the kernels otherwise than compiled."""

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
    interpreter_bf16_products()


def interpreter_bf16_products() -> None:
    """The interpreter holds bfloat16 values as their 16 bits (uint16): its `tl.dot` multiplies those bits as
    integers, and its cast of an integer to bfloat16 takes the integer for the bits; compiled, both are of the
    values. Here a dot widens bfloat16 operands to float32 first (exact), as it widens 8-bit floats to float16, and
    an integer reaches bfloat16 through float32 (exact for the codes cast, small integers)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_infinigen_bf16", False):
        return
    dot = builder.create_dot
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == interpreter.tl.bfloat16 and src.dtype.scalar.is_int():
            wide = interpreter.TensorHandle(src.data.astype(interpreter.np.float32), interpreter.tl.float32)
            return cast(self, wide, dst_type)
        return cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        wide = []
        for x in (a, b):
            if x.dtype.scalar == interpreter.tl.bfloat16:
                data = interpreter._convert_float(x.data, interpreter.tl.bfloat16, interpreter.tl.float32, None)
                x = interpreter.TensorHandle(data.view(interpreter.np.float32), interpreter.tl.float32)
            wide.append(x)
        return dot(self, *wide, d, input_precision, max_num_imprecise_acc)

    builder.create_dot, builder.cast_impl, builder._infinigen_bf16 = create_dot, cast_impl, True
