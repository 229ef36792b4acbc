"""bufc.rules: the fill rules and request checks that generated step programs call.

Every rule and check is declared once, in ``rules/builtin.yaml`` (its name, the shape and dtypes
it writes, the Config values and step sizes it reads, its advance form and its implementation);
the generator validates tensors against those declarations and emits one explicit call per
tensor. Implementations are plain functions: `out` first, then the step's ``Batch``, then the
value of the check they rely on, then the Config values they read, by keyword.

This package file imports nothing, so importing one module loads only what that module needs.
The step's records (``Batch``, ``StepSizes``) are the request layer's (``bufc.requests``): the
rules import them, never the reverse.
"""
