"""What Triton's interpreter (``TRITON_INTERPRET=1``) lacks to run flash-linear-attention's kernels on
a CPU host, added in the process that runs them. Checked on Triton 3.8.0 (``CHECKED_ON``).

- Autotuning: ``Autotuner.run`` times every config through the active driver, and the interpreter has
  none ("0 active drivers"). Under the interpreter only the first config is kept: ``prune_configs``
  returns one, and ``run`` takes a single config without timing it. Every config computes the same
  function (block sizes change only the order of fp32 sums), and the interpreter's speed is no
  measure of a GPU's anyway.
- Loop variables: the interpreter rewrites every ``x = value`` of a kernel into
  ``x = interpreter_semantic.to_tensor(value, False)``, so names hold Triton tensors as they do when
  compiled. A ``for`` target is bound by Python's ``range`` and stays an ``int``, and FLA's kernels
  call tensor methods on it (``i_t.to(tl.int64)`` in ``fla/ops/common/chunk_delta_h.py``: "'int' object
  has no attribute 'to'"). Each loop body now starts with ``i = i``, which the same rewrite turns into
  the same wrapping.

``unsupported_reason()`` names what is missing on another Triton; ``install()`` applies both.
"""

from __future__ import annotations

import ast

CHECKED_ON = ("3.8.0",)


def unsupported_reason() -> str | None:
    """None when this Triton has what the two changes hook into, else one line naming what it lacks."""
    try:
        import triton
        from triton import knobs
        from triton.runtime import autotuner, interpreter
    except Exception as err:  # noqa: BLE001 - any import failure is the reason
        return f"triton does not import: {type(err).__name__}: {err}"
    where = f"triton {triton.__version__} (the changes were checked on {', '.join(CHECKED_ON)})"
    if not hasattr(getattr(knobs, "runtime", None), "interpret"):
        return f"{where} has no knobs.runtime.interpret to tell the interpreter from a compiled run"
    if not callable(getattr(getattr(autotuner, "Autotuner", None), "prune_configs", None)):
        return f"{where} has no Autotuner.prune_configs to keep one config under the interpreter"
    rewriter = getattr(interpreter, "FunctionRewriter", None)
    if not isinstance(getattr(rewriter, "ast_transformer", None), getattr(interpreter, "ASTTransformer", ())):
        return f"{where} has no interpreter FunctionRewriter.ast_transformer to wrap loop variables"
    if not hasattr(getattr(interpreter, "interpreter_semantic", None), "to_tensor"):
        return f"{where} has no interpreter_semantic.to_tensor (how the interpreter wraps assigned values)"
    return None


def install() -> None:
    """Apply both changes (idempotent); raises RuntimeError with ``unsupported_reason()``."""
    reason = unsupported_reason()
    if reason:
        raise RuntimeError(reason)
    from triton import knobs
    from triton.runtime import autotuner, interpreter

    prune = autotuner.Autotuner.prune_configs
    if not getattr(prune, "_first_config_under_interpreter", False):

        def prune_configs(self, kwargs):
            configs = prune(self, kwargs)
            return configs[:1] if knobs.runtime.interpret else configs

        prune_configs._first_config_under_interpreter = True
        autotuner.Autotuner.prune_configs = prune_configs

    if not getattr(interpreter.FunctionRewriter.ast_transformer, "_wraps_loop_variables", False):

        class LoopVariableTransformer(interpreter.ASTTransformer):
            _wraps_loop_variables = True

            def visit_For(self, node):
                if isinstance(node.target, ast.Name):
                    name = node.target.id
                    rebind = ast.Assign(
                        targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load())
                    )
                    node.body.insert(0, ast.copy_location(rebind, node))
                return self.generic_visit(node)  # the base's visit_Assign wraps the rebinding too

        interpreter.FunctionRewriter.ast_transformer = LoopVariableTransformer()
        interpreter.InterpretedFunction.rewritten_fn.clear()  # kernels rewritten before now lack it
