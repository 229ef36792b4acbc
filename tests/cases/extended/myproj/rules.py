def request_index(out, b):
    """Each token's step row: a 1 at the first token of every sequence after the first,
    summed (a context chunk's tokens, then each generation token; no numpy import, so that
    generating needs none)."""
    ends = b.seq_query_tokens.cumsum()
    n = int(ends[-1]) if len(ends) else 0
    out[:n] = 0
    out[ends[:-1]] += 1
    out[:n].cumsum(out=out[:n])
    return n
