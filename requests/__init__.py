"""bufc.requests: what the step knows of its requests, in plain numpy (no torch import).

``values`` holds the checks every request value goes through before it is written; ``sizes``
the step sizes (plain Python, read by the generator too). This package file imports nothing,
so importing one module loads only what that module needs.
"""
