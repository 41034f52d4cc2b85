"""Recipe `tbptt`: truncated backpropagation through time, with ``hidden.detach()`` between chunks.

A recurrent language model (the shipped one: a character LSTM) reads a long sequence in chunks and
carries its hidden state (an LSTM's ``(h, c)``, a GRU's ``h``) from one chunk to the next, stepping
the optimizer after each chunk. The classic LSTM pitfall: the carried state still points into the
previous chunk's graph, which that chunk's backward has already freed, so the second chunk's backward raises

    RuntimeError: Trying to backward through the graph a second time, but the buffers have
    already been freed

The first fix people reach for, ``backward(retain_graph=True)``, only trades the error for another one
(the optimizer step has modified in place the weights that graph saved: "one of the variables
needed for gradient computation has been modified by an inplace operation"), and where it does
run it walks the whole history again on every chunk while keeping it all in memory: the memory
held for backward grows with the sequence. The real fix is the one used here
(``hidden = hidden.detach()``, PyTorch's word_language_model calls it ``repackage_hidden``): keep
the *values* of ``(h, c)`` so the next chunk starts where this one ended, cut the *graph* so its
backward stops at the chunk boundary. Memory then depends on the chunk length, not on the
sequence length; ``tests/recipes/test_tbptt.py`` proves that (counting the bytes autograd saves for
backward), that one chunk of the whole sequence is exactly full BPTT, and that chunk by chunk the
gradients equal a hand-written ``repackage_hidden`` loop.

Lightning removed its built-in TBPTT (``truncated_bptt_steps``) in 2.0, so the chunk loop lives in
``training_step`` under manual optimization.

Two layouts of the data, both first class (``data.layout``): ``sequences`` — every batch a set of
windows cut from the text, shuffled, each starting from an empty state, chunked inside; and
``streams`` — the corpus cut into B contiguous streams read in order, batch t the t-th window of
each, the detached state carried from one batch into the next (the truncated BPTT of language
modelling: word_language_model, AWD-LSTM, Transformer-XL's memory).

    python train.py recipe=tbptt
    python train.py recipe=tbptt data=text data.path=my.txt                   # any file, as bytes
    python train.py recipe=tbptt data=text data.level=words data.layout=streams data.path=train.txt \
        data.val_path=valid.txt
    python train.py --config-dir my_configs recipe=tbptt net=my_gru data=text data.path=my.txt
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics.aggregation import MeanMetric
from torchmetrics.text import Perplexity

from multiloss.base.module import Recipe
from multiloss.base.window import count_exact_as_mean
from multiloss.building.checks import call_component, check_rows_independent, describe_batch, describe_output
from multiloss.building.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.callbacks import TextSamples
from multiloss.config import ConfigError, require
from multiloss.data.batches import require_keys
from multiloss.data.vocabulary import Vocabulary
from multiloss.nets import repackage_hidden
from multiloss.saving.saved_state import CARRIED_KEY, VOCABULARY_KEY

LN2 = math.log(2.0)
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: a target with this id is not scored


class TruncatedBPTT(Recipe):
    """Language model, truncated BPTT: one optimizer step per chunk, the hidden state detached between chunks.

    Components:
        net (group ``net``, default ``char_lstm``: `multiloss.nets.CharLSTM`):
            ``forward(tokens, hidden)`` -> ``(logits, hidden)``, tokens and logits batch-first,
            ``hidden=None`` at the start of a sequence; ``hidden`` may be any nested structure of tensors
            (an LSTM's ``(h, c)``, a GRU's tensor) and is detached tree-wise between chunks; the logits
            are ``(batch, time, vocabulary size)``. The recipe passes the data's vocabulary size to a net
            config that leaves ``vocab_size`` out; one that sets it must set the data's.
        optimizer (group ``optimizer``, default ``adam``): a ``_partial_`` optimizer config.
        data: batches with ``x`` (token ids ``(batch, length)``) and ``y`` (the next tokens), and
            optionally ``mask`` (y's shape, 1 where a target is scored, 0 on padding; a target id of
            -100, cross_entropy's ``ignore_index``, is not scored either). The vocabulary is the
            data module's ``vocab`` (`multiloss.data.vocabulary.Vocabulary`: UTF-8 bytes, characters,
            words, or a number of opaque ids), or ``vocab`` here (a string of characters, a list of
            words, or a size); data of token ids that names none needs ``vocab``.

    Each batch's sequences are split by *length* into chunks of ``chunk_length`` tokens
    (``torch.split``; the last chunk is shorter when the length does not divide the batch's;
    ``chunk_length ≥ seq_len`` is one chunk, i.e. full BPTT). The step (``training_step``, manual
    optimization), per chunk: forward from the carried state, ``manual_backward`` of the chunk's mean
    cross-entropy over its scored tokens (a chunk with none adds no gradient), gradient clipping by
    norm (``gradient_clip_val``, 1.0 by default), the optimizer step, zeroing and the ``scheduler``,
    then the state detached (`multiloss.nets.repackage_hidden`).

    ``carry_state`` (null: the data's ``layout == "streams"``): the detached state at a batch's end is
    the next batch's start, and every epoch starts empty (the streams start again); a checkpoint
    holds it (every rank's), so a run stopped mid-epoch resumes exactly. Without it every batch starts
    empty (its sequences are shuffled windows, not continuations of the previous batch's).

    ``trainer.max_steps`` counts optimizer steps, i.e. chunks (with ``accumulate_grad_batches=1``);
    Lightning checks it after each batch, so a run ends on a whole batch.

    Accumulation (``accumulate_grad_batches = k``): a micro-batch is a *chunk*. The gradients of k
    consecutive chunks of a batch are summed before one clipped step; the state is still detached
    after every chunk, so memory stays that of one chunk. The last chunk of a batch always steps (no
    gradient is carried into the next batch). ``k ≥`` the number of chunks gives one step per batch.
    A recipe of chunks, not batches: ``global_batch_size`` is refused where it would make k > 1.

    How a step weighs its chunks (``accumulation_mean``, `multiloss.base.window`): ``examples`` (the
    default) weighs every scored token of a step the same, across its chunks and every rank's (their
    counts all-reduced once per batch): the step's gradient is that of the mean loss over all those
    tokens, as one backward of their summed loss would give (`multiloss.testing.tbptt_gradients` with
    ``count_exact=True`` is the reference). ``micro_batches`` is the plain loop's: each chunk's mean
    over its tokens / k, so the tokens of a short chunk (the last, when ``chunk_length`` does not
    divide the length) or of a padded one weigh more than a full chunk's, and under DDP a rank's
    tokens weigh 1/world size whatever their number. Under DDP the ranks' batches must split into
    the same number of chunks (one length), as the step count already requires.

    Logs ``loss/ce`` (nats per scored token, over the batch) per step, ``val/loss/ce`` and ``val/ppl``
    (perplexity, torchmetrics) per validation, and for bytes and characters ``train/bpc`` and
    ``val/bpc`` too (cross-entropy / ln 2: bits per character, or per byte). Validation runs chunk by
    chunk with the state carried (across batches too with ``carry_state``): its memory is that of one
    chunk, whatever the length of the sequences or streams (the scores are those of one forward over
    the whole sequence). At each epoch end, rank zero writes ``samples/epoch_NNN.txt``:
    ``sample_length`` tokens continuing ``sample_prompt`` (null: ``The`` where the vocabulary has it,
    else its first token; words are joined by spaces, ids written as ids), drawn with a private
    ``torch.Generator`` seeded by ``sample_seed`` (so sampling never moves the global random stream and
    exact resume holds), at ``sample_temperature`` (0 = greedy) (`multiloss.callbacks.TextSamples`).

    Raises:
        ConfigError: ``chunk_length``, ``accumulate_grad_batches`` or ``sample_length`` < 1;
            ``gradient_clip_val`` ≤ 0; ``sample_temperature`` < 0; a ``sample_prompt`` the vocabulary
            cannot encode; a net config's ``vocab_size`` other than the vocabulary's; the step options'
            checks (`multiloss.base.module.Recipe`); at setup (before any step or write), a ``mask`` that is not
            0/1 of ``y``'s shape, a token id of the data outside the vocabulary (or token data with no
            vocabulary), a net that does not return ``(logits, hidden)``, logits whose last dim is not the
            vocabulary size, a net whose sequences mix (one row's outputs change with another row's
            tokens: a time-major recurrent layer fed batch-first tokens), or a state that cannot be
            carried into the next chunk; a checkpoint made with another vocabulary.
    """

    # The recipe passes the data's vocabulary size to a net config that leaves it out (the validator
    # then does not ask for it).
    passed_to_components: ClassVar[dict[str, tuple[str, ...]]] = {"net": ("vocab_size",)}
    accumulates_batches = False  # its micro-batches are chunks of one batch: Lightning counts batches
    validation_loss = "val/loss/ce"

    def __init__(
        self,
        net: Any,
        optimizer: Any = None,
        vocab: str | int | list[str] | None = None,
        chunk_length: int = 32,
        carry_state: bool | None = None,
        sample_prompt: str | int | None = None,
        sample_length: int = 300,
        sample_temperature: float = 0.8,
        sample_seed: int = 0,
        count_exact: bool | None = None,  # earlier versions' key: model.accumulation_mean
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        # An LSTM's gradient explodes now and then: clipped at 1.0 unless the config says otherwise.
        super().__init__(**{"gradient_clip_val": 1.0, **step_options})
        require(chunk_length >= 1, "chunk_length", chunk_length, "an integer ≥ 1 (tokens per chunk)")
        require(sample_length >= 1, "sample_length", sample_length, "an integer ≥ 1 (tokens to generate)")
        require(sample_temperature >= 0, "sample_temperature", sample_temperature, "a number ≥ 0 (0 = greedy)")
        require(
            vocab is None
            or (isinstance(vocab, str | list) and len(vocab) > 0)
            or (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1),
            "vocab",
            vocab,
            "null (the data's vocabulary), a string of characters, a list of words, or a number of token ids ≥ 1",
        )
        self.vocab = Vocabulary(vocab)
        prompt = self.vocab.default_prompt() if sample_prompt is None else str(sample_prompt)
        unknown = self.vocab.unknown(prompt)
        require(
            len(prompt.strip() if self.vocab.kind in ("ids", "words") else prompt) >= 1 and not unknown,
            "sample_prompt",
            sample_prompt,
            "a non-empty prompt the vocabulary encodes"
            + {"ids": " (space-separated token ids)", "words": " (words separated by spaces)"}.get(self.vocab.kind, "")
            + ", or null",
            f"not in the vocabulary: {unknown}" if unknown else "empty",
        )
        net, optimizer = to_plain(net), to_plain(optimizer)
        if isinstance(net, dict) and net.get("vocab_size") not in (None, len(self.vocab)):
            raise ConfigError(
                "net.vocab_size",
                net["vocab_size"],
                f"{len(self.vocab)}, the vocabulary's size ({self.vocab}: data.level, data.path, or model.vocab); "
                "or leave vocab_size out, and the recipe passes it",
                f"the net would have {net['vocab_size']} logits for {len(self.vocab)} tokens",
            )
        self.save_hyperparameters(ignore=names_given_as_objects(net=net, optimizer=optimizer), logger=False)
        self.chunk_length, self.prompt = chunk_length, prompt
        self.carry_state = bool(carry_state)
        self.accumulation_mean = count_exact_as_mean(count_exact, self.accumulation_mean)
        self.net = build_module(net, "net", vocab_size=len(self.vocab))
        self.optimizer_factory = build_optimizer_factory(optimizer, "optimizer")
        self.carried: Any = None  # carry_state: the detached state at the last training batch's end
        self.val_state: Any = None  # ... and at the last validation batch's end
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.val_bpc = MeanMetric() if self.vocab.kind in ("bytes", "chars") else None

    @classmethod
    def from_data(cls, datamodule: L.LightningDataModule) -> dict[str, Any]:
        """What this recipe takes from the data module: its vocabulary, and whether it serves streams."""
        links: dict[str, Any] = {}
        vocab = getattr(datamodule, "vocab", None)
        if vocab is not None:
            links["vocab"] = vocab.to_plain() if isinstance(vocab, Vocabulary) else vocab
        if (layout := getattr(datamodule, "layout", None)) is not None:
            links["carry_state"] = layout == "streams"
        return links

    def forward(self, tokens: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
        """Next-token logits ``(batch, time, vocab)`` for ids ``tokens``, and the state after the last one."""
        return self.net(tokens, hidden)

    # ------------------------------------------------------------------ checks

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x", "y"), "token ids and the next tokens")
        for key in ("x", "y"):
            dtype = batch[key].dtype
            require(
                not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool),
                "data",
                f"<{key} of dtype {str(dtype).removeprefix('torch.')}>",
                "token ids in integer arrays (e.g. np.int64) for x and y, as data=text makes them; features "
                "of floats are data for the other recipes",
                f"{key} is {str(dtype).removeprefix('torch.')}: token ids must be integers",
            )
        self.check_token_ids()
        net, given = self.component_name("net"), describe_batch(batch)
        x = batch["x"][:, : min(4, batch["x"].shape[1])]
        out = call_component("model.net", net, self.net, x, None, given=f"tokens {describe_output(x)}, hidden None")
        if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            raise ConfigError(
                "model.net",
                net,
                "a network whose forward(tokens, hidden) returns (logits, hidden)",
                f"for {given} it returned {describe_output(out)}",
            )
        logits, hidden = out
        vocab = len(self.vocab)
        if logits.shape != (*x.shape, vocab):
            raise ConfigError(
                "model.net",
                net,
                f"logits of shape (batch, time, vocabulary size) = {(*x.shape, vocab)}: the vocabulary is "
                f"{self.vocab} (from the data, or model.vocab); a net config that leaves out vocab_size gets it",
                f"for tokens {tuple(x.shape)} it returned logits {tuple(logits.shape)}",
            )
        # A time-major recurrent layer fed batch-first tokens runs its recurrence across the batch: every
        # row's logits then depend on the rows before it. Caught here, with the likely cause named.
        check_rows_independent(
            "model.net",
            net,
            lambda tokens: self.net(tokens, None)[0],
            x,
            (x + 1) % vocab,
            "the net's rows mix: a recurrent layer that is time-major (nn.LSTM/GRU/RNN default "
            "batch_first=False) fed (batch, time) tokens; build it with batch_first=True, or transpose",
        )
        if self.chunk_length > batch["x"].shape[1] and not self.carry_state:
            rank_zero_warn(
                f"multiloss: model.chunk_length={self.chunk_length} exceeds the sequences' length "
                f"({batch['x'].shape[1]}, data.seq_len): one chunk per sequence, i.e. full BPTT, no truncation"
            )
        if "mask" in batch:
            mask = batch["mask"]
            require(
                isinstance(mask, torch.Tensor)
                and mask.shape == batch["y"].shape
                and bool(((mask == 0) | (mask == 1)).all()),
                "data",
                f"<mask {describe_output(mask)}>",
                f"a 0/1 (or boolean) mask of y's shape {tuple(batch['y'].shape)}: 1 where a target token is scored, "
                "0 on padding",
            )
        scored = self.scored_targets(batch)
        scored = scored[scored != IGNORE_INDEX]
        wrong = scored[(scored < 0) | (scored >= vocab)]
        require(
            wrong.numel() == 0,
            "data",
            f"<token id {int(wrong[0]) if wrong.numel() else None}>",
            f"target ids in [0, {vocab}) ({self.vocab}), or {IGNORE_INDEX} (or mask 0) on padding",
            "the data holds ids the net has no logits for",
        )
        call_component(
            "model.net",
            net,
            self.net,
            x,
            repackage_hidden(hidden),
            given=f"tokens {tuple(x.shape)} and the detached hidden state of the previous call",
        )

    def check_token_ids(self) -> None:
        """Every token id of the data (its ``max_token_id``, where it tells) has a row in the net's embedding."""
        datamodule = self.attached_datamodule
        largest = getattr(datamodule, "max_token_id", None)
        if largest is None:
            return
        from_data = getattr(datamodule, "vocab", None) is not None
        require(
            from_data or self.hparams.get("vocab") is not None,
            "model.vocab",
            None,
            f"the vocabulary's size: model.vocab=<n> (the data's largest token id is {largest}), or a vocab_size "
            "array in the data file (np.savez(..., vocab_size=n))",
            "the data holds token ids and names no vocabulary",
        )
        require(
            largest < len(self.vocab),
            "data",
            f"<token id {largest}>",
            f"input and target ids in [0, {len(self.vocab)}) ({self.vocab}): the net's embedding has "
            f"{len(self.vocab)} rows" + ("" if from_data else f"; or model.vocab={largest + 1} or more"),
            f"the data's largest token id is {largest}",
        )

    def total_optimizer_steps(self) -> int:
        """The run's optimizer steps: Lightning's batch count times this recipe's steps per batch (chunks / k)."""
        trainer = self.trainer
        lightning_estimate = super().total_optimizer_steps()  # sets the training data up: its batch count is known
        seq_len = getattr(trainer.datamodule, "seq_len", None)
        if not isinstance(seq_len, int) or trainer.max_epochs in (None, -1):
            return lightning_estimate
        per_batch = math.ceil(math.ceil(seq_len / self.chunk_length) / self.accumulate_grad_batches)
        steps = int(trainer.num_training_batches) * max(trainer.max_epochs, 1) * per_batch
        return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps

    # ---------------------------------------------------------------- training

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch, opt = self.prepare_batch(batch), self.optimizers()
        y = self.scored_targets(batch)
        # By length: chunks of chunk_length tokens (tensor_split(x, k) would make k chunks).
        xs = torch.split(batch["x"], self.chunk_length, dim=1)
        ys = torch.split(y, self.chunk_length, dim=1)
        tokens = torch.stack([(target != IGNORE_INDEX).sum() for target in ys])
        scales = self.chunk_scales(tokens)  # each chunk's summed token loss × this: its tokens' share, or mean / k
        # Streams: this batch goes on where the last one stopped (an epoch starts them again). Sequences: fresh.
        hidden = self.carried if self.carry_state and batch_idx > 0 else None
        nll_sum = y.new_zeros((), dtype=torch.float32)
        for i, (x, target) in enumerate(zip(xs, ys)):
            last = i == len(xs) - 1
            stepping = last or (i + 1) % self.accumulate_grad_batches == 0  # no gradient carried into the next batch
            # A chunk is a micro-batch: the block steps every k chunks and after the batch's last (clipping by global
            # norm, step, zeroing, schedule); under DDP only a chunk that steps all-reduces.
            with self.step_of(opt, stepping=stepping, batch_done=last) as step:
                logits, hidden = self.net(x, hidden)
                nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
                step.backward(nll * scales[i].to(nll.dtype), scaled=True)  # its tokens' share, or its mean / k
            # After the step: the next chunk starts from these values, its backward ends here.
            hidden = self.repackage_hidden(hidden)
            nll_sum = nll_sum + nll.detach().float()
        self.carried = hidden if self.carry_state else None
        ce = nll_sum / tokens.sum().clamp(min=1)
        self.log_losses({"ce": ce}, batch_size=len(y))
        if self.val_bpc is not None:  # bits per character: bytes and characters only
            self.log_train_values(("train/bpc",), (ce / LN2).reshape(1))

    @staticmethod
    def scored_targets(batch: dict[str, Any]) -> torch.Tensor:
        """``y`` with the tokens that are not scored (``mask`` 0) set to ``IGNORE_INDEX``, cross_entropy's skip id."""
        y = batch["y"]
        return y.masked_fill(batch["mask"] == 0, IGNORE_INDEX) if "mask" in batch else y

    def chunk_scales(self, tokens: torch.Tensor) -> torch.Tensor:
        """What multiplies each chunk's summed token loss in its backward.

        ``accumulation_mean=examples``: world size / the scored tokens of the chunk's whole step on every rank,
        which DDP's mean over ranks takes back out, so the step's gradient is the mean over all those tokens. One
        all-reduce of the batch's per-step token counts (under DDP); no host sync. A step with no scored token on
        any rank gets a zero gradient. ``micro_batches``: 1 / (the chunk's scored tokens · k) (its mean loss over
        k: every chunk of a step weighs the same, a short or padded chunk's tokens more than a full one's).
        """
        k = self.accumulate_grad_batches
        counts = tokens.double()  # exact counts, and a scale as exact as the loss it multiplies (float64 runs too)
        if self.accumulation_mean == "micro_batches":
            return 1 / (counts.clamp(min=1) * k)
        step_of_chunk = torch.arange(len(tokens), device=tokens.device) // k
        n_steps = (len(tokens) - 1) // k + 1  # from the chunk count, not the tensor: no host sync
        per_step = counts.new_zeros(n_steps).index_add_(0, step_of_chunk, counts)
        per_step = self.trainer.strategy.reduce(per_step, reduce_op="sum")
        return (self.trainer.world_size / per_step.clamp(min=1))[step_of_chunk]

    @staticmethod
    def repackage_hidden(hidden: Any) -> Any:
        """Keep the state's values, cut its graph: ``hidden.detach()``, tree-wise (`multiloss.nets`)."""
        return repackage_hidden(hidden)

    # -------------------------------------------------------------- validation

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        y = self.scored_targets(batch)
        # Chunk by chunk with the state carried: the scores of one forward over the whole sequence, the
        # memory of one chunk (logits are batch × chunk × vocabulary, not batch × sequence × vocabulary).
        hidden = self.val_state if self.carry_state and batch_idx > 0 else None
        nll_sum = y.new_zeros((), dtype=torch.float32)
        for x, target in zip(torch.split(batch["x"], self.chunk_length, 1), torch.split(y, self.chunk_length, 1)):
            logits, hidden = self.net(x, hidden)
            nll_sum = nll_sum + F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").float()
            self.val_ppl.update(logits.float(), target)
        self.val_state = hidden if self.carry_state else None
        n_tokens = (y != IGNORE_INDEX).sum()
        ce = nll_sum / n_tokens.clamp(min=1)
        self.log_losses({"ce": ce}, prefix=f"{self.eval_prefix}/loss/", batch_size=n_tokens)
        # Reduced over ranks by torchmetrics: the exact mean over every scored token of the set.
        self.log(f"{self.eval_prefix}/ppl", self.val_ppl, on_epoch=True, prog_bar=True)
        if self.val_bpc is not None:
            self.val_bpc.update(ce / LN2, weight=n_tokens)
            self.log(f"{self.eval_prefix}/bpc", self.val_bpc, on_epoch=True, prog_bar=True)

    # ------------------------------------------------------------------ sample

    @torch.no_grad()
    def generate(self, prompt: str, length: int, temperature: float, generator: torch.Generator) -> str:
        """``prompt`` followed by ``length`` tokens drawn from the model (``temperature`` 0 = greedy), as text."""
        was_training = self.training
        self.eval()
        logits, hidden = self.net(self.vocab.encode(prompt).to(self.device)[None], None)
        ids: list[int] = []
        for _ in range(length):
            last = logits[0, -1].float()
            if temperature == 0:
                nxt = last.argmax().view(1)
            else:
                nxt = torch.multinomial(F.softmax(last / temperature, dim=-1), 1, generator=generator)
            ids.append(int(nxt))
            logits, hidden = self.net(nxt.view(1, 1), hidden)
        self.train(was_training)
        return prompt + self.vocab.separator + self.vocab.decode(ids)

    def output_callbacks(self) -> list[L.Callback]:
        h = self.hparams
        metric = "val/bpc" if self.val_bpc is not None else "val/ppl"
        return [TextSamples(self.prompt, h.sample_length, h.sample_temperature, h.sample_seed, metric)]

    # -------------------------------------------------------------- checkpoint

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[VOCABULARY_KEY] = self.vocab.to_plain()
        if self.carry_state:
            # Every rank's own streams' state (a collective: every rank saves), stacked by rank.
            checkpoint[CARRIED_KEY] = apply_to_collection(self.carried, torch.Tensor, self._gathered)

    def _gathered(self, state: torch.Tensor) -> torch.Tensor:
        gathered = self.trainer.strategy.all_gather(state.contiguous())
        return (gathered if self.trainer.world_size > 1 else gathered[None]).cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.carry_state and (carried := checkpoint.get(CARRIED_KEY)) is not None:
            world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.attached_trainer else (1, 0)
            saved_world = next(t for t in _tensors(carried)).shape[0]
            if saved_world == world:
                self.carried = apply_to_collection(carried, torch.Tensor, lambda t: t[rank])
            else:
                rank_zero_warn(
                    f"multiloss: the checkpoint carries the state of {saved_world} ranks' streams and this run reads "
                    f"{world} ranks' (other streams): the state starts empty at the next batch"
                )
        self.check_checkpoint(checkpoint, "the checkpoint")

    def check_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        if VOCABULARY_KEY not in checkpoint:
            return
        saved = Vocabulary(checkpoint[VOCABULARY_KEY])
        if saved != self.vocab:
            raise ConfigError(
                "ckpt_path",
                path,
                "a checkpoint trained on this run's vocabulary (it comes from data.path, data.level, an npz's "
                "vocab_size): the data the checkpoint was trained on",
                f"its token ids mean other tokens (the checkpoint's vocabulary vs this data's: "
                f"{saved.difference(self.vocab)})",
            )

    def on_train_start(self) -> None:
        # A state restored from a checkpoint was loaded before the module reached its device.
        self.carried = apply_to_collection(self.carried, torch.Tensor, lambda t: t.to(self.device))


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(tree, torch.Tensor, found.append)
    return found
