"""bufc.examples: a real model driven by the generated buffers.

* ``paged_cache``: a block allocator and a paged K/V pool addressed by kv_cache_block_offsets;
* ``llama``: a packed-input Llama forward written against the engine contract (it reads only
  ``step.inputs`` and writes ``step.outputs["logits"]``), with Hugging Face weights;
* ``executor``: an in-flight batching loop (token budget, chunked prefill, mixed steps);
* ``demo``: ``bufc demo`` / ``make demo``, checked token for token against transformers.

transformers is needed here only (a test and example dependency, not a runtime one).
"""
