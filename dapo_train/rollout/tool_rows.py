"""The decode loop's side of tool calls (rollout.tools): which rows go on after an end of turn, and the tool
turn's tokens each such row is fed, one per decode step, in place of a sampled token.

When a row emits an EOS id that ends an assistant turn making calls (tools/turns.py: the calls parsed and
run, the tool turn rendered by the chat template and tokenized), the row does not finish: its next decode
steps take the tool turn's tokens, queued, instead of the tokens drawn for it, while the other rows keep
sampling. A forced token goes through the model's forward as a sampled one would, so the KV cache holds
exactly the transcript, and after the last one the row samples the next assistant turn. Forced tokens are
context, not actions: the policy mask is False there (Completion.policy_mask), and the behaviour log-prob
recorded is 0. The budget (rollout.max_new_tokens) counts every token of the transcript, forced ones too;
a row out of budget ends truncated. A row whose turn would exceed rollout.max_tool_calls ends at that turn's
EOS, over_calls: not truncated, so overlong filtering keeps it in the loss and its reward can push
over-calling down.
"""

from __future__ import annotations

import torch

from dapo_train.tools.turns import ToolCall, ToolTurns

Tensor = torch.Tensor


class ToolRows:
    """Per-row state of N rows decoding up to `budget` tokens with tools: the forced tokens queued, where the
    current assistant turn began, the calls made, and at the end each row's length, truncation, over_calls and
    policy mask (rows without EOS stay truncated at the budget)."""

    def __init__(self, turns: ToolTurns, rows: int, budget: int) -> None:
        self.turns = turns
        self.queues: list[list[int]] = [[] for _ in range(rows)]
        self.pending: set[int] = set()  # the rows whose queue is not empty: most decode steps have none
        self.turn_start = [0] * rows  # step at which each row's current assistant turn began
        self.calls: list[list[ToolCall]] = [[] for _ in range(rows)]
        self.policy_mask = torch.ones((rows, budget), dtype=torch.bool)  # (N, T) False on forced tokens
        self.lengths = torch.full((rows,), budget, dtype=torch.long)  # (N,)
        self.truncated = torch.ones(rows, dtype=torch.bool)  # (N,)
        self.over_calls = torch.zeros(rows, dtype=torch.bool)  # (N,) ended by a turn past rollout.max_tool_calls

    def force(self, active: list[int], tokens: Tensor, step: int) -> Tensor:
        """Put the next queued token of each active row that has one in place of its drawn token (tokens (A,),
        in place) -> (A,) bool, True where a token was forced."""
        forced = torch.zeros(len(active), dtype=torch.bool)
        if not self.pending:
            return forced.to(tokens.device)
        for index, row in enumerate(active):
            if row in self.pending:
                tokens[index] = self.queues[row].pop(0)
                forced[index] = True
                self.policy_mask[row, step] = False
                if not self.queues[row]:
                    self.turn_start[row] = step + 1
                    self.pending.discard(row)
        return forced.to(tokens.device)

    def running(self, active: list[int], ended: Tensor, forced: Tensor, step: int, generated: Tensor) -> Tensor:
        """Which active rows go on after this step: ended (A,) bool, the rows whose token is an EOS id; forced
        (A,) bool. A forced EOS (the tool turn's own end) goes on; a sampled one finishes the row, unless
        its assistant turn makes calls within rollout.max_tool_calls: then the calls run and the tool turn is
        queued. generated (N, budget): the tokens so far. -> (A,) bool."""
        running = ~ended | forced
        for index in (ended & ~forced).nonzero().flatten().tolist():
            row = active[index]
            turn = generated[row, self.turn_start[row] : step + 1].tolist()
            answer = self.turns.answer(turn, len(self.calls[row]))
            if answer is None or answer.over_limit:
                self.lengths[row], self.truncated[row], self.over_calls[row] = step + 1, False, answer is not None
                continue
            self.calls[row] += answer.calls
            self.queues[row] = list(answer.forced_ids)
            if self.queues[row]:
                self.pending.add(row)
            running[index] = True
        return running
