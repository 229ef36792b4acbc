"""bufc.codegen: the buffer compiler.

The pipeline, one module per stage::

    buffers.yaml --load--> Document (data + line:col of every value)      load.py
                 --schema--> structural errors, located                    schema.py
                 --model--> frozen Spec, formulas parsed into IR           model.py, expr.py
                 --validate--> semantic errors, located                    validate.py, prove.py
                 --plan--> per family: flags folded, residual conditions   plan.py
                 --emit--> Python source per family (jinja2)               emit.py
                 --files--> generated/ written, or checked for staleness   files.py

Every stage collects all of its errors before raising ``SpecError``; the CLI (cli.py) prints
them sorted as ``FILE:LINE:COL: message`` and exits non-zero, never with a traceback.
"""

from __future__ import annotations

from .errors import Diagnostic, Location, SpecError
from .pipeline import compile_file, compile_text

__all__ = ["Diagnostic", "Location", "SpecError", "compile_file", "compile_text"]
