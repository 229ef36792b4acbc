"""A lean hand-written llama step for requests in flight: the "lean" column of bench/churn.py.

What a careful engineer would write by hand for this one family (one beam, no draft tokens, a
paged KV cache, TensorRT-LLM's engine inputs) behind the same three calls as bufc's in-flight
API: ``add(request)``, ``finish(slot)`` and ``step(tokens, chunks=..., blocks=...)``, with
``tokens`` the sampled tokens indexed by seq slot and ``blocks`` the KV block ids appended per
slot. It writes the tensors bufc's llama module writes at one beam, with the same values:

- per-slot numpy state: prompt (as an array), prompt length, prompt tokens computed, tokens in
  the sequence, last token, KV blocks held and the tokens they hold, and the block table rows
  [slots, K/V, max_blocks_per_seq], already encoded (TensorRT-LLM's KVCacheIndex for a pool
  laid out [blocks, layers, K/V, ...]: block_id * 2 * num_local_layers, + 1 for V);
- rows in bufc's condensed order: context requests first (arrival order), then the generation
  rows; a finished request's row is filled by the last row (requests/table.py ``finish``) and
  the prompts finished in the last step join at the end;
- ONE arena: a pinned host buffer (on CUDA) holding every tensor at a fixed offset, the
  device-mirrored ones first (the KV rows last), and one host-to-device copy per step of its
  used prefix (``non_blocking`` on CUDA; on the CPU a plain memcpy into the device-side
  tensor). With one arena, the host waits for the last step's copy to leave it before writing
  (a CUDA event), so it runs at most one step ahead of the copy;
- a step whose layout (context requests and tokens) is the last step's continues the arena in
  place: +1 on the generation rows' positions, sequence and past-KV lengths, the sampled tokens
  gathered into the input ids, and only the rows that changed patched (a row refilled by
  finish, the promoted prompts, the KV columns of appended blocks); a step whose layout changed
  rebuilds the generation rows from the per-slot state (a handful of vectorised gathers);
- the checks a step needs, vectorised and before anything is written: tokens in the
  vocabulary, appended block ids in the pool and within max_blocks_per_seq, every sequence's
  blocks covering its tokens after the step, the token budget (block appends to up to FEW
  slots, the common case, are checked and written one by one: cheaper than numpy's calls);
- no array allocated per step for the rows that merely decode (their gathers and checks run
  in preallocated scratch); what a step allocates grows with what changed (the rows patched,
  the block ids appended, an arriving prompt's array).

What it leaves out, against bufc: beams, drafts, explicit positions, the other families, the
stateless prepare_step, tokens gathered on the device, padding rows past the step (for CUDA-
graph buckets), double buffering, and error messages that name the culprit's field.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

INT32_MAX = 2**31 - 1
ALIGN = 64  # int32 elements: every arena member starts on a 256-byte boundary
FULL = 2**62  # the tokens a full attention window of blocks holds (any length)
FEW = 8  # block appends to this many slots are checked and written one by one

# engine name of each device mirror -> its host tensor (bufc's names)
MIRRORED = {
    "seq_slots": "host_seq_slots",
    "row_slots": "host_row_slots",
    "context_lengths": "host_context_lengths",
    "sequence_length": "host_sequence_lengths",
    "last_token_ids": "host_last_token_ids",
    "input_ids": "host_input_ids",
    "position_ids": "host_position_ids",
    "kv_cache_block_offsets": "host_kv_cache_block_offsets",
}


class LeanError(ValueError):
    """A request or step the lean implementation refuses (nothing changed)."""


class LeanLlama:
    """The llama step for requests in flight, hand-written (see the module docstring)."""

    def __init__(self, config: Any, device: str | torch.device = "cpu") -> None:
        c = config
        if c.max_beam_width != 1 or c.max_draft_tokens or c.pp_size != 1:
            raise LeanError("the lean llama step runs one beam, no drafts, one pipeline rank")
        self.config = c
        self.device = torch.device(device)
        S, N, W, L = c.max_batch_size, c.max_num_tokens, c.max_blocks_per_seq, c.num_local_layers
        self.S, self.N, self.W, self.tpb = S, N, W, c.tokens_per_block
        self.vocab = c.vocab_size
        self.kv_mul = 2 * L
        encodable = (INT32_MAX - 1) // (2 * L) + 1
        nkv = c.num_kv_blocks
        self.id_limit = nkv if nkv and nkv <= encodable else encodable

        # ---- per-slot state
        self.live = np.zeros(S, bool)
        self.prompts: list[np.ndarray | None] = [None] * S
        self.prompt_len = np.zeros(S, np.int64)
        self.position = np.zeros(S, np.int64)  # context phase: prompt tokens computed
        self.seq_len = np.zeros(S, np.int64)  # tokens of the sequence as of its last step
        self.last = np.zeros(S, np.int64)  # its last token
        self.n_blocks = np.zeros(S, np.int64)
        self.cap = np.zeros(S, np.int64)  # tokens its blocks hold (FULL: the whole window)
        self.table = np.zeros((S, 2, W), np.int32)  # encoded block rows
        self.table_flat = self.table.reshape(-1)
        # ---- rows: generation rows rows[:n_rows] (condensed), context phase in arrival order
        self.rows = np.zeros(S, np.int64)
        self.n_rows = 0
        self.row_of = np.full(S, -1, np.int64)
        self.waiting: dict[int, None] = {}
        self.completing: list[int] = []  # prompts the last step finished: rows from this step
        self.dirty: set[int] = set()  # rows finish() refilled since the last step
        self.layout: tuple[int, int] | None = None  # (context requests, tokens) of the arena
        self.sizes = (0, 0, 0)  # the last step's context requests, context tokens, gen rows
        # ---- scratch (no allocation on the decode path)
        self.s_tok = np.zeros(S, np.int64)
        self.s_len = np.zeros(S, np.int64)
        self.s_cap = np.zeros(S, np.int64)
        self.s_rowcap = np.zeros(S, np.int64)
        self.s_bool = np.zeros(S, bool)
        self.iota = np.arange(max(N, S) + 1, dtype=np.int32)

        # ---- the arena: mirrored members first (smallest first, the KV rows last, so the
        # copy is a prefix), then the host-only ones
        members = (
            ("seq_slots", S),
            ("context_lengths", S),
            ("sequence_length", S),
            ("last_token_ids", S),
            ("input_ids", N),
            ("position_ids", N),
            ("kv", S * 2 * W),
            ("request_types", S),
            ("past_kv", S),
            ("windows", L),
            ("sink", 1),
        )
        self.offset: dict[str, int] = {}
        end = 0
        for name, n in members:
            self.offset[name] = end
            end += -(-n // ALIGN) * ALIGN
            if name == "kv":
                self.copy_end = end  # the mirrored members end here
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(end, dtype=torch.int32, pin_memory=cuda)
        self.dev = torch.zeros(self.copy_end, dtype=torch.int32, device=self.device)
        self.host_np = self.host.numpy()
        self.dev_np = self.dev.numpy() if not cuda else None
        self.done = torch.cuda.Event() if cuda else None  # the last copy has left the arena
        a = self.host_np

        def region(name: str, n: int) -> np.ndarray:
            return a[self.offset[name] : self.offset[name] + n]

        self.a_slots = region("seq_slots", S)
        self.a_ctxlen = region("context_lengths", S)
        self.a_seq = region("sequence_length", S)
        self.a_lti = region("last_token_ids", S)
        self.a_ids = region("input_ids", N)
        self.a_pos = region("position_ids", N)
        self.a_kv = region("kv", S * 2 * W).reshape(S, 2, W)
        self.a_kv_flat = region("kv", S * 2 * W)
        self.a_types = region("request_types", S)
        self.a_past = region("past_kv", S)
        region("windows", L)[:] = c.max_attention_window  # constants: written once
        region("sink", 1)[:] = c.sink_token_length
        self.kv_off = self.offset["kv"]

    # ----------------------------------------------------------------- arrivals, finishes
    def add(self, request: Any) -> None:
        """A request arrives in its seq_slot, in the context phase: checked once, its prompt
        kept as an array and its block list encoded into the slot's table row."""
        slot = request.seq_slot
        if type(slot) is not int or not 0 <= slot < self.S:
            raise LeanError(f"add(): seq_slot {slot!r} is not a slot")
        if self.live[slot]:
            raise LeanError(f"add(): seq_slot {slot} holds a request")
        if (
            request.beam_width != 1
            or len(request.draft_tokens or ())
            or request.position_ids is not None
            or any(map(len, request.generated or ()))
            or request.context_chunk_size is not None
        ):
            raise LeanError(f"add(): seq_slot {slot}: one beam, a fresh prompt, no drafts")
        prompt = np.asarray(request.prompt)
        if prompt.ndim != 1 or not len(prompt) or prompt.dtype.kind not in "iu":
            raise LeanError(f"add(): seq_slot {slot}: the prompt must be token ids")
        prompt = prompt.astype(np.int64, copy=False)
        if int(prompt.view(np.uint64).max()) >= self.vocab:
            raise LeanError(f"add(): seq_slot {slot}: a prompt token is outside the vocabulary")
        begin = request.context_position
        if type(begin) is not int or not 0 <= begin < len(prompt):
            raise LeanError(f"add(): seq_slot {slot}: context_position {begin!r}")
        lists = request.kv_block_ids
        if lists is None or len(lists) != 1:
            raise LeanError(f"add(): seq_slot {slot}: one KV block list")
        ids = np.asarray(lists[0])
        k = len(ids)
        if ids.ndim != 1 or k > self.W or (k and ids.dtype.kind not in "iu"):
            raise LeanError(f"add(): seq_slot {slot}: at most {self.W} integer block ids")
        ids = ids.astype(np.int64, copy=False)
        if k and int(ids.view(np.uint64).max()) >= self.id_limit:
            raise LeanError(f"add(): seq_slot {slot}: a block id is outside the pool")
        row = self.table[slot]
        row[:, k:] = 0
        np.multiply(ids, self.kv_mul, out=row[0, :k], casting="unsafe")
        np.add(row[0, :k], 1, out=row[1, :k])
        self.n_blocks[slot] = k
        self.cap[slot] = k * self.tpb if k < self.W else FULL
        self.prompts[slot] = prompt
        self.prompt_len[slot] = len(prompt)
        self.position[slot] = begin
        self.seq_len[slot] = 0
        self.live[slot] = True
        self.waiting[slot] = None

    def finish(self, slot: Any) -> None:
        """The request in `slot` leaves: the last generation row fills its row."""
        if type(slot) is not int or not 0 <= slot < self.S or not self.live[slot]:
            raise LeanError(f"finish(): seq_slot {slot!r} holds no request")
        row = int(self.row_of[slot])
        if row >= 0:  # condense (requests/table.py finish)
            last = self.n_rows - 1
            moved = int(self.rows[last])
            self.rows[row] = moved
            self.row_of[moved] = row
            self.n_rows = last
            self.row_of[slot] = -1
            self.dirty.add(row)
        self.waiting.pop(slot, None)
        if slot in self.completing:
            self.completing.remove(slot)
        self.live[slot] = False
        self.prompts[slot] = None

    # ------------------------------------------------------------------------ the step
    def step(
        self,
        tokens: Any = None,
        *,
        chunks: dict[int, int] | None = None,
        blocks: dict[int, Any] | None = None,
    ) -> None:
        """The next step: every check first, then the arena, then its one copy."""
        W = self.W
        # ---- this step's generation rows: the rows in flight, then last step's prompts
        n_old = self.n_rows
        promoted = self.completing
        n_gen = n_old + len(promoted)
        rows = self.rows[:n_gen]
        if promoted:  # past n_rows: scratch until the step commits
            rows[n_old:] = promoted
        # ---- checks: nothing is changed until they all pass
        tok = None
        if n_gen:  # every row produced a token in the last step
            tok = self._tokens(tokens, rows)
        elif tokens is not None and len(tokens):
            raise LeanError("step(): no request produced a token in the last step")
        cap = self.cap
        appended = None
        if blocks:
            appended = self._check_blocks(blocks)
            cap = self.s_cap
        ctx = self._context(chunks)
        n_ctx = len(ctx)
        ctx_tok = sum(k for _, _, k in ctx)
        if ctx_tok + n_gen > self.N:
            raise LeanError(f"step(): {ctx_tok + n_gen} tokens exceed max_num_tokens={self.N}")
        for slot, begin, k in ctx:
            if cap[slot] < begin + k:
                raise LeanError(f"step(): seq_slot {slot}: its KV blocks do not cover its tokens")
        if n_gen:
            seq = np.take(self.seq_len, rows, out=self.s_len[:n_gen])
            seq += 1
            row_cap = np.take(cap, rows, out=self.s_rowcap[:n_gen])
            short = np.greater(seq, row_cap, out=self.s_bool[:n_gen])
            if short.any():
                slot = int(rows[np.flatnonzero(short)[0]])
                raise LeanError(f"step(): seq_slot {slot}: its KV blocks do not cover its tokens")
        # ---- commit: the state, then the arena
        if self.done is not None:
            self.done.synchronize()  # the last copy has left the arena
        in_place = self.layout == (n_ctx, ctx_tok)
        if n_gen:
            np.put(self.seq_len, rows, seq)
            np.put(self.last, rows, tok)
            for i, slot in enumerate(promoted, n_old):
                self.row_of[slot] = i
            self.n_rows = n_gen
        if appended is not None:
            self._append(appended, n_ctx if in_place else -1)
        if in_place:
            if n_old:  # the kept rows: one token longer
                g = slice(n_ctx, n_ctx + n_old)
                self.a_seq[g] += 1
                self.a_past[g] += 1
                self.a_pos[ctx_tok : ctx_tok + n_old] += 1
            fix = [r for r in self.dirty if r < n_old]
            if fix or n_gen > n_old:
                at = np.array(fix + list(range(n_old, n_gen)), np.int64)
                self._write_rows(at, n_ctx, ctx_tok)
        elif n_gen:
            self._rebuild(rows, seq, n_ctx, ctx_tok)
        if n_gen:
            self.a_ids[ctx_tok : ctx_tok + n_gen] = tok
        self.dirty.clear()
        completing = []
        if n_ctx:
            o = 0
            for i, (slot, begin, k) in enumerate(ctx):
                self.a_ids[o : o + k] = self.prompts[slot][begin : begin + k]  # type: ignore[index]
                np.add(self.iota[:k], begin, out=self.a_pos[o : o + k])
                o += k
                self.a_lti[i] = o
                end = begin + k
                self.position[slot] = end
                if end == self.prompt_len[slot]:
                    completing.append(slot)
                    self.seq_len[slot] = end
                    del self.waiting[slot]
            slots = [s for s, _, _ in ctx]
            ends = [b + k for _, b, k in ctx]
            self.a_slots[:n_ctx] = slots
            self.a_ctxlen[:n_ctx] = [k for _, _, k in ctx]
            self.a_seq[:n_ctx] = ends
            self.a_past[:n_ctx] = ends
            self.a_types[:n_ctx] = 0
            for i, slot in enumerate(slots):
                self.a_kv[i] = self.table[slot]
        self.completing = completing
        self.layout = (n_ctx, ctx_tok)
        self.sizes = (n_ctx, ctx_tok, n_gen)
        # ---- the one copy: the mirrored members, of the KV rows the step's
        used = self.kv_off + (n_ctx + n_gen) * 2 * W
        if self.dev_np is not None:
            self.dev_np[:used] = self.host_np[:used]
        else:
            self.dev[:used].copy_(self.host[:used], non_blocking=True)
            assert self.done is not None
            self.done.record()

    # ------------------------------------------------------------------------ helpers
    def _tokens(self, tokens: Any, rows: np.ndarray) -> np.ndarray:
        """The sampled tokens of `rows` (gathered into scratch), checked in the vocabulary."""
        if tokens is None:
            raise LeanError("step(): the last step produced tokens; pass them")
        if type(tokens) is not np.ndarray or tokens.dtype != np.int64 or tokens.ndim != 1:
            if isinstance(tokens, torch.Tensor):
                tokens = tokens.detach().cpu().numpy()
            tokens = np.asarray(tokens)
            if tokens.dtype.kind not in "iu":
                raise LeanError("step(): tokens must be integers")
            tokens = tokens.astype(np.int64, copy=False).reshape(len(tokens))
        if len(tokens) < self.S:
            raise LeanError(f"step(): tokens must be indexed by seq slot ({self.S} of them)")
        tok = np.take(tokens, rows, out=self.s_tok[: len(rows)])
        if int(tok.view(np.uint64).max()) >= self.vocab:
            bad = int(np.flatnonzero(tok.view(np.uint64) >= self.vocab)[0])
            raise LeanError(
                f"step(): token {tok[bad]} of seq_slot {rows[bad]} is outside 0 .. {self.vocab - 1}"
            )
        return tok

    def _check_blocks(self, blocks: dict[int, Any]) -> tuple:
        """The appended block ids, checked (slots in flight, ids in the pool, within the
        window); s_cap is then the tokens each slot's blocks hold after the step. A few slots
        (the common case: a step's sequences that enter a new block) are checked one by one
        in Python, more in a constant number of numpy calls."""
        S, W, tpb, limit = self.S, self.W, self.tpb, self.id_limit
        self.s_cap[:] = self.cap
        if len(blocks) <= FEW:
            few = []
            for slot, new in blocks.items():
                if type(slot) is not int or not 0 <= slot < S or not self.live[slot]:
                    raise LeanError(f"step(): blocks[{slot!r}]: that seq slot holds no request")
                new = new if type(new) is list else list(new)
                before = int(self.n_blocks[slot])
                after = before + len(new)
                if after > W:
                    raise LeanError(f"step(): blocks[{slot}] exceed max_blocks_per_seq={W}")
                for x in new:
                    if type(x) is not int or not 0 <= x < limit:
                        raise LeanError(f"step(): blocks[{slot}]: block id {x!r} outside the pool")
                self.s_cap[slot] = after * tpb if after < W else FULL
                few.append((slot, before, new))
            return few, None
        m = len(blocks)
        try:
            slots = np.fromiter(blocks, np.int64, m)
            lists = list(blocks.values())
            counts = np.fromiter(map(len, lists), np.int64, m)
            ids = np.array(list(chain.from_iterable(lists)))
        except (TypeError, ValueError, OverflowError):
            raise LeanError("step(): blocks must map seq slots to lists of block ids") from None
        if int(slots.view(np.uint64).max()) >= S or not self.live[slots].all():
            raise LeanError("step(): blocks for a seq slot that holds no request")
        if ids.size and (ids.dtype.kind not in "iu" or ids.ndim != 1):
            raise LeanError("step(): block ids must be integers")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and int(ids.view(np.uint64).max()) >= limit:
            raise LeanError(f"step(): a block id is outside 0 .. {limit - 1}")
        after = self.n_blocks[slots] + counts
        if int(after.max()) > W:
            raise LeanError(f"step(): a block list exceeds max_blocks_per_seq={W}")
        self.s_cap[slots] = np.where(after < W, after * tpb, FULL)
        return None, (slots, counts, ids, after)

    def _append(self, appended: tuple, n_ctx: int) -> None:
        """The checked block ids into the slots' table rows and, where the arena's rows stay
        (n_ctx >= 0), into the arena rows of the generation rows that keep their place (a
        slot in its context phase, or promoted in this step, gets its row written whole)."""
        few, many = appended
        W, mul = self.W, self.kv_mul
        if few is not None:
            for slot, before, new in few:
                end = before + len(new)
                enc = [x * mul for x in new]
                venc = [x + 1 for x in enc]
                row = self.table[slot]
                row[0, before:end] = enc
                row[1, before:end] = venc
                self.n_blocks[slot] = end
                self.cap[slot] = self.s_cap[slot]
                r = int(self.row_of[slot])
                if n_ctx >= 0 and r >= 0:
                    row = self.a_kv[n_ctx + r]
                    row[0, before:end] = enc
                    row[1, before:end] = venc
            return
        slots, counts, ids, after = many
        before = after - counts
        if len(ids) == len(slots):  # one block each: no repeat
            within: Any = 0
            at = slots * (2 * W) + before
        else:
            within = self.iota[: len(ids)] - np.repeat(np.cumsum(counts) - counts, counts)
            at = np.repeat(slots * (2 * W) + before, counts) + within
        enc = ids * mul
        self.table_flat[at] = enc
        self.table_flat[at + W] = enc + 1
        self.n_blocks[slots] = after
        self.cap[slots] = self.s_cap[slots]
        if n_ctx < 0:
            return
        rows = self.row_of[slots]  # -1: no row yet
        base = (n_ctx + rows) * (2 * W) + before
        if len(ids) == len(slots):
            at, keep = base, rows >= 0
        else:
            at, keep = np.repeat(base, counts) + within, np.repeat(rows >= 0, counts)
        if not keep.all():
            at, enc = at[keep], enc[keep]
        self.a_kv_flat[at] = enc
        self.a_kv_flat[at + W] = enc + 1

    def _context(self, chunks: dict[int, int] | None) -> list[tuple[int, int, int]]:
        """This step's context requests (slot, begin, chunk), in arrival order."""
        if chunks is None:
            return [
                (s, int(self.position[s]), int(self.prompt_len[s] - self.position[s]))
                for s in self.waiting
            ]
        for s in chunks:
            if s not in self.waiting:
                raise LeanError(f"step(): chunks[{s!r}]: no request in its context phase")
        out = []
        for s in self.waiting:
            if s in chunks:
                k, begin = chunks[s], int(self.position[s])
                if type(k) is not int or not 1 <= k <= self.prompt_len[s] - begin:
                    raise LeanError(f"step(): chunks[{s}] = {k!r}")
                out.append((s, begin, k))
        return out

    def _write_rows(self, at: np.ndarray, n_ctx: int, ctx_tok: int) -> None:
        """The generation rows `at` (refilled or new) written whole from the per-slot state."""
        s = self.rows[at]
        i = at + n_ctx
        length = self.seq_len[s]
        self.a_slots[i] = s
        self.a_ctxlen[i] = self.prompt_len[s]
        self.a_seq[i] = length
        self.a_past[i] = length - 1
        self.a_pos[at + ctx_tok] = length - 1
        self.a_types[i] = 1
        self.a_lti[i] = at + ctx_tok + 1
        self.a_kv[i] = self.table[s]

    def _rebuild(self, rows: np.ndarray, seq: np.ndarray, n_ctx: int, ctx_tok: int) -> None:
        """Every generation row from the per-slot state (the layout changed)."""
        n = len(rows)
        g = slice(n_ctx, n_ctx + n)
        self.a_slots[g] = rows
        self.a_ctxlen[g] = self.prompt_len[rows]
        self.a_seq[g] = seq
        np.subtract(self.a_seq[g], 1, out=self.a_past[g])
        self.a_pos[ctx_tok : ctx_tok + n] = self.a_past[g]
        self.a_types[g] = 1
        np.add(self.iota[1 : n + 1], ctx_tok, out=self.a_lti[g])
        np.take(self.table, rows, axis=0, out=self.a_kv[g])

    # ------------------------------------------------------------------- for comparison
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the lean step writes, at the last step's shapes, by bufc's names
        (host values from the arena, device values from the device side)."""
        n_ctx, ctx_tok, n_gen = self.sizes
        ns, nt = n_ctx + n_gen, ctx_tok + n_gen
        c = self.config
        shapes = {
            "seq_slots": ("seq_slots", (ns,)),
            "row_slots": ("seq_slots", (ns,)),  # one beam: a row per request, its seq slot
            "context_lengths": ("context_lengths", (ns,)),
            "sequence_length": ("sequence_length", (ns,)),
            "last_token_ids": ("last_token_ids", (ns,)),
            "input_ids": ("input_ids", (nt,)),
            "position_ids": ("position_ids", (nt,)),
            "kv_cache_block_offsets": ("kv", (1, ns, 2, self.W)),
        }
        out = {}
        for name, (member, shape) in shapes.items():
            o, n = self.offset[member], int(np.prod(shape))
            out[MIRRORED[name]] = self.host[o : o + n].view(shape)
            out[name] = self.dev[o : o + n].view(shape)
        for name, member, shape in (
            ("host_request_types", "request_types", (ns,)),
            ("host_past_key_value_lengths", "past_kv", (ns,)),
            ("host_max_attention_window_sizes", "windows", (c.num_local_layers,)),
            ("host_sink_token_length", "sink", (1,)),
        ):
            o = self.offset[member]
            out[name] = self.host[o : o + int(np.prod(shape))].view(shape)
        return out
