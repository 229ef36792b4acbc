"""Hugging Face's beam search, step by step: the decoder side of ``examples/beam.py``, which
keeps each request's running beams, scores and finished hypotheses as ``generate(num_beams=W)``
does, so the engine's logits can be decoded one step at a time between bufc steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch


# ----------------------------------------------------------------------------- the decoder
def _gather_beams(tensor: torch.Tensor, beam_indices: torch.Tensor) -> torch.Tensor:
    while len(beam_indices.shape) < len(tensor.shape):
        beam_indices = beam_indices.unsqueeze(-1)
    return torch.take_along_dim(input=tensor, indices=beam_indices, dim=1)


class BeamSearch:
    """transformers' beam search (generation/utils.py, ``_beam_search`` and its helpers) for one
    request, batch dimension 1, the same tensors and float32 arithmetic, so that its beams and
    scores are transformers' own. No EOS token: every step's stopping criterion is the maximum
    length (prompt + max_new_tokens)."""

    def __init__(
        self,
        prompt: Sequence[int],
        num_beams: int,
        max_new_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = True,
    ) -> None:
        w, p = num_beams, len(prompt)
        self.num_beams, self.prompt_len = w, p
        self.max_length = p + max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.beams_to_keep = (
            max(2, 1 + 0) * w
        )  # (number of EOS tokens + 1) * num_beams, at least 2W
        self.top_num_beam_mask = torch.cat(
            (torch.ones(w, dtype=torch.bool), torch.zeros(self.beams_to_keep - w, dtype=torch.bool))
        )
        self.cur_len = p
        self.running_sequences = torch.full((1, w, self.max_length), -1, dtype=torch.int64)
        self.running_sequences[:, :, :p] = torch.tensor(list(prompt), dtype=torch.int64)
        self.sequences = self.running_sequences.clone()
        self.running_beam_scores = torch.zeros((1, w), dtype=torch.float)
        self.running_beam_scores[:, 1:] = -1e9  # only the first beam's tokens at the first step
        self.beam_scores = torch.full((1, w), fill_value=-1e9, dtype=torch.float)
        self.is_sent_finished = torch.zeros((1, w), dtype=torch.bool)
        self.is_early_stop_heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.running_beam_indices = torch.full((1, w, max_new_tokens), -1, dtype=torch.int32)
        self.beam_indices = self.running_beam_indices.clone()
        self.done = False
        self.log_probs: list[torch.Tensor] = []  # each step's [W, vocab] (transformers' scores)

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """One step from the [W, vocab] logits of the running beams (the first step: the
        prompt's logit row repeated W times). Returns each new beam's parent and token."""
        if self.done:
            raise RuntimeError("the beam search has finished")
        w, p, cur_len = self.num_beams, self.prompt_len, self.cur_len
        logits = logits.to(device="cpu", dtype=torch.float32, copy=True)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        self.log_probs.append(log_probs.clone())
        log_probs = log_probs.reshape(1, w, -1) + self.running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (1, -1))

        # c. the top-K continuations over all beams
        topk_log_probs, topk_indices = torch.topk(log_probs, k=self.beams_to_keep)
        vocab_size = log_probs.shape[-1] // w
        topk_current_beam_indices = topk_indices // vocab_size
        topk_running_beam_indices = _gather_beams(
            self.running_beam_indices, topk_current_beam_indices
        )
        topk_running_sequences = _gather_beams(self.running_sequences, topk_current_beam_indices)
        topk_running_sequences[:, :, cur_len] = topk_indices % vocab_size
        topk_running_beam_indices[:, :, cur_len - p] = topk_current_beam_indices  # batch 0

        # d. which continuations finish: the maximum length (MaxLengthCriteria), no EOS
        hits = torch.full((1, self.beams_to_keep), cur_len + 1 >= self.max_length)

        # e. the num_beams best unfinished continuations run on
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * -1.0e9
        next_topk_indices = torch.topk(topk_running_log_probs, k=w)[1]
        self.running_sequences = _gather_beams(topk_running_sequences, next_topk_indices)
        self.running_beam_scores = _gather_beams(topk_running_log_probs, next_topk_indices)
        self.running_beam_indices = _gather_beams(topk_running_beam_indices, next_topk_indices)

        # f. finished hypotheses (only the top num_beams may finish), with the length penalty
        just_finished = hits & self.top_num_beam_mask[None, :]
        scores = topk_log_probs / ((cur_len + 1 - p) ** self.length_penalty)
        full = torch.all(self.is_sent_finished, dim=-1, keepdim=True) & (
            self.early_stopping is True
        )
        scores += full.to(torch.float32) * -1.0e9
        scores += (~self.is_early_stop_heuristic_unsatisfied).to(torch.float32) * -1.0e9
        scores += (~just_finished) * -1.0e9
        merged_sequences = torch.cat((self.sequences, topk_running_sequences), dim=1)
        merged_scores = torch.cat((self.beam_scores, scores), dim=1)
        merged_beam_indices = torch.cat((self.beam_indices, topk_running_beam_indices), dim=1)
        merged_is_sent_finished = torch.cat((self.is_sent_finished, just_finished), dim=1)
        topk_merged_indices = torch.topk(merged_scores, k=w)[1]
        self.sequences = _gather_beams(merged_sequences, topk_merged_indices)
        self.beam_scores = _gather_beams(merged_scores, topk_merged_indices)
        self.beam_indices = _gather_beams(merged_beam_indices, topk_merged_indices)
        self.is_sent_finished = _gather_beams(merged_is_sent_finished, topk_merged_indices)

        parents = self.running_beam_indices[0, :, cur_len - p].tolist()
        tokens = self.running_sequences[0, :, cur_len].tolist()

        # g. the stopping condition of the whole search
        self.cur_len = cur_len = cur_len + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - p
        else:
            best_length = cur_len - p
        best_running = self.running_beam_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(
            self.is_sent_finished, torch.min(self.beam_scores, dim=1, keepdim=True)[0], -1.0e9
        )
        self.is_early_stop_heuristic_unsatisfied = self.is_early_stop_heuristic_unsatisfied & (
            torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        )
        improvement_possible = torch.any(self.is_early_stop_heuristic_unsatisfied)
        exists_open_beam = ~(torch.all(self.is_sent_finished) & (self.early_stopping is True))
        valid_continuations = ~torch.all(hits)
        self.done = not bool(improvement_possible & exists_open_beam & valid_continuations)
        return parents, tokens

    def running_tokens(self) -> list[list[int]]:
        """Each running beam's generated tokens."""
        return self.running_sequences[0, :, self.prompt_len : self.cur_len].tolist()

    def results(self) -> tuple[list[list[int]], list[float], list[list[int]]]:
        """The returned beams, best first (num_return_sequences = num_beams): generated tokens,
        score (sequences_scores) and the beam chosen at each step (beam_indices)."""
        length = int((self.beam_indices[0] + 1).bool().sum(dim=1).max())
        tokens = self.sequences[0, :, self.prompt_len : self.prompt_len + length].tolist()
        return tokens, self.beam_scores[0].tolist(), self.beam_indices[0, :, :length].tolist()
