"""tbptt on words: the standard word language model (an embedding, a stacked LSTM/GRU/RNN, a decoder).

The word_language_model example's ``RNNModel``, as a user ports it onto ``recipe=tbptt``. What
changes is what the recipe's net contract asks (`multiloss.recipes.tbptt`): the recurrent layer is
``batch_first`` (the recipe serves ``(batch, time)`` tokens), forward returns the logits
``(batch, time, vocab)`` rather than flattened log-probabilities (cross-entropy on logits is the
same number as NLL on log-softmax), the vocabulary size is called ``vocab_size`` (the recipe passes
the data's), and ``hidden=None`` starts from zeros (PyTorch's recurrent layers do that already, so
``init_hidden`` goes).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

RNNState = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RNNModel(nn.Module):
    """Embedding -> dropout -> ``nlayers`` of ``rnn_type`` -> dropout -> linear decoder (weights tied if asked)."""

    def __init__(
        self,
        vocab_size: int,
        rnn_type: Literal["LSTM", "GRU", "RNN_TANH", "RNN_RELU"] = "LSTM",
        ninp: int = 200,
        nhid: int = 200,
        nlayers: int = 2,
        dropout: float = 0.2,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, ninp)
        if rnn_type in ("LSTM", "GRU"):
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        elif rnn_type in ("RNN_TANH", "RNN_RELU"):
            nonlinearity = rnn_type.removeprefix("RNN_").lower()
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout, batch_first=True)
        else:
            raise ValueError(f"rnn_type must be LSTM, GRU, RNN_TANH or RNN_RELU, not {rnn_type!r}")
        self.decoder = nn.Linear(nhid, vocab_size)
        if tie_weights:
            # Press & Wolf 2016; Inan et al. 2016: the decoder's weights are the embedding's.
            if nhid != ninp:
                raise ValueError("tie_weights needs nhid equal to ninp")
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor, hidden: RNNState | None = None) -> tuple[torch.Tensor, RNNState]:
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden
