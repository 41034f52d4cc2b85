"""Recipe `tbptt`: truncated backpropagation through time, with ``hidden.detach()`` between chunks.

A character-level LSTM reads a long sequence in chunks and carries its hidden state ``(h, c)``
from one chunk to the next, stepping the optimizer after each chunk. The seeds' LSTM pitfall: the
carried state still points into the previous chunk's graph, which that chunk's backward has
already freed, so the second chunk's backward raises

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed

The seed's first fix, ``backward(retain_graph=True)``, only trades the error for another one
(the optimizer step has modified in place the weights that graph saved: "one of the variables
needed for gradient computation has been modified by an inplace operation"), and where it does
run it walks the whole history again on every chunk while keeping it all in memory: the memory
held for backward grows with the sequence. The seed's real fix is the one used here
(``hidden = hidden.detach()``, PyTorch's word_language_model calls it ``repackage_hidden``): keep
the *values* of ``(h, c)`` so the next chunk starts where this one ended, cut the *graph* so its
backward stops at the chunk boundary. Memory then depends on the chunk length, not on the
sequence length; ``tests/recipes/test_tbptt.py`` proves that (counting the bytes autograd saves for
backward), that one chunk of the whole sequence is exactly full BPTT, and that chunk by chunk the
gradients equal a hand-written ``repackage_hidden`` loop.

Lightning removed its built-in TBPTT (``truncated_bptt_steps``) in 2.0, so the chunk loop lives in
``training_step`` under manual optimization.

    python train.py recipe=tbptt
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import MeanMetric

from multiloss.accumulation import ManualAccumulation
from multiloss.config import ConfigError, require
from multiloss.data.text import CharVocab
from multiloss.module import OptimizerFactory, RecipeModule

Hidden = tuple[torch.Tensor, torch.Tensor]
LN2 = math.log(2.0)


class TruncatedBPTT(RecipeModule):
    """Character LSTM on CPython's docs, truncated BPTT: one step per chunk, (h, c) detached between chunks.

    Each batch holds sequences of ``data.seq_len`` characters, split by *length* into chunks of
    ``chunk_length`` (``torch.split``; the last chunk is shorter when the length does not divide
    ``seq_len``; ``chunk_length ≥ seq_len`` is one chunk, i.e. full BPTT). Per chunk: forward from
    the carried hidden state, ``manual_backward`` of the chunk's mean cross-entropy, gradient
    clipping by norm (``gradient_clip_val``, ``self.clip_gradients``), optimizer step, then
    ``(h, c)`` detached. The state starts at zero for every batch (the sequences of a batch are
    shuffled windows, not continuations of the previous batch's).

    ``trainer.max_steps`` counts optimizer steps, i.e. chunks (with ``accumulate_grad_batches=1``);
    Lightning checks it after each batch, so a run ends on a whole batch.

    Accumulation (``accumulate_grad_batches = k``): a micro-batch is a *chunk*. The gradients of k
    consecutive chunks of a batch (each loss / k) are summed before one clipped step; the state is
    still detached after every chunk, so memory stays that of one chunk. The last chunk of a batch
    always steps (no gradient is carried into the next batch). ``k ≥`` the number of chunks gives
    one step per batch on the mean of its truncated chunk gradients.

    Logs ``loss/ce`` (nats/char, mean over the batch's chunks) and ``train/bpc`` per step;
    ``val/loss/ce`` and ``val/bpc`` (cross-entropy / ln 2) per epoch on the held-out slice, over full
    sequences without chunking (the forward with a carried state gives the same outputs; chunking
    changes only where backward stops). At each epoch end, rank zero writes
    ``samples/epoch_NNN.txt``: ``sample_length`` characters continuing ``sample_prompt``, drawn with a
    private ``torch.Generator`` seeded by ``sample_seed`` (so sampling never moves the global random
    stream and exact resume holds), at ``sample_temperature`` (0 = greedy).

    Raises:
        ConfigError: ``chunk_length``, ``embedding_dim``, ``hidden_size``, ``num_layers``,
            ``accumulate_grad_batches`` or ``sample_length`` < 1; ``gradient_clip_val`` ≤ 0;
            ``sample_temperature`` < 0; a ``sample_prompt`` character outside the vocabulary;
            ``trainer.gradient_clip_val`` / ``trainer.gradient_clip_algorithm`` set (use
            ``model.gradient_clip_val``) or ``trainer.accumulate_grad_batches`` > 1 (use
            ``model.accumulate_grad_batches``): Lightning cannot do either under manual
            optimization; a checkpoint whose vocabulary differs from this Python's corpus.
    """

    def __init__(
        self,
        optimizer: OptimizerFactory,
        chunk_length: int = 32,
        embedding_dim: int = 48,
        hidden_size: int = 192,
        num_layers: int = 1,
        gradient_clip_val: float | None = 1.0,
        accumulate_grad_batches: int = 1,
        sample_prompt: str = "The ",
        sample_length: int = 300,
        sample_temperature: float = 0.8,
        sample_seed: int = 0,
    ) -> None:
        super().__init__(optimizer)
        require(chunk_length >= 1, "chunk_length", chunk_length, "an integer ≥ 1 (characters per chunk)")
        for key, value in (("embedding_dim", embedding_dim), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            require(value >= 1, key, value, "an integer ≥ 1")
        require(
            gradient_clip_val is None or gradient_clip_val > 0,
            "gradient_clip_val",
            gradient_clip_val,
            "a positive number (the maximal gradient norm per step), or null for no clipping",
        )
        require(sample_length >= 1, "sample_length", sample_length, "an integer ≥ 1 (characters to generate)")
        require(sample_temperature >= 0, "sample_temperature", sample_temperature, "a number ≥ 0 (0 = greedy)")
        # Fixed vocabulary: the sorted characters of the whole corpus, whatever the split or seq_len.
        self.vocab = CharVocab.pydoc()
        unknown = sorted(set(sample_prompt) - set(self.vocab.chars))
        require(
            len(sample_prompt) >= 1 and not unknown,
            "sample_prompt",
            sample_prompt,
            "a non-empty string of characters that occur in the corpus",
            f"not in the vocabulary: {unknown}" if unknown else "empty",
        )
        self.save_hyperparameters(ignore=["optimizer"], logger=False)
        # Lightning's TBPTT is gone since 2.0: the chunk loop, its backwards and steps are ours.
        self.automatic_optimization = False
        self.accumulation = ManualAccumulation(self, accumulate_grad_batches)
        self.chunk_length, self.gradient_clip_val = chunk_length, gradient_clip_val

        self.embed = nn.Embedding(len(self.vocab), embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, len(self.vocab))
        self.val_bpc = MeanMetric()

    def forward(self, x: torch.Tensor, hidden: Hidden | None = None) -> tuple[torch.Tensor, Hidden]:
        """Next-character logits ``(batch, time, vocab)`` for ids ``x``, and the state after the last one."""
        out, hidden = self.lstm(self.embed(x), hidden)
        return self.head(out), hidden

    @staticmethod
    def repackage_hidden(hidden: Hidden) -> Hidden:
        """Keep the state's values, cut its graph: the next chunk's backward stops here.

        Both ``h`` and ``c``: detaching only ``h`` would leave the cell state chained to the freed
        graph (and the error would come back one chunk later).
        """
        return tuple(t.detach() for t in hidden)  # type: ignore[return-value]

    # ------------------------------------------------------------------ checks

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Reject Trainer settings that manual optimization cannot honour, naming the model key to use.

        Lightning would refuse them too, but only with a traceback; and silently ignoring them would
        be worse. Raises `ConfigError` with full dotted keys.
        """
        moves = (
            ("gradient_clip_val", trainer.gradient_clip_val, "model.gradient_clip_val"),
            (
                "gradient_clip_algorithm",
                getattr(trainer.gradient_clip_algorithm, "value", None),
                "model.gradient_clip_val",
            ),
        )
        for key, value, model_key in moves:
            if value is not None:
                raise ConfigError(
                    f"trainer.{key}",
                    value,
                    f"null; this recipe clips each chunk's step itself, by norm: set {model_key}=<max norm> "
                    f"(now {self.gradient_clip_val}; null turns clipping off)",
                    "Lightning cannot clip gradients under manual optimization",
                )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "trainer.accumulate_grad_batches",
                trainer.accumulate_grad_batches,
                "1; this recipe accumulates itself: set model.accumulate_grad_batches=<k> "
                "(k consecutive chunks per optimizer step)",
                "Lightning cannot accumulate gradients under manual optimization",
            )

    def configure_callbacks(self) -> list[L.Callback]:
        # The earliest hook Lightning calls on the module in fit(): before its own configuration
        # check (which would raise a bare MisconfigurationException) and before any training.
        self.check_trainer(self.trainer)
        return []

    # ---------------------------------------------------------------- training

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        # By length: chunks of chunk_length characters (tensor_split(x, k) would make k chunks).
        xs = torch.split(batch["x"], self.chunk_length, dim=1)
        ys = torch.split(batch["y"], self.chunk_length, dim=1)
        chunks = list(zip(xs, ys))
        hidden: Hidden | None = None
        nll_sum = batch["y"].new_zeros((), dtype=torch.float32)
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            with self.accumulation.micro_batch(opt, i, last=last) as backward:
                logits, hidden = self(x, hidden)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                backward(loss)
                if self.gradient_clip_val is not None and self.accumulation.steps_on(i, last):
                    # Clip the (accumulated) gradient that is about to be stepped, by global norm.
                    self.clip_gradients(opt, gradient_clip_val=self.gradient_clip_val, gradient_clip_algorithm="norm")
            # After the step: the next chunk starts from these values, its backward ends here.
            hidden = self.repackage_hidden(hidden)
            nll_sum = nll_sum + loss.detach() * y.numel()
        ce = nll_sum / batch["y"].numel()
        self.log_losses({"ce": ce}, batch_size=len(batch["y"]))
        self.log("train/bpc", ce / LN2, on_step=True, on_epoch=False, batch_size=len(batch["y"]))

    # -------------------------------------------------------------- validation

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Whole sequences at once: without backward there is no graph to truncate.
        logits, _ = self(batch["x"])
        ce = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        n_chars = batch["y"].numel()
        self.log_losses({"ce": ce}, prefix="val/loss/", batch_size=n_chars)
        # Weighted by characters, reduced over ranks by torchmetrics: the exact mean over the slice.
        self.val_bpc.update(ce / LN2, weight=n_chars)
        self.log("val/bpc", self.val_bpc, on_epoch=True, prog_bar=True)

    # ------------------------------------------------------------------ sample

    @torch.no_grad()
    def generate(self, prompt: str, length: int, temperature: float, generator: torch.Generator) -> str:
        """``prompt`` followed by ``length`` characters drawn from the model (``temperature`` 0 = greedy)."""
        was_training = self.training
        self.eval()
        logits, hidden = self(self.vocab.encode(prompt).to(self.device)[None])
        ids: list[int] = []
        for _ in range(length):
            last = logits[0, -1]
            if temperature == 0:
                nxt = last.argmax().view(1)
            else:
                nxt = torch.multinomial(F.softmax(last / temperature, dim=-1), 1, generator=generator)
            ids.append(int(nxt))
            logits, hidden = self(nxt.view(1, 1), hidden)
        self.train(was_training)
        return prompt + self.vocab.decode(ids)

    def on_train_epoch_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        # A private generator, re-seeded each epoch: the sample depends on the weights only, and
        # the global stream that training draws from is left exactly where it was.
        generator = torch.Generator(device=self.device).manual_seed(self.hparams.sample_seed)
        h = self.hparams
        text = self.generate(h.sample_prompt, h.sample_length, h.sample_temperature, generator)
        bpc = self.trainer.callback_metrics.get("val/bpc")
        header = f"# epoch {self.current_epoch}, step {self.global_step}" + (
            f", val/bpc {float(bpc):.4f}" if bpc is not None else ""
        )
        path = Path(self.trainer.default_root_dir) / "samples" / f"epoch_{self.current_epoch:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{header}\n{text}\n", encoding="utf-8")

    # -------------------------------------------------------------- checkpoint

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vocab"] = self.vocab.chars

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("vocab")
        if saved is not None and saved != self.vocab.chars:
            raise ConfigError(
                "ckpt_path",
                f"<checkpoint with a {len(saved)}-character vocabulary>",
                f"a checkpoint trained on this Python's pydoc_data corpus ({len(self.vocab)} characters)",
                "its character vocabulary differs (made with another Python release?)",
            )
