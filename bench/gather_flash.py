"""A hand-written vLLM-V1-style "gather feeder" for the llama_flash family: the "feeder" column
of bench/churn.py.

What a careful vLLM engineer would write for the FlashAttention contract (one beam, no draft
tokens, one KV-cache group, a paged KV cache with the allocator's block ids as they are),
behind the same three calls as bufc's in-flight API: ``add(request)``, ``finish(slot)`` and
``step(tokens, chunks=..., blocks=...)``, with ``tokens`` the sampled tokens indexed by seq
slot and ``blocks`` the KV block ids appended per slot. It writes the tensors bufc's
llama_flash module writes, with the same values, laid out as vLLM V1's ``InputBatch`` and
``GPUModelRunner._prepare_inputs`` lay them out:

- persistent per-slot numpy rows (vLLM's InputBatch, indexed by seq slot): ``token_ids``
  [slots, max_model_len] (the prompt written at ``add``, each sampled token appended at the
  step that consumes it), ``num_computed`` (tokens whose K/V the steps have written),
  ``num_tokens``, ``num_prompt``, the ``block_table`` [slots, max_blocks_per_seq] (int32, the
  ids as allocated, 0 past a slot's blocks) and ``num_blocks``;
- per step an index map, rows -> slots (``idx_mapping``), and the tokens scheduled per row;
  rows in bufc's order (context requests in arrival order, then the generation rows: a
  finished request's row is filled by the last row, as vLLM's ``condense`` does, and the
  prompts the last step finished join at the end), so that the tensors compare equal;
- every tensor from a few vectorised numpy gathers over that map (``np.repeat`` / ``cumsum`` /
  ``arange``, as ``_prepare_inputs`` and ``BlockTable.compute_slot_mapping`` do): the
  positions are ``num_computed`` repeated plus the offsets within each row, the input ids
  ``token_ids.ravel()[slot * max_model_len + position]``, ``query_start_loc`` the cumsum of
  the rows' tokens, ``seq_lens`` ``num_computed + scheduled``, the block table rows gathered by
  slot, ``slot_mapping = block_table[slot, pos // block_size] * block_size + pos %
  block_size`` and ``logits_indices = query_start_loc[1:] - 1`` (every row's last token: a
  context chunk's, whether or not it finishes its prompt, and every generation token);
- the checks a step needs, vectorised and before anything is written: the sampled tokens in
  the vocabulary, the appended block ids in the pool (``num_kv_blocks``; the int32 range
  without one) and within ``max_blocks_per_seq`` per slot, every scheduled sequence's blocks
  covering its tokens after the step (which also keeps it within ``max_model_len``), the token
  budget (``max_num_tokens``) and the chunk sizes;
- one staging buffer per tensor (vLLM's ``CpuGpuBuffer``: a host tensor, pinned on CUDA, and a
  device tensor), and one host-to-device copy per device tensor per step, ``non_blocking``:
  the feeder makes eight copies. The host waits for the last step's copies to leave the
  staging buffers before it writes them again (a CUDA event). On the CPU the "device" tensor
  is a second tensor and each copy a numpy memcpy into it (``CpuGpuBuffer``).

What it leaves out, against bufc: beams, draft tokens (and accepted drafts), explicit
positions, several KV-cache groups (``attention_windows``), pipeline parallelism, the
stateless ``prepare_step``, tokens gathered on the device, padding rows past the step (for
CUDA-graph buckets), double buffering, the step scalars, and error messages that name the
culprit's field.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

INT32_LIMIT = 2**31  # block ids live in an int32 block table


class FeederError(ValueError):
    """A request or step the feeder refuses (nothing changed)."""


class CpuGpuBuffer:
    """vLLM's staging pair: a host tensor (pinned on CUDA) with a numpy view, and its device
    tensor (None: a host-only input). On a CPU "device" the copy is a numpy memcpy on the
    calling thread, as bufc's and the lean step's are (torch's copy_ hands a copy of more than
    32768 elements to its intra-op thread pool, which stalls for milliseconds on a loaded
    host)."""

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None
    ) -> None:
        pin = device is not None and device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = None if device is None else torch.zeros(shape, dtype=dtype, device=device)
        self.gpu_np = self.gpu.numpy() if device is not None and device.type == "cpu" else None

    def copy_to_gpu(self, n: int) -> None:
        if self.gpu_np is not None:
            np.copyto(self.gpu_np[:n], self.np[:n])
            return
        assert self.gpu is not None
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class GatherFlash:
    """The llama_flash step for requests in flight, vLLM-V1 style (see the module docstring)."""

    def __init__(self, config: Any, device: str | torch.device = "cpu") -> None:
        c = config
        if c.max_beam_width != 1 or c.max_draft_tokens or c.pp_size != 1 or c.num_kv_groups != 1:
            raise FeederError("the feeder runs one beam, no drafts, one rank, one KV group")
        self.config = c
        self.device = torch.device(device)
        S, N, W, bs = c.max_batch_size, c.max_num_tokens, c.max_blocks_per_seq, c.tokens_per_block
        self.S, self.N, self.W, self.bs = S, N, W, bs
        self.bs64 = np.int64(bs)  # block id x block_size in int64 (an id may reach 2**31 - 1)
        self.M = W * bs  # max_model_len: the most tokens a block table row holds
        self.vocab = c.vocab_size
        self.id_limit = c.num_kv_blocks or INT32_LIMIT

        # ---- the persistent batch, one row per seq slot (vLLM's InputBatch)
        self.live = np.zeros(S, bool)
        self.token_ids = np.zeros((S, self.M), np.int32)
        self.token_flat = self.token_ids.reshape(-1)
        self.num_prompt = np.zeros(S, np.int64)
        self.num_tokens = np.zeros(S, np.int64)
        self.num_computed = np.zeros(S, np.int64)
        self.block_table = np.zeros((S, W), np.int32)
        self.block_flat = self.block_table.reshape(-1)
        self.num_blocks = np.zeros(S, np.int64)
        # ---- row order: context phase in arrival order, generation rows condensed
        self.waiting: dict[int, None] = {}
        self.rows = np.zeros(S, np.int64)  # generation rows: their slots, rows[:n_rows]
        self.n_rows = 0
        self.row_of = np.full(S, -1, np.int64)
        self.completing: list[int] = []  # prompts the last step finished: rows from this step
        self.sizes = (0, 0)  # the last step's rows and tokens
        # ---- scratch
        self.arange = np.arange(max(N, S) + 1, dtype=np.int64)
        self.idx_mapping = np.zeros(S, np.int64)
        self.num_scheduled = np.zeros(S, np.int64)

        # ---- one staging buffer per input (vLLM's CpuGpuBuffer)
        dev = self.device
        self.input_ids = CpuGpuBuffer((N,), torch.int32, dev)
        self.positions = CpuGpuBuffer((N,), torch.int64, dev)
        self.seq_slots = CpuGpuBuffer((S,), torch.int32, dev)
        self.query_start_loc = CpuGpuBuffer((S + 1,), torch.int32, dev)
        self.query_lens = CpuGpuBuffer((S,), torch.int32, None)  # host only
        self.seq_lens = CpuGpuBuffer((S,), torch.int32, dev)
        self.cu_seqlens_k = CpuGpuBuffer((S + 1,), torch.int32, dev)
        self.produces_token = CpuGpuBuffer((c.max_num_logits,), torch.bool, dev)
        self.block_table_buf = CpuGpuBuffer((S, W), torch.int32, dev)
        self.slot_mapping = CpuGpuBuffer((N,), torch.int64, dev)
        self.logits_indices = CpuGpuBuffer((c.max_num_logits,), torch.int64, dev)
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None

    # ----------------------------------------------------------------- arrivals, finishes
    def add(self, request: Any) -> None:
        """A request arrives in its seq_slot, in the context phase: checked once, its prompt
        written into the slot's token row and its block list into its block table row."""
        slot = request.seq_slot
        if type(slot) is not int or not 0 <= slot < self.S:
            raise FeederError(f"add(): seq_slot {slot!r} is not a slot")
        if self.live[slot]:
            raise FeederError(f"add(): seq_slot {slot} holds a request")
        if (
            request.beam_width != 1
            or len(request.draft_tokens or ())
            or request.position_ids is not None
            or any(map(len, request.generated or ()))
            or request.context_chunk_size is not None
        ):
            raise FeederError(f"add(): seq_slot {slot}: one beam, a fresh prompt, no drafts")
        prompt = np.asarray(request.prompt)
        n = len(prompt) if prompt.ndim == 1 else 0
        if not n or prompt.dtype.kind not in "iu" or n > self.M:
            raise FeederError(f"add(): seq_slot {slot}: 1 .. {self.M} prompt token ids")
        if int(prompt.astype(np.int64, copy=False).view(np.uint64).max()) >= self.vocab:
            raise FeederError(f"add(): seq_slot {slot}: a prompt token is outside the vocabulary")
        begin = request.context_position
        if type(begin) is not int or not 0 <= begin < n:
            raise FeederError(f"add(): seq_slot {slot}: context_position {begin!r}")
        lists = request.kv_block_ids
        if lists is None or len(lists) != 1:
            raise FeederError(f"add(): seq_slot {slot}: one KV block list")
        ids = np.asarray(lists[0])
        k = len(ids)
        if ids.ndim != 1 or k > self.W or (k and ids.dtype.kind not in "iu"):
            raise FeederError(f"add(): seq_slot {slot}: at most {self.W} integer block ids")
        ids = ids.astype(np.int64, copy=False)
        if k and int(ids.view(np.uint64).max()) >= self.id_limit:
            raise FeederError(f"add(): seq_slot {slot}: a block id is outside the pool")
        self.token_ids[slot, :n] = prompt
        self.num_prompt[slot] = self.num_tokens[slot] = n
        self.num_computed[slot] = begin
        row = self.block_table[slot]
        row[:k] = ids
        row[k:] = 0
        self.num_blocks[slot] = k
        self.live[slot] = True
        self.waiting[slot] = None

    def finish(self, slot: Any) -> None:
        """The request in `slot` leaves: the last generation row fills its row (condense)."""
        if type(slot) is not int or not 0 <= slot < self.S or not self.live[slot]:
            raise FeederError(f"finish(): seq_slot {slot!r} holds no request")
        row = int(self.row_of[slot])
        if row >= 0:
            last = self.n_rows - 1
            moved = int(self.rows[last])
            self.rows[row] = moved
            self.row_of[moved] = row
            self.n_rows = last
            self.row_of[slot] = -1
        self.waiting.pop(slot, None)
        if slot in self.completing:
            self.completing.remove(slot)
        self.live[slot] = False

    # ------------------------------------------------------------------------ the step
    def step(
        self,
        tokens: Any = None,
        *,
        chunks: dict[int, int] | None = None,
        blocks: dict[int, Any] | None = None,
    ) -> None:
        """The next step: every check, then the persistent batch, then the gathers into the
        staging buffers, then one copy per device input."""
        W, bs = self.W, self.bs
        # ---- this step's rows: context requests, the generation rows, last step's prompts
        n_old, promoted = self.n_rows, self.completing
        n_gen = n_old + len(promoted)
        gen = self.rows[:n_gen]
        if promoted:  # past n_rows: scratch until the step commits
            gen[n_old:] = promoted
        ctx = self._context(chunks)
        n_ctx = len(ctx)
        R = n_ctx + n_gen
        idx = self.idx_mapping[:R]
        sched = self.num_scheduled[:R]
        if n_ctx:
            idx[:n_ctx] = [s for s, _ in ctx]
            sched[:n_ctx] = [k for _, k in ctx]
        idx[n_ctx:] = gen
        sched[n_ctx:] = 1
        # ---- checks: nothing is changed until they all pass
        tok = None
        if n_gen:
            tok = self._tokens(tokens, gen)
        elif tokens is not None and len(tokens):
            raise FeederError("step(): no request produced a token in the last step")
        num_blocks, appended = self.num_blocks, None
        if blocks:
            num_blocks, appended = self._check_blocks(blocks)
        total = int(sched.sum())
        if total > self.N:
            raise FeederError(f"step(): {total} tokens exceed max_num_tokens={self.N}")
        start = self.num_computed[idx]
        seq_lens = start + sched
        short = num_blocks[idx] * bs < seq_lens  # (a full row holds max_model_len tokens)
        if short.any():
            slot = int(idx[np.flatnonzero(short)[0]])
            raise FeederError(f"step(): seq_slot {slot}: its KV blocks do not cover its tokens")
        # ---- commit: the persistent batch
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have left the staging buffers
        if n_gen:
            at = gen * self.M + self.num_tokens[gen]
            self.token_flat[at] = tok
            self.num_tokens[gen] += 1
        if appended is not None:
            slots, counts, ids = appended
            before = self.num_blocks[slots]
            within = self.arange[: len(ids)] - np.repeat(np.cumsum(counts) - counts, counts)
            self.block_flat[np.repeat(slots * W + before, counts) + within] = ids
            self.num_blocks[slots] = before + counts
        # ---- the gathers (GPUModelRunner._prepare_inputs)
        cu = np.cumsum(sched)
        req_indices = np.repeat(self.arange[:R], sched)
        offsets = self.arange[:total] - np.repeat(cu - sched, sched)
        slot_of_token = idx[req_indices]
        pos = self.positions.np[:total]
        np.add(self.num_computed[slot_of_token], offsets, out=pos)
        np.take(self.token_flat, slot_of_token * self.M + pos, out=self.input_ids.np[:total])
        self.seq_slots.np[:R] = idx
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : R + 1] = cu
        self.query_lens.np[:R] = sched
        self.seq_lens.np[:R] = seq_lens
        self.cu_seqlens_k.np[0] = 0
        np.cumsum(seq_lens, out=self.cu_seqlens_k.np[1 : R + 1])
        # a row produces a token once its prompt is through (a generation row always)
        np.greater_equal(seq_lens, self.num_prompt[idx], out=self.produces_token.np[:R])
        np.take(self.block_table, idx, axis=0, out=self.block_table_buf.np[:R])
        block_numbers = self.block_flat[slot_of_token * W + pos // bs]
        np.add(block_numbers * self.bs64, pos % bs, out=self.slot_mapping.np[:total])
        np.subtract(cu, 1, out=self.logits_indices.np[:R])
        # ---- the state the step leaves
        self.num_computed[idx] = seq_lens
        completing = []
        for slot, _ in ctx:
            if self.num_computed[slot] == self.num_prompt[slot]:
                completing.append(slot)
                del self.waiting[slot]
        for i, slot in enumerate(promoted, n_old):
            self.row_of[slot] = i
        self.n_rows = n_gen
        self.completing = completing
        self.sizes = (R, total)
        # ---- one copy per device input
        for buf, n in (
            (self.input_ids, total),
            (self.positions, total),
            (self.seq_slots, R),
            (self.query_start_loc, R + 1),
            (self.seq_lens, R),
            (self.cu_seqlens_k, R + 1),
            (self.block_table_buf, R),
            (self.slot_mapping, total),
            (self.logits_indices, R),
            (self.produces_token, R),
        ):
            buf.copy_to_gpu(n)
        if self.copied is not None:
            self.copied.record()

    # ------------------------------------------------------------------------ helpers
    def _tokens(self, tokens: Any, rows: np.ndarray) -> np.ndarray:
        """The sampled tokens of `rows`' slots, checked in the vocabulary."""
        if tokens is None:
            raise FeederError("step(): the last step produced tokens; pass them")
        if type(tokens) is not np.ndarray or tokens.dtype != np.int64 or tokens.ndim != 1:
            if isinstance(tokens, torch.Tensor):
                tokens = tokens.detach().cpu().numpy()
            tokens = np.asarray(tokens)
            if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
                raise FeederError("step(): tokens must be integers, one per seq slot")
            tokens = tokens.astype(np.int64, copy=False)
        if len(tokens) < self.S:
            raise FeederError(f"step(): tokens must be indexed by seq slot ({self.S} of them)")
        tok = tokens[rows]
        if int(tok.view(np.uint64).max()) >= self.vocab:
            raise FeederError(f"step(): a sampled token is outside 0 .. {self.vocab - 1}")
        return tok

    def _check_blocks(self, blocks: dict[int, Any]) -> tuple[np.ndarray, tuple]:
        """The appended block ids, checked (slots in flight, ids in the pool, within
        max_blocks_per_seq): each slot's block count after the step, and the appends."""
        m = len(blocks)
        try:
            slots = np.fromiter(blocks, np.int64, m)
            lists = list(blocks.values())
            counts = np.fromiter(map(len, lists), np.int64, m)
            ids = np.array(list(chain.from_iterable(lists)))
        except (TypeError, ValueError, OverflowError):
            raise FeederError("step(): blocks must map seq slots to lists of block ids") from None
        if int(slots.view(np.uint64).max()) >= self.S or not self.live[slots].all():
            raise FeederError("step(): blocks for a seq slot that holds no request")
        if ids.size and (ids.dtype.kind not in "iu" or ids.ndim != 1):
            raise FeederError("step(): block ids must be integers")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and int(ids.view(np.uint64).max()) >= self.id_limit:
            raise FeederError(f"step(): a block id is outside 0 .. {self.id_limit - 1}")
        after = self.num_blocks.copy()
        after[slots] += counts
        if int(after[slots].max()) > self.W:
            raise FeederError(f"step(): a block list exceeds max_blocks_per_seq={self.W}")
        return after, (slots, counts, ids)

    def _context(self, chunks: dict[int, int] | None) -> list[tuple[int, int]]:
        """This step's context requests (slot, chunk), in arrival order."""
        if chunks is None:
            return [(s, int(self.num_prompt[s] - self.num_computed[s])) for s in self.waiting]
        for s in chunks:
            if s not in self.waiting:
                raise FeederError(f"step(): chunks[{s!r}]: no request in its context phase")
        out = []
        for s in self.waiting:
            if s in chunks:
                k = chunks[s]
                if type(k) is not int or not 1 <= k <= self.num_prompt[s] - self.num_computed[s]:
                    raise FeederError(f"step(): chunks[{s}] = {k!r}")
                out.append((s, k))
        return out

    # ------------------------------------------------------------------- for comparison
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the feeder writes, at the last step's shapes, by bufc's names (host
        values from the staging buffers, device values from the device tensors)."""
        R, T = self.sizes
        out: dict[str, torch.Tensor] = {}
        for name, buf, n in (
            ("input_ids", self.input_ids, T),
            ("positions", self.positions, T),
            ("seq_slots", self.seq_slots, R),
            ("query_start_loc", self.query_start_loc, R + 1),
            ("seq_lens", self.seq_lens, R),
            ("cu_seqlens_k", self.cu_seqlens_k, R + 1),
            ("block_table", self.block_table_buf, R),
            ("kv_slot_mapping", self.slot_mapping, T),
            ("logits_indices", self.logits_indices, R),
            ("produces_token", self.produces_token, R),
            ("row_slots", self.seq_slots, R),  # one row per request here: the seq slots
        ):
            assert buf.gpu is not None
            out[f"host_{name}"] = buf.cpu[:n]
            out[name] = buf.gpu[:n]
        out["host_query_lens"] = self.query_lens.cpu[:R]
        return out
